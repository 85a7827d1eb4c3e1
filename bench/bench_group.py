"""Group start-up and request round trip: ddip against ipyparallel, measured in the same run.

    .venv/bin/python bench/bench_group.py      (or `make bench` for every bench module)
    .venv/bin/python bench/bench_group.py --cpu      only the CPU cost of a trivial request

What each side does:
- start to ready: ddip `Group(n=N, backend=None)` returns once all N ranks said hello;
  ipyparallel `Cluster(n=N)` + `start_and_connect_sync()` returns once N engines are
  registered, then `client[:]` makes the DirectView. Both are timed from construction.
- round trip: ddip `g.run("pass")` against ipyparallel `dview.execute("pass", block=True)`,
  N=2, after a warm-up.
- CPU per request: `g.run("pass")` 300 times on N=2 and N=8; each rank's CPU (utime+stime from
  /proc/<pid>/stat, all its threads) and the notebook process's (all its threads, the runtime's
  IO thread included) before and after, divided by the requests (per rank: averaged over ranks).
- push: a 256 MiB float32 numpy array to every rank of N=4, ddip `g.push(a=arr)` against
  ipyparallel `dview.push({"a": arr}, block=True)`; a plain `arr.copy()` is shown for scale.

ipyparallel is stopped with its own API (`stop_cluster_sync`); then every process it started
(controller, its schedulers, engines, their nannies) is checked by pid and killed if still there.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import psutil

START_REPS = 5  # timed starts per configuration, after one untimed warm-up start
RT_WARMUP = 50
RT_REPS = 500
START_TARGET_S = 0.5
RT_TARGET_S = 1e-3
CPU_REQS = 300  # requests per CPU-cost measurement
CPU_SIZES = (2, 8)
PUSH_MIB = 256
PUSH_N = 4
PUSH_REPS = 5
RATIO_TARGET = 10.0
GRACE_S = 5.0  # how long stopped processes get to exit before they are killed by pid


def _log(msg: str):
    print(f"[bench_group] {msg}", file=sys.stderr, flush=True)


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _reap(procs: list[psutil.Process]) -> list[int]:
    """Waits for procs to exit; kills (by pid) the ones still there after GRACE_S. Returns those pids."""
    _, alive = psutil.wait_procs(_alive(procs), timeout=GRACE_S)
    alive = _alive(alive)
    for p in alive:
        try:
            p.kill()  # psutil checks the pid still names the same process (start time) first
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=GRACE_S)
    if _alive(alive):
        raise RuntimeError(f"processes {[p.pid for p in _alive(alive)]} survived SIGKILL")
    return [p.pid for p in alive]


class _Leftovers:
    """Processes that outlived their tool's own stop, killed by pid; reported under the table."""

    def __init__(self):
        self.ddip: list[int] = []
        self.ipyparallel: list[int] = []


# -- ddip -------------------------------------------------------------------------------------


def _ddip_start(n: int, backend, left: _Leftovers) -> float:
    import ddip

    t0 = time.perf_counter()
    g = ddip.Group(n=n, backend=backend)
    elapsed = time.perf_counter() - t0
    procs = [psutil.Process(pid) for pid in g.pids]
    g.close()
    left.ddip += _reap(procs)
    return elapsed


def _ddip_round_trip(left: _Leftovers) -> list[float]:
    import ddip

    g = ddip.Group(n=2, backend=None)
    procs = [psutil.Process(pid) for pid in g.pids]
    try:
        for _ in range(RT_WARMUP):
            g.run("pass")
        times = []
        for _ in range(RT_REPS):
            t0 = time.perf_counter()
            g.run("pass")
            times.append(time.perf_counter() - t0)
        return times
    finally:
        g.close()
        left.ddip += _reap(procs)


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, every thread) the process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _ddip_cpu(n: int, left: _Leftovers) -> tuple[float, float, float]:
    """(round trip, CPU per rank per request, notebook CPU per request) of `g.run("pass")`."""
    import ddip

    g = ddip.Group(n=n, backend=None)
    procs = [psutil.Process(pid) for pid in g.pids]
    try:
        for _ in range(RT_WARMUP):
            g.run("pass")
        ranks0 = [_proc_cpu(pid) for pid in g.pids]
        kernel0 = _proc_cpu(os.getpid())
        t0 = time.perf_counter()
        for _ in range(CPU_REQS):
            g.run("pass")
        wall = time.perf_counter() - t0
        kernel = _proc_cpu(os.getpid()) - kernel0
        ranks = [_proc_cpu(pid) - c for pid, c in zip(g.pids, ranks0)]
        return wall / CPU_REQS, sum(ranks) / n / CPU_REQS, kernel / CPU_REQS
    finally:
        g.close()
        left.ddip += _reap(procs)


