"""Repeats collapse, with the ranks named: a line that several ranks print alike is shown once,
labelled with them all ("[ranks 0-127] loss 0.31"), in %%dip --see all and ranch's output.

Output is live and arrives a piece at a time per rank, so ddip can't wait for every rank's whole
output before writing any. The rule (the reason in one line: ranks running the same code print
their n-th lines at about the same time, so the n-th line is what to compare): a rank's n-th
line of a stream joins round n of that stream; a round is written once every expected rank
has given its n-th line, or REPEAT_WINDOW_S after its first line came, or when the output
ends. Rounds are written in order, each as its distinct lines, one per set of ranks, in rank
order; nothing is dropped. A line that comes after its round was written starts the round
again (stragglers collapse among themselves). Text that is no whole line (a '\\r' progress bar,
a line without its end for REPEAT_WINDOW_S) goes out as it is, after the rounds before it."""

from __future__ import annotations

import threading
import time
from typing import Callable

from .labels import pieces

# How long a line waits for the same line of the other ranks: short enough to read as live.
REPEAT_WINDOW_S = 0.2


class _Round:
    __slots__ = ("since", "ranks", "lines")

    def __init__(self, since: float):
        self.since = since
        self.ranks: set[int] = set()
        self.lines: dict[str, list[int]] = {}  # line (its end included) -> the ranks that wrote it


class Repeats:
    """An on_output(rank, stream, text) callback that hands `out` each distinct line once:
    out(rank, stream, text) for a line of one rank, out((r0, r1, ...), stream, text) for a line
    that ranks r0 < r1 < ... all wrote. `ranks`: the ranks whose output comes (a round is complete
    when each of them, but those done(), gave its line). close() writes what is held; until then
    a thread of its own writes rounds whose time is up, as no further output may come to do it."""

    def __init__(self, out: Callable, ranks, window: float | None = None):
        self._out = out
        self._expected = set(ranks)
        self._window = REPEAT_WINDOW_S if window is None else window
        self._cond = threading.Condition(threading.RLock())
        self._rounds: dict[str, dict[int, _Round]] = {"stdout": {}, "stderr": {}}  # by line index
        self._count: dict[tuple, int] = {}  # (rank, stream) -> its lines so far: its next line's round
        self._partial: dict[tuple, tuple[str, float]] = {}  # (rank, stream) -> (unended text, since)
        self._raw: set[tuple] = set()  # (rank, stream) whose current line went out as it is
        self._done: set[int] = set()
        self._ticker: threading.Thread | None = None
        self._closed = False

    def __call__(self, rank, stream, text):
        if not text:
            return
        with self._cond:
            if self._closed:  # after the end (a late callback): as it is
                self._out(rank, stream, text)
                return
            key = (rank, stream)
            held, since = self._partial.pop(key, ("", None))
            now = time.monotonic()
            for body, end in pieces(held + text):
                if not end:  # waits for its end from when it began
                    self._partial[key] = (body, now if since is None else since)
                    continue
                since = None
                if end == "\r" or key in self._raw:
                    self._write_raw(key, body + end)
                else:
                    self._add(key, body + end, now)
            self._release(now)
            self._wake()

    def done(self, rank: int):
        """`rank` will print no more: rounds stop waiting for it."""
        with self._cond:
            self._done.add(rank)
            self._release(time.monotonic())

    def flush(self):
        """Writes every held line now (before a display, which must come after them)."""
        with self._cond:
            self._release(time.monotonic(), everything=True)

    def close(self):
        """The output ended: writes what is held, and the ticker ends."""
        with self._cond:
            self._release(time.monotonic(), everything=True)
            self._closed = True
            self._cond.notify_all()

    # -- rounds --------------------------------------------------------------------------------

    def _add(self, key, line: str, now: float):
        rank, stream = key
        n = self._count.get(key, 0)
        self._count[key] = n + 1
        rnd = self._rounds[stream].get(n)
        if rnd is None:
            rnd = self._rounds[stream][n] = _Round(now)
        rnd.ranks.add(rank)
        rnd.lines.setdefault(line, []).append(rank)

    def _write_raw(self, key, text: str):
        rank, stream = key
        self._release_stream(stream, time.monotonic(), everything=True)  # this rank's lines before it
        self._out(rank, stream, text)
        if text.endswith("\n"):
            self._raw.discard(key)
            self._count[key] = self._count.get(key, 0) + 1
        else:
            self._raw.add(key)  # the rest of this line follows it as it is

    def _release(self, now: float, everything: bool = False):
        for stream in self._rounds:
            self._release_stream(stream, now, everything)
        for key, (text, since) in list(self._partial.items()):
            if everything or now >= since + self._window:
                del self._partial[key]
                self._write_raw(key, text)

    def _release_stream(self, stream: str, now: float, everything: bool):
        rounds = self._rounds[stream]
        waiting_for = self._expected - self._done
        for n in sorted(rounds):
            rnd = rounds[n]
            if not (everything or rnd.ranks >= waiting_for or now >= rnd.since + self._window):
                break  # later rounds wait for this one: each rank's lines keep their order
            del rounds[n]
            for line, ranks in sorted(rnd.lines.items(), key=lambda item: min(item[1])):
                ranks.sort()
                self._out(ranks[0] if len(ranks) == 1 else tuple(ranks), stream, line)

    # -- the ticker: rounds whose time is up, when no output comes to write them -------------------

    def _next_due(self) -> float | None:
        dues = [rnd.since for rounds in self._rounds.values() for rnd in rounds.values()]
        dues += [since for _, since in self._partial.values()]
        return min(dues) + self._window if dues else None

    def _wake(self):
        if self._next_due() is None:
            return
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="ddip-repeats", daemon=True)
            self._ticker.start()
        else:
            self._cond.notify_all()

    def _tick(self):
        with self._cond:
            while not self._closed:
                due = self._next_due()
                now = time.monotonic()
                if due is not None and now >= due:
                    self._release(now)
                    continue
                self._cond.wait(None if due is None else due - now)
