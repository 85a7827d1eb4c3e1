"""The SIGINT guard around the notebook's fn in a one-shot launch: when another rank failed, fn
is interrupted (a SIGINT of ddip's own) so the notebook gets control back, and the user's own
Ctrl-C still goes on as always.

Two SIGINTs meet in one handler: ours, sent to the main thread when another rank failed, and the
user's. Ours raises KeyboardInterrupt only inside fn (never while ctx sets up or tears down) and
never inside an import (a half-initialized module would break the kernel until a restart): where
it can't, the handler puts it off, and the stopper thread sends it again once it can land.
"""

from __future__ import annotations

import collections
import signal
import sys
import threading
import time
from typing import Callable

# How often the notebook's stack is looked at while our interrupt waits for a safe point.
_POLL_FIRST_S, _POLL_MAX_S = 0.005, 0.05
# Frames of the import system: every import that runs a module's code runs it under
# importlib._bootstrap._find_and_load (CPython 3.3 to 3.13, frozen or not).
_IMPORT_SYSTEM = frozenset({"importlib._bootstrap", "importlib._bootstrap_external", "_frozen_importlib",
                            "_frozen_importlib_external"})


class SigintGuard:
    """`with guard:` around fn in the notebook's rank; interrupt() when another rank failed;
    `sent` says whether ddip interrupted fn (or decided not to start it), so a KeyboardInterrupt
    is told apart from the user's.

    failed() says whether a rank failed already (then fn does not start); first_failed() names
    the rank that failed first, for the notice. delay_s: how long fn may take to end by itself
    before it is interrupted; notice_s: how long after that failure the notebook is told why its
    rank is still running, when our interrupt has not landed yet."""

    def __init__(self, rank: int | None, *, failed: Callable[[], bool], first_failed: Callable[[], int | None],
                 delay_s: float, notice_s: float):
        self.rank = rank
        self._failed, self._first_failed = failed, first_failed
        self._delay_s, self._notice_s = delay_s, notice_s
        self._lock = threading.Lock()
        self._in_fn = False
        self._sent = False  # ddip interrupted (or decided not to start) the notebook's fn
        self._seen = False  # ...and fn got it
        self._main_ident = None
        self._prev = None  # the SIGINT handler _on_sigint stands in for while fn runs
        self._own = collections.deque()  # our SIGINTs sent, not yet taken by _on_sigint
        self._in_flight = False  # one of ours is sent and not put off: none more until it is
        self._stopper: threading.Thread | None = None

    @property
    def sent(self) -> bool:
        return self._sent

    def __enter__(self):
        # Our interrupt (another rank failed) is only ever delivered inside here, never
        # while ctx sets up or tears down, and never inside an import.
        if threading.current_thread() is threading.main_thread():
            self._main_ident = threading.get_ident()
        self._guard()
        try:
            with self._lock:
                late = self._failed()  # a rank failed while ctx was entering: don't start
                self._in_fn = not late
                self._sent |= late
            if late:
                self._seen = True
                raise KeyboardInterrupt("another rank failed")
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        self._leave()
        return False

    def _leave(self):
        try:
            with self._lock:
                self._in_fn = False
        finally:
            self._unguard()

    def interrupt(self):
        """Gives the notebook control back when its fn waits, in Python, for a rank that failed.
        (A wait inside gloo ends by itself: the failed rank's peers are killed, so their
        connections close.)"""
        with self._lock:
            if not self._in_fn or self._stopper is not None or self._prev is None:
                return
            self._stopper = threading.Thread(target=self._stop_main, name="ddip-ranch-stopper", daemon=True)
        self._stopper.start()

    def _stop_main(self):
        """Sends our SIGINT to the notebook's fn, after a moment's delay that lets fn end by itself,
        and again each time the handler put it off (fn was importing), until it lands or fn ends."""
        started = time.monotonic()
        time.sleep(self._delay_s)
        poll, told = _POLL_FIRST_S, False
        while True:
            with self._lock:
                if not self._in_fn or self._seen or self._prev is None:
                    return
                frame = sys._current_frames().get(self._main_ident)
                importing = _inside_import(frame)
                if importing is None and not self._in_flight:
                    self._sent = self._in_flight = True
                    self._own.append(True)
                    signal.pthread_kill(self._main_ident, signal.SIGINT)
                unreached = self._in_flight
            if not told and time.monotonic() - started >= self._notice_s and (importing or unreached):
                told = True
                self._tell_still_running(importing, frame)
            del frame
            time.sleep(poll)
            poll = min(poll * 2, _POLL_MAX_S)

    def _on_sigint(self, signum, frame):
        """SIGINT while fn runs in the notebook: the user's goes on as always; ours raises
        KeyboardInterrupt only where unwinding is safe, else _stop_main sends it again later."""
        # Only this handler takes from the deque (other threads append), so a look is enough; the
        # user's KeyboardInterrupt must not be raised inside an except block, or its traceback
        # carries that exception as its context.
        if not self._own:
            return self._prev(signum, frame)  # the user's Ctrl-C: as always
        self._own.popleft()
        if not self._in_fn:
            return  # fn has ended: ctx's teardown is never interrupted
        if _inside_import(frame) is not None:
            self._in_flight = False  # half-initialized modules would break the kernel until a restart
            return
        self._seen = True
        raise KeyboardInterrupt("another rank failed")

    def _guard(self):
        # Only where SIGINT means KeyboardInterrupt, as in a kernel running a cell.
        if self._main_ident is not None and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._prev = signal.signal(signal.SIGINT, self._on_sigint)

    def _unguard(self):
        if self._prev is None:
            return
        try:
            # Ours, sent just as fn ended, is taken here by our handler, not in ctx's teardown.
            deadline = time.monotonic() + 1.0
            while self._own and time.monotonic() < deadline:
                time.sleep(0.001)
        finally:
            # Also undoes a handler fn left behind (Lightning ignores SIGINT after an interrupt).
            signal.signal(signal.SIGINT, self._prev)
            self._prev = None

    def _tell_still_running(self, importing, frame):
        first = self._first_failed()
        who = f"rank {first}" if first is not None else "another rank"
        if importing:
            why = (f"it is inside `import {importing}`, which an interrupt would leave half-initialized; "
                   f"it is interrupted once the import completes")
        else:
            where = f" ({frame.f_code.co_name} at {frame.f_code.co_filename}:{frame.f_lineno})" \
                if frame else ""
            why = f"it is in a call that does not return to Python{where}; it is interrupted once it returns"
        print(f"ddip: {who} failed, but the notebook's rank {self.rank} is still running fn: {why}",
              file=sys.stderr, flush=True)


def drop_handler_frame(exc):
    # The user's Ctrl-C ends where fn was, as it did before _on_sigint stood in for the handler.
    tb, last = exc.__traceback__, None
    while tb is not None and tb.tb_next is not None:
        last, tb = tb, tb.tb_next
    if last is not None and tb.tb_frame.f_code is SigintGuard._on_sigint.__code__:
        last.tb_next = None


def _inside_import(frame) -> str | None:
    """The outermost module whose import is running on the stack that `frame` tops, or None.

    The import system's own frames on the stack are the sign: they are there for every import,
    in every CPython from 3.9 to 3.13, and need no private structure (the module locks' layout
    changed in 3.12, and a lock is not even taken for every import)."""
    name, inner = None, None
    while frame is not None:
        if frame.f_globals.get("__name__") in _IMPORT_SYSTEM:
            if name is None:
                name = "?"
            if inner is not None and inner.f_code.co_name == "<module>" \
                    and inner.f_globals.get("__name__") not in _IMPORT_SYSTEM:
                name = inner.f_globals.get("__name__", "?")
        inner, frame = frame, frame.f_back
    return name