def _ddip_push(arr, left: _Leftovers) -> list[float]:
    import ddip

    g = ddip.Group(n=PUSH_N, backend=None)
    procs = [psutil.Process(pid) for pid in g.pids]
    try:
        g.push(a=arr)  # warm-up: the pool's segments are created here and reused after
        g.push(a=arr)
        times = []
        for _ in range(PUSH_REPS):
            t0 = time.perf_counter()
            g.push(a=arr)
            times.append(time.perf_counter() - t0)
        if g.run("float(a[-1])")[0].value != float(arr[-1]):
            raise RuntimeError("ddip push delivered wrong data")
        return times
    finally:
        g.close()
        left.ddip += _reap(procs)


# -- ipyparallel ------------------------------------------------------------------------------


class _IpyparallelCluster:
    """One ipyparallel cluster, started as a user would, and stopped so that nothing outlives it."""

    def __init__(self, n: int, profile_dir: str, left: _Leftovers, **cluster_kwargs):
        self.n = n
        self.profile_dir = profile_dir
        self.left = left
        self.cluster_kwargs = cluster_kwargs
        self.cluster = None
        self.client = None
        self.view = None
        self._procs: dict[int, psutil.Process] = {}
        self._before: set[int] = set()

    def start(self) -> float:
        import ipyparallel

        self._before = {p.pid for p in psutil.Process().children(recursive=True)}
        t0 = time.perf_counter()
        try:
            # log_level only quiets its "Starting N engines" lines; everything else is the default.
            self.cluster = ipyparallel.Cluster(n=self.n, profile_dir=self.profile_dir,
                                               log_level=logging.ERROR, **self.cluster_kwargs)
            self.client = self.cluster.start_and_connect_sync()
            self.view = self.client[:]
            elapsed = time.perf_counter() - t0
        finally:
            self._collect()
        if len(self.client.ids) != self.n:
            raise RuntimeError(f"ipyparallel registered {len(self.client.ids)} engines, expected {self.n}")
        return elapsed

    def _collect(self):
        """Every process the cluster started: launchers' own pids, their descendants, and any
        new descendant of this process (so a half-started cluster is covered too)."""
        roots = []
        if self.cluster is not None:
            controller = self.cluster.controller
            if controller is not None and getattr(controller, "process", None) is not None:
                roots.append(controller.process)
            for engine_set in self.cluster.engines.values():
                for launcher in getattr(engine_set, "launchers", {}).values():
                    if getattr(launcher, "process", None) is not None:
                        roots.append(launcher.process)
        roots += [p for p in psutil.Process().children(recursive=True) if p.pid not in self._before]
        for p in roots:
            self._procs.setdefault(p.pid, p)
            try:
                for c in p.children(recursive=True):
                    self._procs.setdefault(c.pid, c)
            except psutil.NoSuchProcess:
                pass

    def stop(self):
        self._collect()  # engines and schedulers started after start() returned count too
        try:
            if self.client is not None:
                self.client.close()
            if self.cluster is not None:
                self.cluster.stop_cluster_sync()
        finally:
            self.left.ipyparallel += _reap(list(self._procs.values()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _ipp_start(n: int, profile_dir: str, left: _Leftovers, **cluster_kwargs) -> float:
    c = _IpyparallelCluster(n, profile_dir, left, **cluster_kwargs)
    with c:
        return c.start()


def _ipp_round_trip(profile_dir: str, left: _Leftovers) -> list[float]:
    with _IpyparallelCluster(2, profile_dir, left) as c:
        c.start()
        for _ in range(RT_WARMUP):
            c.view.execute("pass", block=True)
        times = []
        for _ in range(RT_REPS):
            t0 = time.perf_counter()
            c.view.execute("pass", block=True)
            times.append(time.perf_counter() - t0)
        return times


def _ipp_push(arr, profile_dir: str, left: _Leftovers) -> list[float]:
    with _IpyparallelCluster(PUSH_N, profile_dir, left) as c:
        c.start()
        c.view.push({"a": arr}, block=True)
        times = []
        for _ in range(PUSH_REPS):
            t0 = time.perf_counter()
            c.view.push({"a": arr}, block=True)
            times.append(time.perf_counter() - t0)
        return times


def _copy_times(arr) -> list[float]:
    times = []
    for _ in range(PUSH_REPS):
        t0 = time.perf_counter()
        arr.copy()
        times.append(time.perf_counter() - t0)
    return times


# -- report -----------------------------------------------------------------------------------


def _secs(t: float) -> str:
    return f"{t:.3f} s"


def _ms(t: float) -> str:
    return f"{t * 1e3:.2f} ms"


def _ratio(ours: float, theirs: float) -> str:
    r = theirs / ours
    # Rounded down, so a ratio shown as meeting the 10x target does meet it.
    return f"{math.floor(r)}x" if r >= 20 else f"{math.floor(r * 10) / 10:.1f}x"


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main() -> str:
    left = _Leftovers()
    profile_dir = tempfile.mkdtemp(prefix="ddip-bench-ipyparallel-")
    starts: dict[str, list[float]] = {}
    try:
        for n in (2, 4):
            _log(f"warm-up starts, N={n}")
            _ddip_start(n, None, left)
            _ipp_start(n, profile_dir, left)
            # Interleaved, so load from anything else on the machine hits both sides alike.
            for rep in range(START_REPS):
                _log(f"start N={n}, repetition {rep + 1}/{START_REPS}")
                starts.setdefault(f"ddip{n}", []).append(_ddip_start(n, None, left))
                starts.setdefault(f"ipp{n}", []).append(_ipp_start(n, profile_dir, left))
                if n == 2:  # informational: without ipyparallel's default 1 s controller-to-engines wait
                    starts.setdefault("ipp2-nodelay", []).append(_ipp_start(2, profile_dir, left, delay=0))
        _log("start N=2 with torch (backend='gloo')")
        _ddip_start(2, "gloo", left)
        for _ in range(START_REPS):
            starts.setdefault("ddip2-gloo", []).append(_ddip_start(2, "gloo", left))
        _log(f"round trip, N=2, {RT_REPS} repetitions after {RT_WARMUP} warm-up")
        rt_ddip = _ddip_round_trip(left)
        rt_ipp = _ipp_round_trip(profile_dir, left)
        cpu = {}
        for n in CPU_SIZES:
            _log(f"CPU per request, N={n}, {CPU_REQS} requests")
            cpu[n] = _ddip_cpu(n, left)
        import numpy as np

        arr = np.arange(PUSH_MIB << 18, dtype=np.float32)
        _log(f"push {PUSH_MIB} MiB to N={PUSH_N}")
        push_ddip = statistics.median(_ddip_push(arr, left))
        push_ipp = statistics.median(_ipp_push(arr, profile_dir, left))
        copy = statistics.median(_copy_times(arr))
    finally:
        shutil.rmtree(profile_dir, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in starts.items()}
    rt_d, rt_i = statistics.median(rt_ddip), statistics.median(rt_ipp)
    rows = [  # step, ddip, ipyparallel (None: no counterpart), unit
        ("start to ready, N=2", med["ddip2"], med["ipp2"], _secs),
        ("start to ready, N=4", med["ddip4"], med["ipp4"], _secs),
        ("start to ready, N=2, ipyparallel with `delay=0`", med["ddip2"], med["ipp2-nodelay"], _secs),
        ("start to ready, N=2, with torch (`backend='gloo'`)", med["ddip2-gloo"], None, _secs),
        ("round trip of `run(\"pass\")`, N=2", rt_d, rt_i, _ms),
        (f"push a {PUSH_MIB} MiB array to N={PUSH_N} ranks", push_ddip, push_ipp, _ms),
        (f"for scale: one `arr.copy()` of {PUSH_MIB} MiB in the notebook", copy, None, _ms),
    ]
    lines = ["| step | ddip | ipyparallel | ratio |", "|---|---|---|---|"]
    for step, ours, theirs, fmt in rows:
        if theirs is None:
            lines.append(f"| {step} | {fmt(ours)} | n/a | n/a |")
        else:
            lines.append(f"| {step} | {fmt(ours)} | {fmt(theirs)} | {_ratio(ours, theirs)} |")

    r2, r4, rrt = med["ipp2"] / med["ddip2"], med["ipp4"] / med["ddip4"], rt_i / rt_d
    targets = [
        f"start ≤ {START_TARGET_S:g} s for N=2 without torch: {_verdict(med['ddip2'] <= START_TARGET_S)} "
        f"({_secs(med['ddip2'])})",
        f"round trip ≤ {RT_TARGET_S * 1e3:g} ms: {_verdict(rt_d <= RT_TARGET_S)} ({_ms(rt_d)})",
        f"start ≥ {RATIO_TARGET:g}x ahead of ipyparallel: {_verdict(min(r2, r4) >= RATIO_TARGET)} "
        f"(N=2 {_ratio(med['ddip2'], med['ipp2'])}, N=4 {_ratio(med['ddip4'], med['ipp4'])})",
        f"round trip ≥ {RATIO_TARGET:g}x ahead of ipyparallel: {_verdict(rrt >= RATIO_TARGET)} "
        f"({_ratio(rt_d, rt_i)})",
    ]
    q = statistics.quantiles
    notes = [
        f"Medians. Starts: {START_REPS} timed repetitions per row after one untimed warm-up, ddip and "
        f"ipyparallel interleaved. Round trip: {RT_REPS} repetitions after {RT_WARMUP} warm-up "
        f"(p10/p90: ddip {_ms(q(rt_ddip, n=10)[0])}/{_ms(q(rt_ddip, n=10)[-1])}, "
        f"ipyparallel {_ms(q(rt_ipp, n=10)[0])}/{_ms(q(rt_ipp, n=10)[-1])}).",
        "ipyparallel's default `Cluster(n=N)` waits `delay=1.0` s between starting its controller "
        "and its engines; the `delay=0` row shows the start without that wait (targets use the default).",
        f"Processes left after the tool's own stop, killed by pid: ddip {len(left.ddip)}, "
        f"ipyparallel {len(left.ipyparallel)}.",
    ]
    lines += ["", f"CPU per trivial request (`g.run(\"pass\")`, {CPU_REQS} requests after {RT_WARMUP} warm-up):", "",
              "| ranks | round trip | CPU per rank per request | notebook CPU per request |", "|---|---|---|---|"]
    for n, (rt, rank_cpu, kernel_cpu) in cpu.items():
        lines.append(f"| N={n} | {_ms(rt)} | {_ms(rank_cpu)} | {_ms(kernel_cpu)} |")
    tick = 1 / os.sysconf("SC_CLK_TCK")
    lines += ["", f"(/proc counts CPU in ticks of {tick * 1e3:g} ms: one tick over {CPU_REQS} requests is "
                  f"{_ms(tick / CPU_REQS)} per request, the resolution of these figures.)"]
    return ("\n".join(lines) + "\n\nTargets: " + "; ".join(targets) + ".\n\n"
            + "\n".join(f"- {n}" for n in notes) + "\n")


def cpu_only() -> str:
    """Only the CPU-per-request table (`bench_group.py --cpu`): quick, for runtime work."""
    left = _Leftovers()
    lines = ["| ranks | round trip | CPU per rank per request | notebook CPU per request |", "|---|---|---|---|"]
    for n in CPU_SIZES:
        rt, rank_cpu, kernel_cpu = _ddip_cpu(n, left)
        lines.append(f"| N={n} | {_ms(rt)} | {_ms(rank_cpu)} | {_ms(kernel_cpu)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(cpu_only() if sys.argv[1:] == ["--cpu"] else main())
