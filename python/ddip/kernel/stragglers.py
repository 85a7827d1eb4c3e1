"""The straggler named: for each rank, how long the others waited for it in the last collectives,
from the time each rank entered each one, as its torch flight recorder has it (rank/collectives.py's
snapshot). Group.stragglers() returns it; %dipstack and Group.stacks() lead with it when one rank
holds the others up. The arithmetic is the runtime's (cpp/ddip/stragglers.hpp); this holds the
result and draws it."""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from .. import _core

# How many of the most recent collectives Group.stragglers() and %dipstack look at.
LAST = 50


class Waited(NamedTuple):
    """One collective of the window: when its last rank entered it (seconds from the window's
    start), its process group ("0" is the default group), sequence number and op, the rank that
    entered it last, and how long the other members waited there for that rank, summed."""
    at_s: float
    pg: str
    seq: int
    op: str
    last: int
    wait_s: float


@dataclass(frozen=True, repr=False)
class Stragglers:
    """Who the others waited for in the last `last` collectives (`window` of them were on record).

    `held_s`: rank -> how long the others waited for it, summed over them; `share`: that as a
    share of the others' time in the window (span_s each); `last_in`: rank -> in how many of the
    window's collectives it was the last to enter; `straggler`: the rank that holds the others up
    (at least MIN_SHARE of their time, and LEAD times as long as any other rank), or None;
    `timeline`: the window's collectives (Waited), oldest first; `unread`: rank -> why its records
    could not be read. str() says who the straggler is, then one line per rank; plot() draws the
    wait over time."""

    MIN_SHARE: ClassVar[float] = _core.Stragglers.MIN_SHARE
    LEAD: ClassVar[float] = _core.Stragglers.LEAD

    last: int
    window: int
    start_ns: int
    span_s: float
    ranks: list[int]
    held_s: dict[int, float]
    share: dict[int, float]
    last_in: dict[int, int]
    straggler: int | None
    timeline: list[Waited]
    unread: dict[int, str]
    headline: str
    text: str

    @classmethod
    def of(cls, snapshots: dict[int, dict | str | bytes], last: int = LAST) -> "Stragglers":
        """From each rank's snapshot (rank -> the snapshot as a dict or as its JSON text)."""
        last = checked_last(last)
        core = _core.Stragglers({int(r): _text(s) for r, s in snapshots.items()}, last)
        return cls(last=core.last, window=core.window, start_ns=core.start_ns, span_s=core.span_s,
                   ranks=list(core.ranks), held_s=dict(core.held_s), share=dict(core.share),
                   last_in=dict(core.last_in), straggler=core.straggler,
                   timeline=[Waited(w.at_s, w.pg, w.seq, w.op, w.last, w.wait_s) for w in core.timeline],
                   unread=dict(core.unread), headline=core.headline(), text=core.describe())

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.text

    def _repr_pretty_(self, p, cycle):
        p.text(self.text)

    def plot(self, ax=None, cumulative: bool = True):
        """The wait over time, a line per rank: how long the others had waited for that rank by
        each collective of the window (cumulative), or a point per collective it entered last
        with how long they waited for it there (cumulative=False); x is seconds from the window's
        start. Draws on `ax` (a new figure without one) and returns it. Needs matplotlib."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError("Stragglers.plot() draws with matplotlib, which is not installed here: "
                              "pip install matplotlib (or ddip[plot])") from exc
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 3.5))
        for rank in self.ranks:
            xs, ys, total = [0.0], [0.0], 0.0
            for w in self.timeline:
                wait = w.wait_s if w.last == rank else 0.0
                total += wait
                xs.append(w.at_s)
                ys.append(total if cumulative else wait)
            label = f"rank {rank}" + (" (the straggler)" if rank == self.straggler else "")
            if cumulative:
                ax.step(xs, ys, where="post", label=label)
            else:  # a point where it was the last to enter
                ax.plot([w.at_s for w in self.timeline if w.last == rank],
                        [w.wait_s for w in self.timeline if w.last == rank], marker="o", linestyle="none",
                        label=label)
        ax.set_xlabel("seconds from the window's first collective")
        ax.set_ylabel("the others waited for it, s" + (" (so far)" if cumulative else " (per collective)"))
        ax.set_title("\n".join(textwrap.wrap(self.headline, 90)), fontsize="medium")
        if self.ranks:
            ax.legend(loc="upper left", fontsize="small")
        return ax


def checked_last(last) -> int:
    """`last` as a number of collectives, or a ValueError that says what to give."""
    if isinstance(last, bool) or not isinstance(last, int) or last < 1:
        raise ValueError(f"last={last!r}: give the number of most recent collectives to look at, "
                         f"a whole number of 1 or more (default {LAST})")
    return last


def _text(snapshot: dict | str | bytes) -> str:
    if isinstance(snapshot, bytes):
        return snapshot.decode(errors="replace")
    return snapshot if isinstance(snapshot, str) else json.dumps(snapshot)
