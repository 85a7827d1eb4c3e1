"""What the rank panel shows, taken from a group without touching its ranks' code: each rank's
state in words (idle, running cell N for T s, at a debugger prompt, waiting in collective
`all_reduce #7` for T s, dead with its cause, replaced by heal), CPU %, resident memory, GPU
utilisation and memory (nvidia-smi, matched by pid), the last line it printed; the straggler
(Group.stragglers()' rule) when one rank holds the others up; at HOSTS_FROM hosts or more, one
row per host. Plain data and text: kernel/panel_view.py draws it with widgets, %dipstatus and
g.status() show it.

What it costs the ranks: /proc and nvidia-smi are read here; only the flight recorder is asked
of them (the answer their runtime thread gives, as for %dipstack), and only while a rank is busy.
"""

from __future__ import annotations

import html
import os
import time
import weakref
from dataclasses import dataclass, field

from .. import gpus as _gpus
from ..errors import GroupClosedError
from .collectives import CollectivePicture
from .stragglers import Stragglers

# From this many hosts on, the panel has one row per host, expandable to its ranks.
HOSTS_FROM = 16
# How long the ranks have to answer the flight-recorder question of one sample.
ASK_TIMEOUT_S = 0.5
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class RankRow:
    """One rank as the panel shows it. `state` is Group.status()'s word (idle, busy, dead,
    unresponsive, starting); `doing` says it in full."""

    rank: int
    pid: int | None
    host: str | None
    device: str
    state: str
    doing: str
    cpu_pct: float | None = None
    rss_mb: float | None = None
    gpu_util: int | None = None  # percent, of the GPU the rank uses
    gpu_mib: int | None = None
    last_line: str = ""
    straggler: bool = False

    def cells(self) -> list[str]:
        return [str(self.rank), "-" if self.pid is None else str(self.pid), self.device, self.doing,
                "-" if self.cpu_pct is None else f"{self.cpu_pct:.0f}%",
                "-" if self.rss_mb is None else f"{self.rss_mb:.0f} MiB",
                "-" if self.gpu_util is None and self.gpu_mib is None else
                f"{'-' if self.gpu_util is None else f'{self.gpu_util}%'}, {self.gpu_mib or 0} MiB",
                self.last_line]


COLUMNS = ["rank", "pid", "device", "state", "CPU", "memory", "GPU", "last line"]


@dataclass
class HostRow:
    """One host's ranks, summed: what the panel shows per host from HOSTS_FROM hosts on."""

    host: str
    ranks: list[RankRow]

    @property
    def summary(self) -> str:
        counts: dict[str, int] = {}
        for r in self.ranks:
            counts[r.state] = counts.get(r.state, 0) + 1
        states = ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: _ORDER.get(kv[0], 9)))
        cpu = [r.cpu_pct for r in self.ranks if r.cpu_pct is not None]
        mem = [r.rss_mb for r in self.ranks if r.rss_mb is not None]
        first, last = self.ranks[0].rank, self.ranks[-1].rank
        return (f"{self.host}: ranks {first}-{last}: {states}" + (f"; CPU {sum(cpu):.0f}%" if cpu else "")
                + (f", {sum(mem):.0f} MiB" if mem else "")
                + ("; the straggler is here" if any(r.straggler for r in self.ranks) else ""))


_ORDER = {"dead": 0, "unresponsive": 1, "busy": 2, "starting": 3, "idle": 4}


@dataclass
class PanelData:
    """One sample: a row per rank, the straggler's headline ("" when none is named), the rows by
    host (from HOSTS_FROM hosts on, else None), whether any rank was busy."""

    rows: list[RankRow]
    straggler: str = ""
    hosts: list[HostRow] | None = None
    busy: bool = False
    taken: float = field(default_factory=time.time)

    def text(self) -> str:
        """The panel as plain text: the straggler's line, then a table."""
        table = [COLUMNS] + [r.cells() for r in self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS) - 1)]
        lines = ["  ".join([c.ljust(w) for c, w in zip(row, widths)] + [row[-1]]).rstrip() for row in table]
        return "\n".join(([self.straggler] if self.straggler else []) + lines)


def rows_html(rows: list[RankRow]) -> str:
    """The rows as an HTML table (the widget's, and nbconvert's where widgets don't render)."""
    def cells(tag, row, cls=""):
        return f"<tr{cls}>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in row) + "</tr>"

    body = "".join(cells("td", r.cells(), f' class="ddip-{r.state}' + (' ddip-straggler"' if r.straggler else '"'))
                   for r in rows)
    return f'<table class="ddip-panel"><thead>{cells("th", COLUMNS)}</thead><tbody>{body}</tbody></table>'


def status_table(rows: list[dict], gpus: bool) -> tuple[str, str]:
    """Group.status()' rows as a table, as text and as HTML: what %dipstatus and g.status() show
    where widgets don't render (a terminal, nbconvert)."""
    header_row = ["rank", "pid", "device", "state", "busy for", "memory", "heartbeat"] + (["GPU"] if gpus else [])
    table = []
    for r in rows:
        row = [str(r["rank"]), str(r["pid"]), r["device"], r["state"],
               "-" if r["busy_s"] is None else f"{r['busy_s']:.1f} s",
               "-" if r["rss_mb"] is None else f"{r['rss_mb']:.0f} MiB",
               "-" if r["heartbeat_ms"] is None or r["heartbeat_ms"] < 0 else f"{r['heartbeat_ms'] / 1000:.1f} s ago"]
        if gpus:
            g = r.get("gpu")
            row.append("- (CUDA not started)" if not g else f"GPU {g['index']} {g['name']}, {g['used_mib']} MiB used")
        table.append(row)
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header_row)]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header_row] + table)
    cells = lambda tag, row: "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in row)  # noqa: E731
    markup = ("<table><thead><tr>" + cells("th", header_row) + "</tr></thead><tbody>"
              + "".join("<tr>" + cells("td", row) + "</tr>" for row in table) + "</tbody></table>")
    return text, markup


