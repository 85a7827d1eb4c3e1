"""One notebook, many ranks on many hosts: ddip against ipyparallel at N = 2, 8, 32 and 128 ranks
(on 1, 1, 4 and 16 hosts), in one run (issue 34, item 8).

    .venv/bin/python bench/bench_scale.py                     every size, ipyparallel beside
    .venv/bin/python bench/bench_scale.py --sizes 2:1,8:1 --no-ipp
    .venv/bin/python bench/run.py scale                       (make bench leaves it out: long)

The hosts are the tests' (tests/netns_hosts.py): Linux network namespaces with their own address
and sshd, joined through a bridge to the notebook's namespace, reached with an ssh config of their
own; they share this machine's filesystem, CPUs and memory. Both tools reach them over ssh:

- ddip: `Group(hosts={H0: k, H1: k, ...}, launcher="ssh -F cfg", bind=<notebook's address>,
  backend=None)`, ranks spread evenly over the hosts. Each size starts with every host let go
  (`ddip.hosts.release()`), so its first group is cold: it starts each host's standing agent and
  rank template; the groups after it are warm (ranks forked from each host's template).
- ipyparallel: `Cluster(engines="ssh")` with `SSHEngineSetLauncher.engines = {H0: k, ...}` (its
  documented ssh launcher, common.ipp_ssh_cluster); one start per size.

Measured per size:
- ready: construction to a group whose first `run("pass")` answered (ipyparallel: `Cluster(...)`,
  `start_and_connect_sync()`, the DirectView and its first `execute("pass")`). ddip: the cold first
  group and the median of WARM_REPS warm ones.
- round trip of `run("pass")` (`view.execute("pass", block=True)`): median of RT_REPS after
  RT_WARMUP, and the notebook's CPU per request over the same calls (time.process_time, every
  thread of the notebook's process: its IO thread too).
- push of a PUSH_MIB MiB float64 numpy array to every rank (`g.push(a=arr)`, `view.push({"a": arr},
  block=True)`): median of PUSH_REPS after one untimed push; the values are checked.
- free memory (MemAvailable) at its lowest and the load average, sampled as each size runs.
At the largest size also: a push to 1 rank on each of its hosts (issue 34's "push to all 128 ranks
≤ 1.5x a push to 16 x 1"), and one warm group with torch + gloo (`backend="gloo"`, ready and first
run), with the time it took or why it did not finish.

Where a warm start's time goes (the largest size, one more warm group): wall time of Group()
and of its first run, and the CPU seconds each kind of process spent meanwhile (the notebook, the
ssh clients, each host's sshd, agents, rank templates, and the new ranks themselves).

Clean-up: each tool's own stop, then every process left in a host's namespace (besides its sshd)
and every new descendant of this process get GRACE_S and are killed by pid (common.Leftovers); the
counts are printed. The hosts are removed at the end. Raw results go to bench/results/scale.json,
the curves to bench/img/scale.png. Needs root, iproute2 and openssh, as the tests do.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent / "tests"))  # netns_hosts: the hosts the tests use

import netns_hosts  # noqa: E402
from common import GRACE_S, Leftovers, close_group, ipp_ssh_cluster, ms, secs, times, verdict  # noqa: E402

LONG = True  # run.py leaves this module out unless named (or DDIP_BENCH_LONG=1): it takes many minutes
SIZES = [(2, 1), (8, 1), (32, 4), (128, 16)]  # (ranks, hosts)
WARM_REPS = 3
RT_WARMUP, RT_REPS = 10, 100
PUSH_MIB, PUSH_REPS = 8, 5
START_TIMEOUT_S = 600.0
GLOO_TIMEOUT_S = 300.0
IPP_ENGINE_TIMEOUT_S = 1800  # ipyparallel's wait for its engines to register (its default, 60 s, is too short here)
MEM_FLOOR_GIB = 3.0  # a group that takes MemAvailable under this is stopped: the machine's other work must not be OOM-killed
TARGET_WARM_S, TARGET_RT_S, TARGET_PUSH_X = 2.0, 0.010, 1.5  # issue 34, item 1, at 128 ranks on 16 hosts
RESULTS = HERE / "results" / "scale.json"
PLOT = HERE / "img" / "scale.png"


def _log(msg: str):
    print(f"[bench_scale] {msg}", file=sys.stderr, flush=True)


class _Machine:
    """The lowest MemAvailable and the highest 1-minute load average seen while sampling."""

    def __init__(self):
        self.min_avail, self.max_load = None, 0.0

    def sample(self):
        avail = psutil.virtual_memory().available
        self.min_avail = avail if self.min_avail is None else min(self.min_avail, avail)
        self.max_load = max(self.max_load, os.getloadavg()[0])

    def as_dict(self) -> dict:
        return {"min_avail_gib": round(self.min_avail / 2**30, 2) if self.min_avail else None,
                "max_load1": round(self.max_load, 2)}


class _MemoryGuard:
    """While a group starts: should MemAvailable fall under MEM_FLOOR_GIB, kills the ranks on the
    hosts by pid (processes there whose parent is a host's agent or template, templates excepted),
    so that the group fails instead of the kernel OOM-killing other work on the machine."""

    def __init__(self, hosts: netns_hosts.Hosts):
        import threading

        self.hosts, self.tripped, self._stop = hosts, None, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _watch(self):
        while not self._stop.wait(0.2):
            avail = psutil.virtual_memory().available
            if avail < MEM_FLOOR_GIB * 2**30:
                self.tripped = avail
                self._kill_ranks()
                return

    def _kill_ranks(self):
        victims = []
        for name in self.hosts.ns:
            for pid in self.hosts.pids(name):
                try:
                    p = psutil.Process(pid)
                    mine, parent = " ".join(p.cmdline()), " ".join(p.parent().cmdline())
                    if "ddip.template" in parent or ("ddip.remote" in parent and "ddip.template" not in mine):
                        p.kill()  # psutil checks the pid still names the same process first
                        victims.append(p)
                except (psutil.Error, AttributeError):
                    pass
        psutil.wait_procs(victims, timeout=GRACE_S)


def _spread(ranks: int, hosts: int) -> list[int]:
    return [ranks // hosts + (1 if i < ranks % hosts else 0) for i in range(hosts)]


# -- ddip -----------------------------------------------------------------------------------


class _Ddip:
    def __init__(self, hosts: netns_hosts.Hosts, names: list[str], host_env: list[str]):
        self.hosts, self.names = hosts, names
        # Variables for the hosts' agents (and so their templates and ranks), through `env` in a
        # launcher template: ssh passes no environment. The Python stays this one, so ranks still
        # fork from the hosts' templates (a rank whose Python differs starts cold).
        self.launcher = (f"{hosts.launcher} {{host}} env {' '.join(host_env)} {{command}}" if host_env
                         else hosts.launcher)

    def group(self, ranks: int, n_hosts: int, backend=None, timeout=START_TIMEOUT_S):
        import ddip

        h = self.hosts
        spread = {h.addr[name]: k for name, k in zip(self.names[:n_hosts], _spread(ranks, n_hosts))}
        env = {"GLOO_SOCKET_IFNAME": netns_hosts.LINK} if backend else None
        # warm=True: each host's ranks wait for its template and fork from it, as in a notebook that
        # has imported torch; without it the first group's ranks would start cold beside the imports.
        return ddip.Group(hosts=spread, launcher=self.launcher, bind=h.me, backend=backend, env=env,
                          timeout=timeout, warm=True)

    def ready(self, ranks, n_hosts, backend=None, timeout=START_TIMEOUT_S, keep=False):
        """Seconds to a group whose first run answered; the group too if keep, else closed."""
        t0 = time.perf_counter()
        g = self.group(ranks, n_hosts, backend, timeout)
        try:
            got = g.run("pass")
            took = time.perf_counter() - t0
            if len(got) != ranks:
                raise RuntimeError(f"{len(got)} of {ranks} ranks answered")
        except BaseException:
            close_group(g)
            raise
        if keep:
            return took, g
        close_group(g)
        return took


def _requests(call) -> tuple[list[float], float]:
    """(wall seconds of each of RT_REPS calls after RT_WARMUP, the notebook's CPU seconds per call)."""
    for _ in range(RT_WARMUP):
        call()
    times = []
    cpu0 = time.process_time()
    for _ in range(RT_REPS):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times, (time.process_time() - cpu0) / RT_REPS


def _pushes(push, check) -> list[float]:
    push()
    times = []
    for _ in range(PUSH_REPS):
        t0 = time.perf_counter()
        push()
        times.append(time.perf_counter() - t0)
    check()
    return times


def _check_ddip_push(g, arr):
    want = float(arr[-1])
    got = [r.value for r in g.run(f"float(a[-1]) if a.nbytes == {arr.nbytes} else None")]
    if got != [want] * g.size:
        raise RuntimeError(f"ddip push delivered wrong data: {got}")


def _bench_ddip(d: _Ddip, ranks: int, n_hosts: int, arr, machine: _Machine, largest: bool) -> dict:
    import ddip

    out: dict = {}
    ddip.hosts.release()  # every host let go: this size's first group starts its agents and templates
    _log(f"ddip {ranks} ranks on {n_hosts} hosts: cold first group")
    out["ready_cold"] = d.ready(ranks, n_hosts)
    machine.sample()
    warm = []
    for i in range(WARM_REPS):
        took, g = d.ready(ranks, n_hosts, keep=True)
        warm.append(took)
        machine.sample()
        if i + 1 < WARM_REPS:
            close_group(g)
    out["ready_warm"] = warm
    try:
        _log(f"ddip {ranks}: {RT_REPS} run('pass'), push {PUSH_MIB} MiB x {PUSH_REPS}")
        out["rt"], out["cpu_per_request"] = _requests(lambda: g.run("pass"))
        out["push"] = _pushes(lambda: g.push(a=arr), lambda: _check_ddip_push(g, arr))
        machine.sample()
    finally:
        close_group(g)
    if largest:
        out.update(_largest_extras(d, ranks, n_hosts, arr, machine))
    return out


def _largest_extras(d: _Ddip, ranks, n_hosts, arr, machine) -> dict:
    out: dict = {}
    _log(f"ddip: where a warm {ranks}-rank start spends its time")
    out["breakdown"] = _start_breakdown(d, ranks, n_hosts)
    _log(f"ddip: push to {n_hosts} x 1")
    took, g = d.ready(n_hosts, n_hosts, keep=True)
    try:
        out["push_one_per_host"] = _pushes(lambda: g.push(a=arr), lambda: _check_ddip_push(g, arr))
        out["rt_one_per_host"], out["cpu_per_request_one_per_host"] = _requests(lambda: g.run("pass"))
    finally:
        close_group(g)
    _log(f"ddip: a warm {ranks}-rank group with torch + gloo (up to {GLOO_TIMEOUT_S:g} s)")
    t0 = time.perf_counter()
    with _MemoryGuard(d.hosts) as guard:
        try:
            out["ready_gloo"] = d.ready(ranks, n_hosts, backend="gloo", timeout=GLOO_TIMEOUT_S)
        except Exception as exc:
            why = (f"stopped by the bench after {time.perf_counter() - t0:.0f} s, when free memory fell to "
                   f"{guard.tripped / 2**30:.1f} GiB (under {MEM_FLOOR_GIB:g} GiB)" if guard.tripped else
                   f"{type(exc).__name__} after {time.perf_counter() - t0:.0f} s: {str(exc)[:300]}")
            out["ready_gloo_failed"] = why
    machine.sample()
    return out


def _kind(p: psutil.Process, ranks: set[int]) -> str | None:
    if p.pid in ranks:
        return "ranks"
    try:
        name, cmd = p.name(), " ".join(p.cmdline())
        if name in ("sshd", "ssh"):
            return {"sshd": "sshd", "ssh": "ssh clients"}[name]
        if "python" not in name:
            return None
        if "-m ddip.remote" in cmd:
            return "agents"
        if "ddip.template" in cmd and "-m ddip.remote" in " ".join(p.parent().cmdline()):
            return "rank templates"
    except (psutil.Error, AttributeError):
        pass
    return None


def _cpu_by_pid(hosts: netns_hosts.Hosts, ranks: set[int]) -> dict[int, tuple[str, float]]:
    """{pid: (kind, CPU seconds so far)} of the processes on the hosts and this one's descendants (the
    ssh clients): not the machine's other work."""
    pids = {pid for name in hosts.ns for pid in hosts.pids(name)}
    pids.update(p.pid for p in psutil.Process().children(recursive=True))
    out = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            kind = _kind(p, ranks)
            if kind is not None:
                t = p.cpu_times()
                out[pid] = (kind, t.user + t.system)
        except psutil.Error:
            pass
    return out


def _start_breakdown(d: _Ddip, ranks: int, n_hosts: int) -> dict:
    """One more warm group: wall time of Group() and its first run, when its ranks were forked, and
    the CPU seconds each kind of process spent meanwhile (processes there before count their
    growth; new ranks count whole: forked from a template, their clock starts at 0)."""
    before = _cpu_by_pid(d.hosts, set())
    me0 = time.process_time()
    load0 = os.getloadavg()[0]
    ref = subprocess.Popen(["true"])  # the ranks' start times are read on the clock psutil reads
    epoch0 = psutil.Process(ref.pid).create_time()
    ref.wait()
    t0 = time.perf_counter()
    g = d.group(ranks, n_hosts)
    t1 = time.perf_counter()
    try:
        g.run("pass")
        t2 = time.perf_counter()
        me = time.process_time() - me0
        pids = {pid for pid in g.pids if pid is not None}
        after = _cpu_by_pid(d.hosts, pids)
        born = sorted(psutil.Process(pid).create_time() - epoch0 for pid in pids)
        forked = sum("ddip.template" in " ".join(psutil.Process(pid).cmdline()) for pid in pids)
    finally:
        close_group(g)
    cpu: dict[str, float] = {"notebook": me}
    count: dict[str, int] = {"notebook": 1}
    for pid, (kind, sec) in after.items():
        cpu[kind] = cpu.get(kind, 0.0) + sec - before.get(pid, (kind, 0.0))[1]
        count[kind] = count.get(kind, 0) + 1
    return {"group_s": t1 - t0, "first_run_s": t2 - t1, "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
            "processes": count, "load1": load0, "forked": forked,
            "ranks_born_s": [round(born[0], 2), round(statistics.median(born), 2), round(born[-1], 2)]}


# -- ipyparallel ----------------------------------------------------------------------------


def _bench_ipp(hosts, names, ranks: int, n_hosts: int, arr, machine: _Machine, profile_dir: str,
               local: bool = False) -> dict:
    """ipyparallel at `ranks` engines: ssh engines on the hosts, or local engines (`local`)."""
    out: dict = {"mode": "local engines" if local else "ssh engines"}
    engines = {hosts.addr[name]: k for name, k in zip(names[:n_hosts], _spread(ranks, n_hosts))}
    _log(f"ipyparallel {ranks} {out['mode']}" + ("" if local else f" on {n_hosts} hosts") + ": start")
    cluster = client = None
    t0 = time.perf_counter()
    try:
        if local:
            import logging

            import ipyparallel

            cluster = ipyparallel.Cluster(n=ranks, profile_dir=profile_dir, log_level=logging.ERROR,
                                          engine_timeout=IPP_ENGINE_TIMEOUT_S)
        else:
            cluster = ipp_ssh_cluster(engines, hosts.ssh_config, hosts.me, profile_dir, IPP_ENGINE_TIMEOUT_S)
        client = cluster.start_and_connect_sync()
        view = client[:]
        view.execute("pass", block=True)
        out["ready"] = time.perf_counter() - t0
        machine.sample()
        if len(client.ids) != ranks:
            raise RuntimeError(f"ipyparallel registered {len(client.ids)} engines, expected {ranks}")
        _log(f"ipyparallel {ranks}: {RT_REPS} execute('pass'), push {PUSH_MIB} MiB x {PUSH_REPS}")
        out["rt"], out["cpu_per_request"] = _requests(lambda: view.execute("pass", block=True))

        def check():
            view.execute(f"_last = float(a[-1]) if a.nbytes == {arr.nbytes} else None", block=True)
            got = view.pull("_last", block=True)
            if got != [float(arr[-1])] * ranks:
                raise RuntimeError(f"ipyparallel push delivered wrong data: {got}")

        out["push"] = _pushes(lambda: view.push({"a": arr}, block=True), check)
        machine.sample()
    finally:
        try:
            if client is not None:
                client.close()
        finally:
            if cluster is not None:
                cluster.stop_cluster_sync()
    return out


# -- report ---------------------------------------------------------------------------------


def _med(xs):
    return statistics.median(xs) if xs else None


def report(res: dict) -> str:
    sizes = res["sizes"]
    head = "| | " + " | ".join(f"N={s['ranks']} ({s['hosts']} host{'s' * (s['hosts'] > 1)})" for s in sizes) + " |"
    lines = [head, "|---" * (len(sizes) + 1) + "|"]

    def row(label, get, fmt):
        cells = []
        for s in sizes:
            try:
                v = get(s)
            except (KeyError, TypeError):
                v = None
            cells.append("—" if v is None else fmt(v) if not isinstance(v, str) else v)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    ipp = any("ipp" in s for s in sizes)
    if ipp:
        row("ipyparallel's engines", lambda s: s["ipp"].get("mode", "ssh engines")
            + (" (its ssh start failed)" if "ipp_failed" in s else ""), str)
    row("ddip ready, cold first group", lambda s: s["ddip"]["ready_cold"], secs)
    row("ddip ready, warm group", lambda s: _med(s["ddip"]["ready_warm"]), secs)
    if ipp:
        row("ipyparallel ready", lambda s: s["ipp"]["ready"], secs)
    row("ddip `run(\"pass\")` round trip", lambda s: _med(s["ddip"]["rt"]), ms)
    if ipp:
        row("ipyparallel `execute(\"pass\")` round trip", lambda s: _med(s["ipp"]["rt"]), ms)
    row("ddip notebook CPU per request", lambda s: s["ddip"]["cpu_per_request"], ms)
    if ipp:
        row("ipyparallel notebook CPU per request", lambda s: s["ipp"]["cpu_per_request"], ms)
    row(f"ddip push {PUSH_MIB} MiB to every rank", lambda s: _med(s["ddip"]["push"]), secs)
    if ipp:
        row(f"ipyparallel push {PUSH_MIB} MiB to every engine", lambda s: _med(s["ipp"]["push"]), secs)
        row("ipyparallel / ddip: ready (warm), round trip, push",
            lambda s: " / ".join(times(a, b) for a, b in (
                (s["ipp"]["ready"], _med(s["ddip"]["ready_warm"])), (_med(s["ipp"]["rt"]), _med(s["ddip"]["rt"])),
                (_med(s["ipp"]["push"]), _med(s["ddip"]["push"])))), str)
    row("lowest free memory (MemAvailable)", lambda s: f"{s['machine']['min_avail_gib']:.1f} GiB", str)
    row("load average (1 min), highest seen", lambda s: f"{s['machine']['max_load1']:.1f}", str)

    text = "\n".join(lines) + "\n"
    big = sizes[-1]
    dd = big.get("ddip", {})
    n, k = big["ranks"], big["hosts"]
    extras = []
    if "push_one_per_host" in dd:
        warm, rt = _med(dd["ready_warm"]), _med(dd["rt"])
        push, push1 = _med(dd["push"]), _med(dd["push_one_per_host"])
        targets = [
            f"a warm group of {n} on {k} hosts ready ≤ {TARGET_WARM_S:g} s: {verdict(warm <= TARGET_WARM_S)} "
            f"({secs(warm)})",
            f"`run(\"pass\")` at {n} ranks ≤ {TARGET_RT_S * 1e3:g} ms: {verdict(rt <= TARGET_RT_S)} ({ms(rt)})",
            f"push to all {n} ranks ≤ {TARGET_PUSH_X:g}x a push to {k} × 1: "
            f"{verdict(push <= TARGET_PUSH_X * push1)} ({secs(push)} vs {secs(push1)}, {push / push1:.2f}x)",
        ]
        text += f"\nTargets (issue 34, item 1; {n} ranks on {k} hosts): " + "; ".join(targets) + ".\n"
        cpu1 = dd["cpu_per_request_one_per_host"]
        extras.append(f"{k} × 1 for comparison: `run(\"pass\")` {ms(_med(dd['rt_one_per_host']))}, notebook CPU "
                      f"per request {ms(cpu1)} ({dd['cpu_per_request'] / cpu1:.2f}x of it at {n} ranks on the "
                      f"same {k} hosts: the notebook's CPU grows with the {'ranks' if dd['cpu_per_request'] > 2 * cpu1 else 'hosts'}).")
    if "ready_gloo" in dd:
        extras.append(f"A warm group of {n} with torch + gloo (`backend=\"gloo\"`) ready in {secs(dd['ready_gloo'])}.")
    elif "ready_gloo_failed" in dd:
        extras.append(f"A warm group of {n} with torch + gloo did not get ready: {dd['ready_gloo_failed']}.")
    if "breakdown" in dd:
        b = dd["breakdown"]
        cpu = ", ".join(f"{kind} {sec:.2f} s ({b['processes'].get(kind, 0)})"
                        for kind, sec in sorted(b["cpu_s"].items(), key=lambda kv: -kv[1]))
        first, mid, last = b["ranks_born_s"]
        extras.append(f"Where a warm {n}-rank start goes: Group() {secs(b['group_s'])}, its first run "
                      f"{secs(b['first_run_s'])}; {b.get('forked', '?')} of {n} ranks forked from their host's template, "
                      f"started from {first:.2f} s to {last:.2f} s "
                      f"(median {mid:.2f} s) after Group() was called; CPU meanwhile, by kind of process "
                      f"(how many): {cpu} (load average {b['load1']:.1f}).")
    q = statistics.quantiles
    spread = (f" (p10/p90 at N={n}: ddip {ms(q(dd['rt'], n=10)[0])}/{ms(q(dd['rt'], n=10)[-1])})"
              if "rt" in dd else "")
    failed = "; ".join(f"N={s['ranks']}: {s['ipp_failed']}" for s in sizes if "ipp_failed" in s)
    notes = [
        f"ddip: ranks spread evenly over the hosts, `backend=None`; the cold first group follows "
        f"`ddip.hosts.release()` (it starts every host's agent and rank template); warm: median of "
        f"{WARM_REPS} later groups. ipyparallel: one start per size, SSHEngineSetLauncher into the "
        "same namespaces, or local engines where its row says so."
        + (f" Where its ssh start failed: {failed}." if failed else ""),
        f"Round trip and CPU per request: {RT_REPS} requests after {RT_WARMUP} warm-up, medians{spread}; "
        "CPU is time.process_time() of the notebook's process (all its threads) per request.",
        f"Push: a {PUSH_MIB} MiB float64 array, median of {PUSH_REPS} after one untimed push; values checked.",
        f"Processes still there after their tool's stop, killed by pid: {res.get('leftovers', 'none')}.",
        f"Took {res.get('took_s', 0):.0f} s; machine: {res.get('machine', '')}.",
    ]
    return text + "".join(f"\n{e}\n" for e in extras) + "\n" + "\n".join(f"- {x}" for x in notes) + "\n"


def plot(series: list[tuple[str, dict]], path: Path):
    """The curves of each result set in `series` ([(label, results)]): ready, round trip, CPU per
    request and push against the ranks, ddip and ipyparallel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ready (s)", [("ddip warm", "ddip", lambda d: _med(d["ready_warm"])),
                             ("ddip cold", "ddip", lambda d: d["ready_cold"]),
                             ("ipyparallel", "ipp", lambda d: d["ready"])]),
              ("round trip of run('pass') (ms)", [("ddip", "ddip", lambda d: 1e3 * _med(d["rt"])),
                                                   ("ipyparallel", "ipp", lambda d: 1e3 * _med(d["rt"]))]),
              ("notebook CPU per request (ms)", [("ddip", "ddip", lambda d: 1e3 * d["cpu_per_request"]),
                                                  ("ipyparallel", "ipp", lambda d: 1e3 * d["cpu_per_request"])]),
              (f"push {PUSH_MIB} MiB to every rank (s)", [("ddip", "ddip", lambda d: _med(d["push"])),
                                                           ("ipyparallel", "ipp", lambda d: _med(d["push"]))])]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    colors = {"ddip": "tab:blue", "ddip warm": "tab:blue", "ddip cold": "tab:cyan", "ipyparallel": "tab:orange"}
    for ax, (title, curves) in zip(axes, panels):
        for si, (label, res) in enumerate(series):
            last = si == len(series) - 1  # the latest run solid, earlier ones dotted
            for name, tool, get in curves:
                pts = [(s["ranks"], get(s[tool]), s[tool].get("mode", "")) for s in res["sizes"] if tool in s]
                if not pts:
                    continue
                xs, ys, modes = zip(*pts)
                suffix = f", {label}" if label and tool == "ddip" else ""
                line, = ax.plot(xs, ys, "-" if last else ":", marker="o" if last else ".", color=colors[name],
                                label=name + suffix)
                local = [(x, y) for x, y, m in pts if m == "local engines"]
                if local:  # ipyparallel's local engines where its ssh ones could not start: marked apart
                    ax.plot(*zip(*local), "s", markersize=9, mfc="none", color=line.get_color(),
                            label=f"{name} with local engines")
        sizes = sorted({s["ranks"] for _, res in series for s in res["sizes"]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_yscale("log")
        hosts = ", ".join(str(s["hosts"]) for s in series[-1][1]["sizes"])
        ax.set_xlabel(f"ranks (on {hosts} hosts)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------


def run(sizes=SIZES, ipp: bool = True, host_env: list[str] = (), save=None, ddip_too: bool = True,
        ipp_local: tuple[int, ...] = ()) -> dict:
    """Measures every (ranks, hosts) of `sizes` (the last one gets the extras); returns raw results,
    handed to save(results) after each size too (a long run that fails late keeps what it had).
    ipyparallel runs ssh engines on the hosts, local ones at the sizes in `ipp_local`, and local ones
    too where its ssh start fails (both said in the results)."""
    import numpy as np

    import ddip

    n_hosts = max(k for _, k in sizes)
    names = [f"H{i}" for i in range(n_hosts)]
    arr = np.arange(PUSH_MIB * (1 << 20) // 8, dtype=np.float64)
    t_start = time.perf_counter()
    res: dict = {"sizes": [], "ipp_mode": "ssh engines into the same namespaces" if ipp else "not run",
                 "loadavg_start": os.getloadavg(), "torch_in_notebook": "torch" in sys.modules,
                 "ddip": os.path.dirname(ddip.__file__), "host_env": list(host_env)}
    profile_dir = tempfile.mkdtemp(prefix="ddip-bench-scale-ipyparallel-")
    _log(f"making {n_hosts} namespace hosts")
    with netns_hosts.Hosts(names) as hosts:
        left = Leftovers(hosts)
        d = _Ddip(hosts, names, list(host_env))
        try:
            for i, (ranks, k) in enumerate(sizes):
                machine = _Machine()
                machine.sample()
                entry = {"ranks": ranks, "hosts": k}
                if ddip_too:
                    try:
                        entry["ddip"] = _bench_ddip(d, ranks, k, arr, machine, largest=i == len(sizes) - 1)
                    finally:
                        ddip.hosts.release()
                        left.sweep("ddip")
                if ipp:
                    local = ranks in ipp_local
                    try:
                        entry["ipp"] = _bench_ipp(hosts, names, ranks, k, arr, machine, profile_dir, local)
                    except Exception as exc:
                        entry["ipp_failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        _log(f"ipyparallel at {ranks}: {entry['ipp_failed']}")
                    finally:
                        left.sweep("ipyparallel")
                    if "ipp" not in entry and not local:
                        try:
                            entry["ipp"] = _bench_ipp(hosts, names, ranks, k, arr, machine, profile_dir, True)
                        except Exception as exc:
                            entry["ipp_local_failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        finally:
                            left.sweep("ipyparallel")
                entry["machine"] = machine.as_dict()
                res["sizes"].append(entry)
                if save is not None:
                    save(res)
        finally:
            left.sweep("end")
            shutil.rmtree(profile_dir, ignore_errors=True)
    res["leftovers"] = left.summary()
    res["loadavg_end"] = os.getloadavg()
    res["took_s"] = time.perf_counter() - t_start
    res["machine"] = (f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB; load average "
                      f"{res['loadavg_start'][0]:.1f} at the start, {res['loadavg_end'][0]:.1f} at the end")
    return res


def _parse_sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        ranks, _, k = item.partition(":")
        out.append((int(ranks), int(k or 1)))
    return out


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=os.environ.get("DDIP_BENCH_SCALE_SIZES"),
                    help="RANKS:HOSTS,... (default 2:1,8:1,32:4,128:16)")
    ap.add_argument("--no-ipp", action="store_true", help="leave ipyparallel out")
    ap.add_argument("--no-ddip", action="store_true", help="leave ddip out (ipyparallel's numbers alone)")
    ap.add_argument("--ipp-local", default="", help="RANKS,...: sizes where ipyparallel runs local engines")
    ap.add_argument("--from-json", help="print the table (and draw the plot) of earlier raw results; measure nothing")
    ap.add_argument("--json", default=str(RESULTS), help="where the raw results go")
    ap.add_argument("--plot", default=str(PLOT), help="where the curves go ('' for none)")
    ap.add_argument("--before", help="raw results of an earlier run, drawn beside this one's")
    ap.add_argument("--host-env", action="append", default=[], metavar="VAR=VALUE",
                    help="set on the hosts' agents, e.g. the PYTHONPATH of a snapshot of ddip (repeatable)")
    args = ap.parse_args([] if argv is None else argv)

    def draw(res):
        if args.plot:
            series = [("", res)]
            if args.before:
                series = [("before", json.loads(Path(args.before).read_text())), ("after", res)]
            plot(series, Path(args.plot))

    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        draw(res)
        return report(res)
    why = netns_hosts.missing()
    if why is not None:
        return f"Skipped: {why}. This benchmark builds hosts from network namespaces with their own sshd.\n"
    ipp = not args.no_ipp
    if ipp:
        try:
            import ipyparallel  # noqa: F401
        except ImportError:
            ipp = False
    sizes = _parse_sizes(args.sizes) if args.sizes else SIZES

    def save(res):
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(res, indent=1))

    res = run(sizes, ipp, args.host_env, save, ddip_too=not args.no_ddip,
              ipp_local=tuple(int(x) for x in args.ipp_local.split(",") if x))
    save(res)
    draw(res)
    return report(res)


if __name__ == "__main__":
    print(main(sys.argv[1:]))
