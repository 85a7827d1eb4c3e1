"""The kernel's picture of a hang, by collective: per rank, the last completed and the pending
collective (sequence number, op, process group, shapes and dtypes, for how long), from torch's
flight recorder in each rank (rank/collectives.py); then who has not joined the collective the
others wait in, or who disagrees with them about it. %dipstack, Group.stacks(), a cell that timed
out or was interrupted, and heal lead with it; the Python stacks follow."""

from __future__ import annotations

_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
           "Bool": "bool", "ComplexFloat": "complex64", "ComplexDouble": "complex128"}


def tensors(e: dict) -> str:
    """float32[1024], int64[2, 3]: what a collective was given."""
    parts = []
    for dtype, shape in zip(e.get("dtypes") or [], e.get("sizes") or []):
        parts.append(f"{_DTYPES.get(dtype, dtype)}[{', '.join(map(str, shape))}]")
    return ", ".join(parts) or "no tensors"


def group_name(pg: str) -> str:
    return "the default group" if pg in ("default_pg", "0", "") else f"group {pg!r}"


def _call(e: dict) -> str:
    return f"{e['op']} #{e['seq']} ({tensors(e)})"


class CollectivePicture:
    """What each rank's flight recorder says, read as "who is missing from which collective".
    `snapshots`: rank -> rank/collectives.py's snapshot (or {"off": why})."""

    def __init__(self, snapshots: dict[int, dict]):
        self.snapshots = dict(sorted(snapshots.items()))
        self.findings: list[str] = []  # who has not joined, who disagrees
        self.missing: dict[int, tuple[str, dict]] = {}  # rank -> (group, the collective it has not entered)
        self.waiting: dict[int, tuple[str, dict, float]] = {}  # rank -> (group, entry, seconds)
        self.mismatched: set[int] = set()
        for pg in sorted({e["pg"] for s in self.snapshots.values() for e in s.get("entries", [])}):
            self._read_group(pg)

    @property
    def known(self) -> bool:
        """Whether any rank had collectives to show."""
        return any(s.get("entries") for s in self.snapshots.values())

    def _entries(self, rank: int, pg: str) -> list[dict]:
        return [e for e in self.snapshots[rank].get("entries", []) if e["pg"] == pg and not e["p2p"]]

    def _read_group(self, pg: str):
        members = [r for r, s in self.snapshots.items() if "off" not in s and self._in_group(r, s, pg)]
        pending = {r: [e for e in self._entries(r, pg) if not e["done"]] for r in members}
        firsts = [p[0]["seq"] for p in pending.values() if p]
        if not firsts:
            return
        k = min(firsts)
        ref = next(p[0] for p in pending.values() if p and p[0]["seq"] == k)
        waiters = [r for r in members if pending[r] and pending[r][0]["seq"] == k]
        for r in waiters:
            s = self.snapshots[r]
            e = pending[r][0]
            self.waiting[r] = (pg, e, max(0.0, (s["now_ns"] - e["created_ns"]) / 1e9))
        longest = max(self.waiting[r][2] for r in waiters)
        absent, differ = [], []
        for r in members:
            mine = next((e for e in self._entries(r, pg) if e["seq"] == k), None)
            if mine is None:
                absent.append(r)
                self.missing[r] = (pg, ref)
            elif (mine["op"], mine["sizes"], mine["dtypes"]) != (ref["op"], ref["sizes"], ref["dtypes"]):
                differ.append(r)
        who = _ranks(waiters)
        where = "" if pg in ("default_pg", "0", "") else f" of {group_name(pg)}"
        by_last: dict[str, list[int]] = {}  # ranks that stopped at the same collective: one line
        for r in absent:
            last = self._last(r, pg)
            by_last.setdefault(f"{last['op']} #{last['seq']}" if last else "", []).append(r)
        for last, ranks in by_last.items():
            one = len(ranks) == 1
            self.findings.append(
                f"{_ranks(ranks)} {'has' if one else 'have'} not entered {_call(ref)}{where}, which {who} "
                f"{'has' if len(waiters) == 1 else 'have'} waited in for {longest:.1f} s"
                + (f"; {'its' if one else 'their'} last collective was {last}" if last else
                   f"; {'it has' if one else 'they have'} run no collective in this group"))
        if differ:
            self.mismatched.update(differ + waiters)
            calls = "; ".join(f"rank {r}: {self._describe_seq(r, pg, k)}" for r in sorted(set(differ + waiters)))
            self.findings.append(f"ranks disagree about collective #{k}{where}: {calls}")
        if not absent and not differ and len(waiters) == len(members):
            self.findings.append(f"every rank is in {_call(ref)}{where} and it has not completed "
                                 f"after {longest:.1f} s (a peer outside these ranks, or the network)")

    def _in_group(self, rank: int, snap: dict, pg: str) -> bool:
        ranks = (snap.get("groups") or {}).get(pg)
        return rank in ranks if ranks else any(e["pg"] == pg for e in snap.get("entries", []))

    def _last(self, rank: int, pg: str) -> dict | None:
        entries = self._entries(rank, pg)
        return entries[-1] if entries else None

    def _describe_seq(self, rank: int, pg: str, k: int) -> str:
        e = next(e for e in self._entries(rank, pg) if e["seq"] == k)
        return f"{e['op']} {tensors(e)}"

    def rank_lines(self) -> list[str]:
        """One line per rank: where it is among its collectives."""
        lines = []
        for r, s in self.snapshots.items():
            if "off" in s:
                lines.append(f"rank {r}: {s['off']}")
                continue
            if r in self.waiting:
                pg, e, secs = self.waiting[r]
                where = "" if pg in ("default_pg", "0", "") else f" of {group_name(pg)}"
                text = f"rank {r}: waiting {secs:.1f} s in {_call(e)}{where}"
            else:
                text = f"rank {r}: in no collective"
            done = [e for e in s.get("entries", []) if e["done"] and not e["p2p"]]
            if done:
                text += f"; last completed: {done[-1]['op']} #{done[-1]['seq']}"
            lines.append(text)
        return lines

    def describe(self) -> str:
        """The block the messages lead with; "" when no rank had collectives to show."""
        if not self.known:
            return ""
        lines = ["collectives (torch's flight recorder):"] + ["  " + l for l in self.rank_lines()]
        lines += ["=> " + f for f in self.findings]
        return "\n".join(lines)


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class Stacks(dict):
    """Group.stacks(): rank -> that rank's Python stack (all threads), and `collectives`, the
    CollectivePicture of every rank asked at the same time; str() is the picture, then the stacks."""

    def __init__(self, stacks: dict[int, str], collectives: CollectivePicture):
        super().__init__(stacks)
        self.collectives = collectives

    def __str__(self) -> str:
        parts = [self.collectives.describe()] if self.collectives.known else []
        parts += [f"[rank {r}]\n{text.rstrip()}" for r, text in self.items()]
        return "\n".join(parts)
