"""Moving data: %dipush copies notebook variables to every rank, %dipull copies a rank's back."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..errors import RankFailedError
from . import render
from .flags import parse, usage_error
from .session import Session


def _names(names) -> list[str]:
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise UsageError(f"not variable names: {', '.join(bad)}")
    return names


def push(session: Session, names: list[str]):
    """The notebook's variables `names` into every rank (%dipush, and %dip --push)."""
    group = session.running_group()
    ns = session.shell.user_ns
    missing = [n for n in _names(names) if n not in ns]
    if missing:
        raise UsageError(f"not defined in the notebook: {', '.join(missing)}; nothing was pushed")
    try:
        group.push({n: ns[n] for n in names})
    except RankFailedError as exc:
        raise render.CellError(exc.headline, render.brief_entries(exc.failures)) from None


@magics_class
class DataMagics(Magics):
    """%dipush and %dipull."""

    def __init__(self, shell, session: Session):
        super().__init__(shell)
        self.session = session

    @magic_arguments()
    @argument("names", nargs="+", metavar="VAR", help="notebook variables to copy to every rank")
    @line_magic
    def dipush(self, line=""):
        """Copy notebook variables into every rank's namespace."""
        push(self.session, parse(self.dipush, line).names)

    @magic_arguments()
    @argument("-r", "--rank", type=int, default=None, metavar="RANK", help="the rank to copy from (default: 0)")
    @argument("names", nargs="+", metavar="VAR", help="rank variables to copy into the notebook")
    @line_magic
    def dipull(self, line=""):
        """Copy variables from rank 0 (or -r RANK) into the notebook."""
        fn = self.dipull
        args = parse(fn, line)
        group = self.session.running_group()
        rank = group.rank_ids[0] if args.rank is None else args.rank
        if rank not in group.rank_ids:
            raise usage_error(fn, f"-r {rank}: the group's ranks are {', '.join(map(str, group.rank_ids))}")
        try:
            values = group.pull(_names(args.names), rank=rank)
        except RankFailedError as exc:
            raise render.CellError(exc.headline, render.brief_entries(exc.failures)) from None
        self.shell.user_ns.update(zip(args.names, values))
