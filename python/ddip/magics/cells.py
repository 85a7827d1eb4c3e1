"""Running cells: %%dip runs a cell on the group's ranks (or in the notebook, or both); %autodip
runs every following cell that way."""

from __future__ import annotations

import sys
import time

from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..errors import GroupClosedError, RankDeadError, RankError, RankFailedError
from ..kernel import dap as _dap
from ..kernel.group import Group
from . import render
from .data import push
from .flags import cell_flags, parse, positive_seconds, rank_list, unquote, usage_error, without_comment
from .lifecycle import HEAL, RESTART
from .session import Session
from .tabs import RankTabs, tabbed

_WHERE = {"ranks": "ranks", "local": "local", "everywhere": "everywhere", "both": "everywhere"}
LINE_FORM = "as a line magic %dip takes --push VAR ...; to run code on the ranks, start the cell with %%dip"


@magics_class
class CellMagics(Magics):
    """%%dip and %autodip."""

    def __init__(self, shell, session: Session):
        super().__init__(shell)
        self.session = session

    # -- %%dip --------------------------------------------------------------------------------------

    @magic_arguments()
    @cell_flags
    @argument("--push", metavar="VAR", nargs="+",
              help="as a line magic only (%%dip --push VAR ...): copy these notebook variables to every rank, "
                   "as %%dipush does")
    @line_cell_magic
    def dip(self, line="", cell=None):
        """Run a cell on the group's ranks (ranks), in the notebook (local), or both (everywhere).
        As a line magic, %dip --push VAR ... copies notebook variables to every rank."""
        fn = self.dip
        if cell is None and "--push" not in without_comment(line):
            raise usage_error(fn, LINE_FORM)
        args = parse(fn, line)
        if cell is None:
            if not args.push:
                raise usage_error(fn, LINE_FORM)
            push(self.session, args.push)
            return
        if args.push:
            raise usage_error(fn, "--push goes on a line of its own (%dip --push VAR); not with %%dip")
        where = self._where(fn, args)
        positive_seconds(fn, "--timeout", args.timeout)
        if where == "local":
            self._run_local(cell)
            return
        group = self.session.running_group()
        ranks = None if args.ranks is None else rank_list(fn, "--ranks", args.ranks, group.rank_ids)
        shown = self._shown(fn, args, group, ranks)
        if where == "everywhere":
            self._run_local(cell)
        self._run_on_ranks(group, cell, shown, args.timeout, ranks, collapse=not args.raw, tabs=args.tabs)

    @staticmethod
    def _where(fn, args) -> str:
        where = _WHERE[args.where or "ranks"]
        if args.to is not None:
            to = _WHERE[args.to]
            if args.where is not None and to != where:
                raise usage_error(fn, f"'{args.where}' and --to {args.to} disagree; give one")
            where = to
        return where

    @staticmethod
    def _shown(fn, args, group, ranks=None) -> list[int]:
        running = list(group.rank_ids) if ranks is None else ranks
        if args.quiet:
            if args.see not in (None, "none"):
                raise usage_error(fn, f"-q shows no rank; it contradicts --see {args.see}")
            if args.tabs:
                raise usage_error(fn, "-q shows no rank; it contradicts --tabs")
            return []
        if args.see is None:
            return running if args.tabs else [running[0]]
        see = unquote(args.see).lower()
        if see == "all":
            return running
        if see == "none":
            if args.tabs:
                raise usage_error(fn, "--see none shows no rank; it contradicts --tabs")
            return []
        seen = rank_list(fn, "--see", args.see, group.rank_ids, "all, none or ranks like 0,2")
        idle = [r for r in seen if r not in running]
        if idle:
            raise usage_error(fn, f"--see {args.see} names rank(s) {', '.join(map(str, idle))}, which --ranks "
                                  f"{args.ranks} leaves out: they run nothing to show")
        return seen

    def _run_local(self, cell: str):
        self.session.running_local = True
        try:
            result = self.shell.run_cell(cell, store_history=False)
        finally:
            self.session.running_local = False
        if not result.success:
            # The notebook's own traceback has been shown; fail the cell without adding to it.
            raise render.CellError("the cell failed in the notebook; it did not run on the ranks")

    def _run_on_ranks(self, group: Group, cell: str, shown: list[int], timeout, ranks=None, collapse=True,
                    tabs=False):
        out = tabbed(shown, collapse) if tabs and shown else render.RankOutput(shown, collapse)
        error = None
        try:
            # Only the display form of the last value travels (values=False): the object stays in
            # the rank, so a CUDA tensor never starts CUDA here and nothing big is copied back.
            results = group.run(cell, on_output=out.on_output, on_display=out.on_display, timeout=timeout,
                                values=False, ranks=ranks, cell=_dap.cell_for(self.shell, group, cell, ranks))
        except RankFailedError as exc:
            results, error = exc.results or [], exc
        except KeyboardInterrupt as exc:
            # Group.run has already interrupted every rank and waited for them; no need for a
            # traceback of our own frames. (Raised again as a CellError so the cell counts as failed.)
            # A Ctrl-C that lands while we write output escapes Group.run before it interrupts
            # the ranks (its own KeyboardInterrupt carries the results): make sure none is left
            # running the cell. Ranks Group.run already gave its grace to are not waited for twice.
            busy = [r["rank"] for r in group.status() if r["state"] == "busy"]
            if busy and getattr(exc, "results", None) is None:
                group.interrupt(busy)
                _until_stopped(group, busy)
            raise render.CellError.of("KeyboardInterrupt", str(exc) or "interrupted",
                                      *render.stuck_lines(getattr(exc, "results", None))) from None
        except TimeoutError as exc:
            raise render.CellError.of("TimeoutError", str(exc),
                                      *render.stuck_lines(getattr(exc, "results", None))) from None
        except (RankError, GroupClosedError) as exc:  # refused before it was sent: nothing ran
            # A dead rank is named as a rank that dies while running a cell is.
            ename = exc.failures[0].ename if isinstance(exc, RankDeadError) else type(exc).__name__
            raise render.CellError.of(ename, exc.describe(restart=RESTART, heal=HEAL)) from None
        except RuntimeError as exc:  # anything else from the runtime: its message, not our frames
            raise render.CellError.of(type(exc).__name__, str(exc)) from None
        finally:
            out.close()  # the lines held for repeats, before the values and errors below
        self.session.last_results = results
        for r in results:
            if r.rank in out.shown and r.ok and r.format is not None:
                render.show_value(r.rank, r.execution_count, r.format)
        if error is not None:
            self.session.note_failure(error)
            if error.collectives is not None and error.collectives.known:  # who the others waited for
                print(error.collectives.describe(), file=sys.stderr, flush=True)
            if error.heal is not None:  # what happened to the group, before the ranks' tracebacks
                render.heal_note(error.heal)
            if isinstance(out, RankTabs):
                out.show_failures(error.failures)
            raise render.CellError(error.headline, render.failure_entries(error.failures, collapse)) from None

    # -- %autodip -----------------------------------------------------------------------------------

    @magic_arguments()
    @argument("state", nargs="?", choices=["on", "off"], help="on: every cell runs as %%%%dip; off: as written")
    @argument("-a", "--args", default="", metavar='"..."',
              help='%%%%dip flags for every cell, e.g. -a "--see all" (or --args=-q)')
    @line_magic
    def autodip(self, line=""):
        """Run every following cell as if it began with %%dip (a cell starting with % runs as written)."""
        fn = self.autodip
        s = self.session
        args = parse(fn, line)
        args.args = unquote(args.args)
        if args.state is None:
            if args.args:
                raise usage_error(fn, "-a goes with on: %autodip on -a \"--see all\"")
            print(s.autodip_state())
            return
        if args.state == "off":
            if args.args:
                raise usage_error(fn, "-a goes with on, not off")
            s.set_autodip(None)
            print(s.autodip_state())
            return
        group = s.running_group()
        # Check the flags now, so a typo fails here rather than in every following cell.
        dip_args = parse(self.dip, args.args)
        if dip_args.push:
            raise usage_error(fn, "--push is not a cell flag; use %dipush VAR")
        self._where(self.dip, dip_args)
        self._shown(self.dip, dip_args, group)
        s.set_autodip(args.args.strip())
        print(s.autodip_state())


def _until_stopped(group: Group, busy: list[int]):
    """Waits, as Group.run's own interrupt does (at most its grace), for interrupted ranks to
    finish, so that the next cell finds them idle; a further Ctrl-C stops waiting."""
    from ..kernel.request import INTERRUPT_GRACE_S

    deadline = time.monotonic() + INTERRUPT_GRACE_S
    try:
        while busy and time.monotonic() < deadline:
            group.runtime.pump(0.05)
            busy = [r["rank"] for r in group.status() if r["state"] == "busy" and r["rank"] in busy]
    except KeyboardInterrupt:
        pass
