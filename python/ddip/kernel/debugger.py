"""The kernel's side of a rank's debugger: the prompts of pdb running in ranks, asked here.

A rank's pdb (ddip/rank/debugger.py) sends each prompt, with what it printed since the last
one, as part of the request the rank runs. The request's waiter (request.collect) queues them in
the order they came and asks them here one at a time: pdb's output labelled with the rank, then
`input("[rank N] (Pdb) ")`, which in a Jupyter kernel is the frontend's input box (the kernel's
stdin channel, as %debug uses) and in a terminal IPython the terminal. The line typed goes back
to that rank alone, while its request is still pending (Runtime.answer). A rank whose prompt
was answered keeps the floor until its pdb leaves the prompt ('c', 'n', 'q'), so two ranks'
sessions are not interleaved.
"""

from __future__ import annotations

import collections
import os
import sys
import threading

from ..labels import LabelledOutput, rank_label
from ..messages import PromptAnswer

PROMPT = "ddip_prompt"  # the key of a rank's prompt among its display messages
# One prompt at a time in this process: ranch's children are asked from its collecting thread
# while the notebook's own rank may be at its own pdb prompt in the main thread.
PROMPT_LOCK = threading.RLock()


def prompt_of(msg) -> dict | None:
    """A rank's debugger prompt ({"output": ..., "prompt": ...}) when `msg` is one."""
    if isinstance(msg, dict) and PROMPT in msg:
        return msg[PROMPT]
    return None


class Prompts:
    """A request's waiting debugger prompts (slot, prompt), in the order they came."""

    def __init__(self):
        self.items: collections.deque = collections.deque()
        self.floor = None  # the slot whose pdb session is going on: its prompts come first

    def __bool__(self):
        return bool(self.items)

    def add(self, slot: int, prompt: dict):
        self.items.append((slot, prompt))

    def next(self, pending) -> tuple | None:
        """The next one to ask (or to note that its pdb left its prompt); None while the rank
        holding the floor has not prompted again (its other ranks' prompts wait)."""
        if self.floor is not None and self.floor not in pending:
            self.floor = None  # it finished (or died) meanwhile
        for i, (slot, prompt) in enumerate(self.items):
            if self.floor is None or slot == self.floor or prompt.get("left"):
                del self.items[i]
                return slot, prompt
        return None

    def ask(self, rt, req, slot: int, prompt: dict):
        if prompt.get("left"):
            show(rt.rank_ids[slot], prompt.get("output"))
            if self.floor == slot:
                self.floor = None
            return
        self.floor = slot
        ask(rt, req, slot, prompt)


def show(rank, output):
    """What a rank's pdb printed, labelled with the rank."""
    if output:
        LabelledOutput()(rank, "stdout", output if output.endswith("\n") else output + "\n")
        sys.stdout.flush()


def _a_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


def _cannot_ask(rank, why: str):
    sys.stderr.write(f"ddip: {rank_label(rank)} stopped at a debugger prompt, but {why}; it continues "
                     f"(PYTHONBREAKPOINT=0 in the rank's env= turns breakpoint() off)\n")


def ask(rt, req, slot: int, prompt: dict) -> None:
    """Shows a rank's prompt and sends it the line typed. KeyboardInterrupt (Ctrl-C, the stop
    button) goes to the caller, whose interrupt frees the rank; once its request was
    interrupted, a prompt is not shown: the rank is told to stop."""
    rank = rt.rank_ids[slot]
    show(rank, prompt.get("output"))
    if req.interrupted_at is not None:
        rt.answer(slot, req, PromptAnswer(stop=True))
        return
    try:
        with PROMPT_LOCK:
            line = input(f"{rank_label(rank)} {prompt.get('prompt') or '(Pdb) '}")
    except EOFError:
        # Ctrl-D in a terminal is pdb's own end of input; a script's stdin at its end (< /dev/null,
        # a pipe that ran out) is nobody to ask: the rank goes on, as below, not into BdbQuit.
        line = "EOF" if _a_terminal() else None
        if line is None:
            _cannot_ask(rank, "this process's stdin is at its end (not a terminal)")
    except (NotImplementedError, OSError):  # a frontend without input, or stdin captured
        _cannot_ask(rank, "this frontend can't take input (a Jupyter client needs allow_stdin)")
        line = None
    rt.answer(slot, req, PromptAnswer(line))


def root_cause_rank(error, nothing: str, give: str) -> int:
    """The rank to debug after `error` (a RankFailedError, or None: nothing failed): its root cause,
    when that rank's code raised. LookupError otherwise, its message ending in how to `give` a
    rank (`give` has "{rank}": debug(rank={rank}), %dipdebug -r {rank}), naming a rank whose code
    did raise, if one did (never a dead one); `nothing` says what has not failed."""
    from ..errors import FailureKind

    if error is None:
        raise LookupError(f"nothing to debug: {nothing}; give the rank: {give.format(rank=1)}")
    first = error.failures[0]
    if first.kind is not FailureKind.RAISED:
        raised = [f for f in error.failures if f.kind is FailureKind.RAISED]
        # ddip's own interrupt of the others (KeyboardInterrupt) last: their frames say least.
        raised.sort(key=lambda f: f.ename == "KeyboardInterrupt")
        why = "a dead rank has no frames left to debug (heal replaces it: %makedip --heal, g.heal())" \
            if first.died else "there is no exception to debug in it"
        then = (f"; rank {raised[0].rank}'s code raised ({raised[0].ename}): {give.format(rank=raised[0].rank)}"
                if raised else "; no other rank's code raised in it")
        raise LookupError(f"the last failure's root cause, rank {first.rank}, {first.kind} ({first.evalue}): "
                          f"{why}{then}")
    return first.rank


def _can_ask_here() -> str | None:
    """Why this process can't ask a prompt with input(), or None when it can: a Jupyter kernel
    whose client allows input, or a terminal."""
    try:
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
    except ImportError:
        kernel = None
    if kernel is not None:
        return None if getattr(kernel, "_allow_stdin", True) else \
            "this frontend can't take input (a Jupyter client needs allow_stdin)"
    return None if _a_terminal() else "this process's stdin is at its end (not a terminal)"


def notebook_breakpointhook(rank: int):
    """breakpoint() in the notebook while it plays rank `rank` of a launch (ranch): IPython's pdb
    on the caller's frame, its prompt labelled with the rank (`[rank 0] ipdb> `) and asked as the
    children's are, one prompt at a time; where nobody can answer, a note and the code goes on."""
    from IPython.core.debugger import Pdb

    class NotebookRankPdb(Pdb):
        def __init__(self):
            super().__init__()
            self.prompt = f"{rank_label(rank)} ipdb> "

        def interaction(self, frame, traceback):
            with PROMPT_LOCK:  # a child's prompt waits until this session leaves its prompt
                super().interaction(frame, traceback)

    def hook(*args, **kwargs):
        if os.environ.get("PYTHONBREAKPOINT") == "0":
            return
        why = _can_ask_here()
        if why is not None:
            _cannot_ask(rank, why)
            return
        NotebookRankPdb().set_trace(sys._getframe().f_back)

    return hook
