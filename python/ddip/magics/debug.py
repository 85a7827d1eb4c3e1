"""Debugging a rank: %dipdebug opens pdb in a rank on its last exception; %dippdb on opens it by
itself after a failed %%dip cell (as %debug and %pdb do for the notebook's own cells). The
prompts come through the notebook's input box, labelled with the rank (ddip/kernel/debugger.py);
breakpoint() in a rank's code prompts the same way without any magic."""

from __future__ import annotations

import sys

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..errors import GroupClosedError, RankError, RankFailedError
from ..kernel.debugger import root_cause_rank
from . import render
from .flags import parse, rank_list, usage_error
from .lifecycle import HEAL, RESTART
from .session import Session


@magics_class
class DebugMagics(Magics):
    """%dipdebug and %dippdb."""

    def __init__(self, shell, session: Session):
        super().__init__(shell)
        self.session = session

    @magic_arguments()
    @argument("-r", "--rank", metavar="RANK",
              help="the rank to debug (default: the root cause of the last failed %%%%dip cell)")
    @line_magic
    def dipdebug(self, line=""):
        """pdb, post-mortem, in a rank on the last exception its code raised, with its frames and
        locals alive; the prompt comes through the notebook, labelled with the rank. q leaves."""
        fn = self.dipdebug
        args = parse(fn, line)
        group = self.session.running_group()
        if args.rank is not None:
            ranks = rank_list(fn, "-r", args.rank, group.rank_ids, "one rank, like 1")
            if len(ranks) != 1:
                raise usage_error(fn, f"-r {args.rank}: give one rank; debug the others one after another")
            rank = ranks[0]
        else:
            rank = self._root_cause_rank()
        self._debug(group, rank)

    @magic_arguments()
    @argument("state", nargs="?", choices=["on", "off"],
              help="on: after a failed %%%%dip cell, open %%dipdebug by itself; no argument: toggle")
    @line_magic
    def dippdb(self, line=""):
        """Open the debugger by itself on the root-cause rank after a %%dip cell fails (as %pdb)."""
        args = parse(self.dippdb, line)
        s = self.session
        s.auto_debug = (not s.auto_debug) if args.state is None else args.state == "on"
        print(f"the rank debugger (%dippdb) is {'on' if s.auto_debug else 'off'}")

    def after_cell(self, result=None):
        """post_run_cell: with %dippdb on, a %%dip cell that failed on its ranks (its traceback
        shown already) is followed by the debugger on its root-cause rank."""
        s = self.session
        error, s.new_error = s.new_error, None
        if error is None or not s.auto_debug or not s.running:
            return
        try:
            rank = root_cause_rank(error, "", "%dipdebug -r {rank}")
        except LookupError as exc:
            print(f"ddip: %dippdb: {exc}", file=sys.stderr)
            return
        try:
            self._debug(s.group, rank)
        except (UsageError, render.CellError) as exc:
            print(f"ddip: %dippdb: {exc}", file=sys.stderr)

    def _root_cause_rank(self) -> int:
        try:
            return root_cause_rank(self.session.last_error, "no %%dip cell has failed on the ranks yet",
                                   "%dipdebug -r {rank}")
        except LookupError as exc:
            raise UsageError(f"%dipdebug: {exc}") from None

    def _debug(self, group, rank: int):
        try:
            group.debug(rank)
        except LookupError as exc:
            raise UsageError(f"%dipdebug: {exc}".replace("debug(rank=...)", "%dipdebug -r N")) from None
        except RankFailedError as exc:  # interrupted at its prompt, or died while debugged
            raise render.CellError(exc.headline, render.failure_entries(exc.failures)) from None
        except KeyboardInterrupt as exc:
            raise render.CellError.of("KeyboardInterrupt", str(exc) or "interrupted") from None
        except (RankError, GroupClosedError) as exc:  # busy, dead or stopped: nothing ran
            raise render.CellError.of(type(exc).__name__, exc.describe(restart=RESTART, heal=HEAL)) from None