def by_host(rows: list[RankRow]) -> list[HostRow] | None:
    """The rows grouped by host, in rank order, once there are HOSTS_FROM hosts or more."""
    hosts: dict[str, list[RankRow]] = {}
    for r in rows:
        hosts.setdefault(r.host or "this machine", []).append(r)
    if len(hosts) < HOSTS_FROM:
        return None
    return [HostRow(h, rs) for h, rs in hosts.items()]


class Sampler:
    """Takes PanelData samples of one group; CPU % is the share of one core each rank used since
    the previous sample (the first sample has none). `cell_number` (optional) says the notebook's
    cell a run started in: called once per request, when the sampler first sees it."""

    def __init__(self, group, cell_number=None):
        self.group = group
        self.cell_number = cell_number
        self._cpu: dict[int, tuple[float, float]] = {}  # pid -> (when, CPU seconds then)
        self._cells: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> the cell it runs
        self._stragglers: Stragglers | None = None  # the last answer: shown on while ranks are idle

    def sample(self, ask: bool | None = None) -> PanelData:
        """One sample. ask: read the ranks' flight recorders (who waits in which collective, the
        straggler); by default only while a rank is busy. Raises GroupClosedError once closed."""
        g = self.group
        status = g.status()  # pumps the runtime first: a death is seen
        rt = g.runtime
        if rt is None:  # closed meanwhile, by another thread
            raise GroupClosedError(None)
        busy = any(s["state"] == "busy" for s in status)
        picture = None
        if ask if ask is not None else busy:
            snapshots = rt.collectives(list(range(len(g.rank_ids))), ASK_TIMEOUT_S, 0.05)
            snapshots = {g.rank_ids[s]: a for s, a in snapshots.items()}
            picture, now_named = CollectivePicture(snapshots), Stragglers.of(snapshots)
            # A rank that did not answer in time leaves the straggler named before as it was.
            if now_named.straggler is not None or not now_named.unread or self._stragglers is None:
                self._stragglers = now_named
        stragglers = self._stragglers
        util = _gpus.utilization() if any(s.get("gpu") for s in status) else {}
        with rt.mu:
            running = {s: rt.running.get(s) for s in range(len(status))}
            exits, replaced = dict(rt.exits), dict(rt.replaced)
            last_lines = list(rt.last_line)
        now = time.monotonic()
        rows = []
        for slot, s in enumerate(status):
            pid, gpu = s["pid"], s.get("gpu") or {}
            local = s["rss_mb"] is not None
            row = RankRow(rank=s["rank"], pid=pid, host=s.get("host"), device=s["device"], state=s["state"],
                          doing=self._doing(slot, s, running.get(slot), exits.get(slot), replaced.get(slot),
                                            picture, now),
                          cpu_pct=self._cpu_pct(pid, now) if local and s["state"] != "dead" else None,
                          rss_mb=s["rss_mb"] if s["state"] != "dead" else None,
                          gpu_util=util.get(gpu.get("uuid")) if gpu else None,
                          gpu_mib=gpu.get("used_mib") if gpu else None,
                          last_line=last_lines[slot],
                          straggler=stragglers is not None and stragglers.straggler == s["rank"])
            rows.append(row)
        headline = stragglers.headline if stragglers is not None and stragglers.straggler is not None else ""
        return PanelData(rows, headline, by_host(rows), busy)

    def _doing(self, slot, s, req, failure, replaced, picture, now) -> str:
        state = s["state"]
        if state == "dead":
            return f"dead: {failure.evalue}" if failure is not None else "dead"
        if state == "unresponsive":
            return f"unresponsive: no heartbeat for {s['heartbeat_ms'] / 1000:.0f} s"
        healed = f" (replaced by heal; the rank before: {replaced.evalue})" if replaced is not None else ""
        if state == "starting":
            return "starting (replaced by heal)" if replaced is not None else state
        if state != "busy" or req is None:
            return state + healed
        if req not in self._cells:
            self._cells[req] = self.cell_number() if self.cell_number and req.what == "code" else None
        n = self._cells[req]
        running = f"running cell {n}" if n is not None else f"running {req.what}"
        running += f" for {now - req.started:.0f} s"
        if slot == req.prompts.floor or any(p_slot == slot for p_slot, _ in req.prompts.items):
            return f"at a debugger prompt ({running})"
        rank = s["rank"]
        if picture is not None and rank in picture.waiting:
            return f"waiting in collective {picture.waiting[rank]} for {picture.waited_s.get(rank, 0):.0f} s " \
                   f"({running})"
        return running + healed

    def _cpu_pct(self, pid: int, now: float) -> float | None:
        used = _cpu_seconds(pid)
        before = self._cpu.get(pid)
        if used is None:
            return None
        self._cpu[pid] = (now, used)
        if before is None or now <= before[0]:
            return None
        return max(0.0, 100.0 * (used - before[1]) / (now - before[0]))


def _cpu_seconds(pid: int) -> float | None:
    """The CPU time (user + system) process `pid` has used, from /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state is field 3
    try:
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: fields 14 and 15
    except (IndexError, ValueError):
        return None
