"""CPU per trivial request, in a rank and in the notebook: the lean request path (issue 34,
item 2) against IPython's `run_cell` for every request, measured in the same run.

    .venv/bin/python bench/bench_request.py      (or `make bench` for every bench module)

Two groups of N=2 CPU ranks (`backend=None`) run side by side: one as ranks start by default
(plain code that needs none of IPython's machinery skips `run_cell`), one with `DDIP_LEAN=0` in
its ranks' environment (every cell through `run_cell`, as before the lean path). Each runs the
same cells, `REQS` times each after a warm-up: `pass`, `x = 1`, and, for reference, a cell that
always takes IPython's path either way (`x`: a last expression, formatted by the display hook).
The two groups take turns in rounds, so load on the machine hits both alike.

Measured per request: each rank's CPU (utime+stime from /proc/<pid>/stat, all its threads,
averaged over the ranks), the notebook's CPU (`time.process_time()`: every thread of this
process, the runtime's IO thread included) and of it the Python thread's that calls `g.run`
(`time.thread_time()`; the rest is the runtime's C++ IO thread), and the round trip (wall
clock). Medians over the rounds. On the notebook's side the two groups differ in nothing: its
before and after are two runs of this bench, before and after the change.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import psutil

from common import GRACE_S

N = 2
REQS = 2000  # requests per cell per round: /proc counts rank CPU in 10 ms ticks
ROUNDS = 3
WARMUP = 200
CELLS = ("pass", "x = 1", "x")


def _log(msg: str):
    print(f"[bench_request] {msg}", file=sys.stderr, flush=True)


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, every thread) the process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _reap(procs: list[psutil.Process]) -> int:
    """Kills, by pid, the ranks still there GRACE_S after close (psutil checks each pid still
    names the same process); the count."""
    _, alive = psutil.wait_procs(procs, timeout=GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return len(alive)


def _measure(g, code: str) -> tuple[float, float, float, float]:
    """(rank CPU, notebook CPU, the notebook's Python thread's CPU, round trip) per request, in
    seconds."""
    ranks0 = [_proc_cpu(pid) for pid in g.pids]
    kernel0, main0 = time.process_time(), time.thread_time()
    t0 = time.perf_counter()
    for _ in range(REQS):
        g.run(code)
    wall = time.perf_counter() - t0
    kernel, main = time.process_time() - kernel0, time.thread_time() - main0
    ranks = sum(_proc_cpu(pid) - c for pid, c in zip(g.pids, ranks0)) / len(g.pids)
    return ranks / REQS, kernel / REQS, main / REQS, wall / REQS


def main() -> str:
    import ddip

    load_before = os.getloadavg()[0]
    groups = {"lean": ddip.Group(n=N, backend=None),
              "run_cell": ddip.Group(n=N, backend=None, env={"DDIP_LEAN": "0"})}
    ranks = [psutil.Process(pid) for g in groups.values() for pid in g.pids]
    got: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    try:
        for g in groups.values():
            g.run("x = 1")
            for code in CELLS:
                for _ in range(WARMUP):
                    g.run(code)
        for rnd in range(ROUNDS):
            order = list(groups) if rnd % 2 == 0 else list(reversed(groups))
            for code in CELLS:
                for name in order:
                    _log(f"round {rnd + 1}/{ROUNDS}: {name}, {code!r} x {REQS}")
                    got.setdefault((name, code), []).append(_measure(groups[name], code))
    finally:
        for g in groups.values():
            g.close()
        killed = _reap(ranks)

    def med(name, code, i):
        return statistics.median(m[i] for m in got[(name, code)]) * 1e6

    lines = [f"N={N} ranks, {REQS} requests per cell per round, median of {ROUNDS} rounds (µs per request):",
             "",
             "| cell | rank CPU, lean | rank CPU, `DDIP_LEAN=0` | notebook CPU, lean | notebook CPU, `DDIP_LEAN=0` "
             "| of which its Python thread, lean | of which its Python thread, `DDIP_LEAN=0` "
             "| round trip, lean | round trip, `DDIP_LEAN=0` |",
             "|---|---|---|---|---|---|---|---|---|"]
    for code in CELLS:
        lines.append(f"| `{code}` | " + " | ".join(
            f"{med(name, code, i):.0f}" for i in range(4) for name in ("lean", "run_cell")) + " |")
    lines += ["", f"(`x` is a last expression: IPython's display hook formats it, so it takes `run_cell` "
              f"either way. The machine's load average (1 min): {load_before:.1f} at the start, "
              f"{os.getloadavg()[0]:.1f} at the end. Ranks still there after close, killed by pid: {killed}.)"]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
