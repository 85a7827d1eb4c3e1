"""breakpoint() in a rank of `ddip run`: a prompt on ddip run's terminal (or in %%diprun's
notebook), labelled with the rank, whose answers reach this rank only.

ddip run sets PYTHONBREAKPOINT=ddip.rank.run_debug.set_trace in every rank (unless the user set
it) and gives each rank a stdin pipe of its own. At each prompt, this writes one record to the
rank's stderr, "rank waits at a prompt" with what the debugger printed since the last one (the
`prompt` record of cpp/tools/run_protocol.hpp), and reads the answer, one line, from stdin; ddip
run shows the prompt when it is this rank's turn and writes the line typed there. When the
debugger leaves (`c`), one more record, without a prompt, carries its last words and ends its
turn. `pdb.set_trace()` comes here too (ddip.rank.run_hook makes pdb's set_trace this one). The
debugger is
the rank debugger of ddip.rank.debugger (IPython's pdb), which a %%dip cell's breakpoint() uses
too. When nobody can answer (stdin at its end: ddip run's own stdin is not a terminal or a pipe,
or has ended), the rank says so once and goes on, as if there were no breakpoint.
"""

from __future__ import annotations

import os
import sys

from .debugger import PromptRelay, RankPdb
from .run_hook import field as _field

_RECORD = "\x1eddip prompt"
_noted = False


def _rank() -> str:
    return os.environ.get("RANK", "0")


def _write(fd: int, data: bytes):
    while data:
        data = data[os.write(fd, data):]


def _readline() -> str | None:
    """One line of stdin, without its end; None at end of file. Byte by byte: nothing read ahead
    stays in a buffer of Python's that the next prompt would not see."""
    line = bytearray()
    while True:
        try:
            c = os.read(0, 1)
        except OSError:
            return None
        if not c:
            return None
        if c == b"\n":
            return line.decode("utf-8", "replace")
        line += c


def _ask(output: str, prompt: str | None) -> str | None:
    global _noted
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # what the rank printed before it stopped comes first
        except (AttributeError, ValueError, OSError):
            pass
    # An empty prompt: the debugger has left (its last words), and another rank may have its turn.
    _write(2, f"{_RECORD} {_rank()} {_field(output)} {_field(prompt or '')}\n".encode("utf-8", "replace"))
    if prompt is None:
        return None
    line = _readline()
    if line is None and not _noted:
        _noted = True
        sys.stderr.write(f"ddip: breakpoint() on rank {_rank()} stopped at a debugger prompt, but nobody can "
                         f"answer it (ddip run's stdin is not a terminal or a pipe, or has ended); it goes on "
                         f"(PYTHONBREAKPOINT=0 turns breakpoint() off)\n")
        sys.stderr.flush()
    return line


class _RunPdb(RankPdb):
    """The rank debugger, which says it has left even when it leaves by an exception (Ctrl-C at
    its prompt, which a script may catch and go on from): ddip run then gives the next rank its
    turn."""

    def __init__(self, relay: PromptRelay):
        self._leaving = relay
        super().__init__(relay)

    def interaction(self, frame, traceback):
        try:
            super().interaction(frame, traceback)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                exc.ddip_at_prompt = True  # _without_debugger_frames shows it from the user's line
            self._leaving.leave()
            raise


def _debugger_files() -> set[str]:
    import bdb
    import pdb

    from IPython.core import debugger as ipython_debugger

    from . import debugger

    return {os.path.abspath(m.__file__) for m in (bdb, pdb, ipython_debugger, debugger, sys.modules[__name__])}


def _without_debugger_frames(previous):
    """sys.excepthook: the stop button at a prompt ends the script with KeyboardInterrupt raised in
    the debugger; its traceback shows the user's frames, not the five of pdb's and ddip's under
    them (ddip run repeats the last lines of a rank's stderr in its report)."""
    import traceback

    def hook(etype, value, tb):
        if not getattr(value, "ddip_at_prompt", False):
            return previous(etype, value, tb)
        shown = traceback.TracebackException(etype, value, tb)
        files = _debugger_files()
        shown.stack = traceback.StackSummary.from_list(
            [f for f in shown.stack if os.path.abspath(f.filename) not in files])
        sys.stderr.write("".join(shown.format()))
        sys.stderr.flush()

    return hook


def set_trace(*, header=None, frame=None):
    """breakpoint() / PYTHONBREAKPOINT's hook: stops in the caller's frame (or `frame`: pdb.set_trace
    made this by ddip.rank.run_hook passes its caller's) with a prompt that ddip run shows."""
    if not getattr(sys.excepthook, "ddip_run_debug", False):
        sys.excepthook = _without_debugger_frames(sys.excepthook)
        sys.excepthook.ddip_run_debug = True
    debugger = _RunPdb(PromptRelay(_ask))
    if header is not None:
        debugger.message(header)
    debugger.set_trace(frame or sys._getframe().f_back)
