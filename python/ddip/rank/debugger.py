"""A rank's debugger: IPython's pdb (the one %debug opens in a notebook), in the rank, on the
rank's own frames, with its prompt answered in the notebook.

pdb reads its commands from and writes its output to a `PromptRelay`. At each prompt the relay
hands what pdb printed since the last one, and the prompt, to `ask` (the worker's loop sends them
to the kernel with the request being run and waits for the line typed there; see
ddip.rank.worker.Worker.ask_kernel), so the kernel shows pdb's output and the prompt in that order,
labelled with the rank, whichever ranks the cell shows.

Two ways in: `post_mortem()` on the rank's last exception (sys.last_traceback, kept as IPython
keeps it), and `set_trace()`, which is `breakpoint()` and `pdb.set_trace()` in a rank while a
request runs.
"""

from __future__ import annotations

import io
import os
import pdb
import sys
import threading
from typing import Callable

from IPython.core.debugger import Pdb

# ask(output, prompt) -> the line typed at the prompt; None: nobody can answer (a frontend
# without input): leave the debugger and go on; STOP: the request was interrupted.
# ask(output, None) says the debugger left its prompt (the code goes on), and waits for nothing.
Ask = Callable[[str, str], "str | None"]
STOP = object()

_ask: Ask | None = None
_can_ask: Callable[[], bool] = lambda: False  # noqa: E731


class Interrupted(BaseException):
    """Raised out of pdb's loop (which takes KeyboardInterrupt as 'cancel this command'): the
    request was interrupted while the rank waited at a prompt."""


class NothingToDebug(LookupError):
    """The rank has no exception of its own to debug."""


class PromptRelay:
    """pdb's stdin and stdout: output is kept until the next prompt, which goes with it."""

    def __init__(self, ask: Ask):
        self._ask = ask
        self._out = io.StringIO()
        self.prompt = "ipdb> "
        self.debugger: RankPdb | None = None

    def write(self, text: str) -> int:
        return self._out.write(text)

    def flush(self):
        pass

    def taken(self) -> str:
        """What pdb printed since the last prompt (and forgets it)."""
        text, self._out = self._out.getvalue(), io.StringIO()
        return text

    def readline(self) -> str:
        try:
            line = self._ask(self.taken(), self.prompt)
        except KeyboardInterrupt:
            raise Interrupted from None
        if line is STOP:
            raise Interrupted
        if line is None:  # nobody to ask: continue, as if no breakpoint were there
            if self.debugger is not None:
                self.debugger.clear_all_breaks()
            return "continue\n"
        return line + "\n"

    def leave(self):
        """The debugger left its prompt: the kernel may ask other ranks' prompts now."""
        self._ask(self.taken(), None)


class RankPdb(Pdb):
    """IPython's pdb (which hides IPython's own frames, as %debug does), whose prompt the notebook shows (pdb must not write it into the output too), that
    keeps the rank's SIGINT handler (Ctrl-C in the notebook), and that turns an interrupt at the
    prompt into KeyboardInterrupt in the code being debugged."""

    def __init__(self, relay: PromptRelay):
        self._relay = relay
        relay.debugger = self
        super().__init__(stdin=relay, stdout=relay, nosigint=True, readrc=False)

    @property
    def prompt(self) -> str:
        return ""  # cmd writes this before reading a line; the relay sends the real one

    @prompt.setter
    def prompt(self, value: str):
        self._relay.prompt = value

    def interaction(self, frame, traceback):
        try:
            super().interaction(frame, traceback)
        except Interrupted:
            self.set_quit()  # no more tracing: the code being debugged ends with the interrupt
            raise KeyboardInterrupt("interrupted at the debugger's prompt") from None
        self._relay.leave()


def install(ask: Ask, can_ask: Callable[[], bool]):
    """Makes breakpoint() and pdb.set_trace() in this rank prompt through `ask` while
    `can_ask()` (a request is running whose caller can answer)."""
    global _ask, _can_ask
    _ask, _can_ask = ask, can_ask
    sys.breakpointhook = breakpoint_hook
    pdb.set_trace = set_trace  # pdb's own would read the rank's stdin, which is at its end


def breakpoint_hook(*args, **kwargs):
    """breakpoint() in a rank; PYTHONBREAKPOINT=0 switches it off, as it does in Python."""
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return
    set_trace(frame=sys._getframe().f_back)


def set_trace(*, header=None, frame=None):
    """pdb.set_trace() in a rank: stops in the caller's frame with a prompt in the notebook."""
    if _ask is None or not _can_ask():
        rank = os.environ.get("RANK", "?")
        thread = threading.current_thread()
        if thread is not threading.main_thread():  # a request may well be running: say the true reason
            why = (f"it is in thread {thread.name!r}, and only the thread that runs the cell (or run / "
                   f"apply) can prompt: a prompt for another thread is not supported yet")
        else:
            why = ("no request is running whose caller can answer its prompt (only code a cell, run or "
                   "apply runs can stop)")
        sys.stderr.write(f"ddip: breakpoint() on rank {rank} was skipped: {why}\n")
        return
    debugger = RankPdb(PromptRelay(_ask))
    if header is not None:
        debugger.message(header)
    debugger.set_trace(frame or sys._getframe().f_back)


def post_mortem() -> None:
    """pdb on the rank's last exception, its frames and locals as they were when it raised."""
    tb = getattr(sys, "last_traceback", None)
    if tb is None or _ask is None:
        rank = os.environ.get("RANK", "?")
        raise NothingToDebug(f"rank {rank} has no exception to debug: no code it ran has raised "
                             f"since it started")
    debugger = RankPdb(PromptRelay(_ask))
    debugger.reset()
    debugger.interaction(None, tb)


def keep_last_exception(exc: BaseException, tb) -> None:
    """What post_mortem() debugs: the exception a request's code raised, with its frames, as
    IPython keeps a cell's (sys.last_type, last_value, last_traceback)."""
    if tb is None:
        return
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = exc
