"""The kernel's picture of a hang, by collective: per rank, the last completed and the pending
collective (sequence number, op, process group, shapes and dtypes, for how long), from torch's
flight recorder in each rank (rank/collectives.py); then who has not joined the collective the
others wait in, or who disagrees with them about it. %dipstack, Group.stacks(), a cell that timed
out or was interrupted, and heal lead with it; the Python stacks follow. The rule is the runtime's
(cpp/ddip/collectives.hpp), the one `ddip run` prints too; this hands it the ranks' snapshots."""

from __future__ import annotations

import json

from .. import _core


class CollectivePicture:
    """What each rank's flight recorder says, read as "who is missing from which collective".
    `snapshots`: rank -> rank/collectives.py's snapshot (or {"off": why}), as a dict or as its
    JSON text. `waiting`: rank -> the collective it waits in; `missing`: rank -> the collective
    the others wait in that it has not entered; `mismatched`: the ranks that disagree about one;
    `findings`: those in words; `waited_s`: rank -> seconds in its collective."""

    def __init__(self, snapshots: dict[int, dict | str | bytes]):
        self._picture = _core.CollectivePicture({int(r): _text(s) for r, s in snapshots.items()})
        self.findings: list[str] = list(self._picture.findings)
        self.waiting: dict[int, str] = dict(self._picture.waiting_in)
        self.missing: dict[int, str] = dict(self._picture.missing_from)
        self.mismatched: set[int] = set(self._picture.mismatched)
        self.waited_s: dict[int, float] = dict(self._picture.waited_s)

    @property
    def known(self) -> bool:
        """Whether any rank had collectives to show."""
        return self._picture.known

    def rank_lines(self) -> list[str]:
        """One line per rank: where it is among its collectives."""
        return list(self._picture.rank_lines())

    def describe(self) -> str:
        """The block the messages lead with; "" when no rank had collectives to show."""
        return self._picture.describe()


def _text(snapshot: dict | str | bytes) -> str:
    if isinstance(snapshot, bytes):
        return snapshot.decode(errors="replace")
    return snapshot if isinstance(snapshot, str) else json.dumps(snapshot)


class Stacks(dict):
    """Group.stacks(): rank -> that rank's Python stack (all threads), `collectives`, the
    CollectivePicture of every rank asked at the same time, and `stragglers` (kernel/stragglers.py)
    from the same answers; str() is the straggler's headline where one rank holds the others up,
    the picture, then the stacks."""

    def __init__(self, stacks: dict[int, str], collectives: CollectivePicture, stragglers=None):
        super().__init__(stacks)
        self.collectives = collectives
        self.stragglers = stragglers

    def __str__(self) -> str:
        parts = [self.stragglers.headline] if getattr(self.stragglers, "straggler", None) is not None else []
        parts += [self.collectives.describe()] if self.collectives.known else []
        parts += [f"[rank {r}]\n{text.rstrip()}" for r, text in self.items()]
        return "\n".join(parts)
