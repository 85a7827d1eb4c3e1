"""Repeats collapse, with the ranks named: a line that several ranks print alike is shown once,
labelled with them all ("[ranks 0-127] loss 0.31"), in %%dip --see all and ranch's output.

The rule is the runtime's, written once for the notebook and `ddip run` (cpp/ddip/output.hpp's
Repeats, bound as _core.Repeats): a rank's n-th line of a stream joins round n, written once
every rank gave its n-th line, or REPEAT_WINDOW_S after the first of them came (output stays
live), or at the end; lines that differ follow in rank order, and nothing is dropped. Here: the
lock and the thread that keep its time in the notebook."""

from __future__ import annotations

import threading
import time
from typing import Callable

from . import _core

# How long a line waits for the same line of the other ranks (0.2 s; ddip run's too).
REPEAT_WINDOW_S = _core.REPEAT_WINDOW_S

_STREAMS = {"stdout": 1, "stderr": 2}
_NAMES = {1: "stdout", 2: "stderr"}


class Repeats:
    """An on_output(rank, stream, text) callback that hands `out` each distinct line once:
    out(rank, stream, text) for a line of one rank, out((r0, r1, ...), stream, text) for a line
    that ranks r0 < r1 < ... all wrote. `ranks`: the ranks whose output comes (a round is complete
    when each of them, but those done(), gave its line). close() writes what is held; until then
    a thread of its own writes rounds whose time is up, as no further output may come to do it."""

    def __init__(self, out: Callable, ranks, window: float | None = None):
        self._out = out
        self._rule = _core.Repeats(list(ranks), REPEAT_WINDOW_S if window is None else window)
        self._cond = threading.Condition(threading.RLock())
        self._ticker: threading.Thread | None = None
        self._closed = False

    def __call__(self, rank, stream, text):
        if not text:
            return
        with self._cond:
            if self._closed:  # after the end (a late callback): as it is
                self._out(rank, stream, text)
                return
            self._write(self._rule.feed(rank, _STREAMS[stream], text, time.monotonic()))
            self._wake()

    def done(self, rank: int):
        """`rank` will print no more: rounds stop waiting for it."""
        with self._cond:
            self._write(self._rule.done(rank, time.monotonic()))

    def flush(self):
        """Writes every held line now (before a display, which must come after them)."""
        with self._cond:
            self._write(self._rule.release(time.monotonic(), True))

    def close(self):
        """The output ended: writes what is held, and the ticker ends."""
        with self._cond:
            self._write(self._rule.release(time.monotonic(), True))
            self._closed = True
            self._cond.notify_all()

    def _write(self, pieces):
        for ranks, stream, text in pieces:
            self._out(ranks[0] if len(ranks) == 1 else tuple(ranks), _NAMES[stream], text)

    # -- the ticker: rounds whose time is up, when no output comes to write them -------------------

    def _wake(self):
        if self._rule.next_due() is None:
            return
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="ddip-repeats", daemon=True)
            self._ticker.start()
        else:
            self._cond.notify_all()

    def _tick(self):
        with self._cond:
            while not self._closed:
                due = self._rule.next_due()
                now = time.monotonic()
                if due is not None and now >= due:
                    self._write(self._rule.release(now))
                    continue
                self._cond.wait(None if due is None else due - now)
