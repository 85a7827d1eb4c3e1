"""Groups across hosts: ddip against ipyparallel's ssh engines on the same two hosts, and against
the same ranks on one host, in one run.

    .venv/bin/python bench/bench_multihost.py      (or `make bench` for every bench module)

The hosts are the tests' (tests/netns_hosts.py): two Linux network namespaces with their own
address and sshd, joined through a bridge to the notebook's namespace, reached with an ssh config
of their own. They share this machine's filesystem, so both tools run this venv's Python there.
Every byte between a host and the others crosses its `ddip0` interface, whose kernel counters
give the bytes per host. Needs root, iproute2 and openssh (client and server); skipped otherwise.

What each side does:
- ddip: `Group(hosts={A: n, B: n}, launcher="ssh -F cfg", bind=<notebook's address>)`; with
  torch, `backend="gloo"` and `GLOO_SOCKET_IFNAME=ddip0`. One host: `Group(n=2n)` with ranks
  forked from the kernel's rank template, ready before timing starts.
- ipyparallel: `Cluster(engines="ssh", controller_ip=<notebook's address>)` with
  `SSHEngineSetLauncher.engines = {A: n, B: n}`, `ssh_args=["-F", cfg]`, `scp_args=["-O", "-F",
  cfg]` (the hosts' sshd has no sftp subsystem; -O is scp's own protocol) and
  `remote_python` = this venv's; `start_and_connect_sync()`, then the DirectView.
- ready: construction to a usable group (ddip: every rank said hello; ipyparallel: every engine
  registered).
- round trip, 2 x 2: ddip `g.run("pass")`, ipyparallel `view.execute("pass", block=True)`.
- push 64 MiB to 2 x 4: a float32 numpy array to every rank (`g.push(a=arr)`, `view.push({"a":
  arr}, block=True)`); each host's link bytes received during the push; the notebook's peak RSS
  during the push above its RSS before (VmHWM, reset through /proc/self/clear_refs).
- pull 64 MiB from one rank on host B (`g.pull("a", rank=...)`, `client[i].pull("a",
  block=True)`) and the bytes host B sent meanwhile. Pulled values are checked.

Clean-up: each tool's own stop first (`g.close()`; `client.close()` + `stop_cluster_sync()`).
Then every process left in a host's namespace (besides its sshd) and every new descendant of
this process gets GRACE_S to exit and is killed by pid (psutil checks the pid still names the
same process); the counts and names are reported. The hosts (namespaces, links, sshd, keys)
are removed at the end.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent / "tests"))  # netns_hosts: the hosts the tests use

import netns_hosts  # noqa: E402
from common import Leftovers, close_group, ipp_ssh_cluster, mb, ms, secs, times, verdict  # noqa: E402

MIB = 1 << 20
PUSH_MIB = 64
PER_HOST_RT = 2  # ranks per host for round trip and ready: 2 x 2
PER_HOST_PUSH = 4  # ranks per host for push and pull: 2 x 4
READY_REPS = 3
TORCH_LATER_REPS = 2
RT_WARMUP = 20
RT_REPS = 200
PUSH_REPS = 3  # timed, after one untimed warm-up push
PULL_REPS = 3
GRACE_S = 5.0
START_TIMEOUT_S = 300.0  # remote ranks importing torch cold on a shared 2-core machine
TARGET_BYTES = 1.1  # bytes per host within 1.1x the array
TARGET_PUSH = 5.0  # push at least 5x faster than ipyparallel
TARGET_RT = 2.0  # round trip at most 2x the same ranks on one host
TARGET_LATER_FACTOR, TARGET_LATER_PLUS = 2.0, 0.5  # later torch group within 2x one host + 0.5 s


def _log(msg: str):
    print(f"[bench_multihost] {msg}", file=sys.stderr, flush=True)


# -- measuring ------------------------------------------------------------------------------


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _reset_peak() -> bool:
    """Resets this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class _Push:
    """One timed transfer: seconds, each host's link bytes (received, sent), notebook RSS growth."""

    def __init__(self, hosts):
        self.hosts = hosts

    def __enter__(self):
        self.counters = self.hosts.link_counters() if self.hosts else {}
        self.rss0 = _rss()
        self.peak_ok = _reset_peak()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self.rss_growth = (_peak() - self.rss0) if self.peak_ok else None
        after = self.hosts.link_counters() if self.hosts else {}
        self.bytes = {n: (after[n][0] - self.counters[n][0], after[n][1] - self.counters[n][1]) for n in after}


def _median_by(runs: list[_Push], key):
    return statistics.median(key(r) for r in runs)


# -- ddip -----------------------------------------------------------------------------------


def _ddip_group(hosts, per_host: int, backend):
    import ddip

    env = {"GLOO_SOCKET_IFNAME": netns_hosts.LINK} if backend else None
    return ddip.Group(hosts={hosts.addr["A"]: per_host, hosts.addr["B"]: per_host}, launcher=hosts.launcher,
                      bind=hosts.me, backend=backend, env=env, timeout=START_TIMEOUT_S)


def _local_group(n: int, backend):
    import ddip

    return ddip.Group(n=n, backend=backend, timeout=START_TIMEOUT_S)


def _ready(make) -> float:
    t0 = time.perf_counter()
    g = make()
    took = time.perf_counter() - t0
    try:
        if g.size != len([r for r in g.run("1") if r.value == 1]):
            raise RuntimeError("a rank of a ready group did not answer")
    finally:
        close_group(g)
    return took


def _round_trips(run) -> list[float]:
    for _ in range(RT_WARMUP):
        run()
    times = []
    for _ in range(RT_REPS):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def _ddip_transfers(g, arr, hosts, pull_rank: int) -> tuple[list[_Push], list[_Push], int]:
    """Pushes (after a warm-up) and pulls on a ready group; the warm-up's RSS growth too."""
    with _Push(hosts) as first:
        g.push(a=arr)
    pushes = []
    for _ in range(PUSH_REPS):
        with _Push(hosts) as p:
            g.push(a=arr)
        pushes.append(p)
    want = float(arr[-1])
    got = [r.value for r in g.run("float(a[-1]) if a.nbytes == %d else None" % arr.nbytes)]
    if got != [want] * g.size:
        raise RuntimeError(f"ddip push delivered wrong data: {got}")
    g.run("a[0] = -1.0", ranks=[pull_rank])  # the pulled copy is the rank's own, not the notebook's
    pulls = []
    for _ in range(PULL_REPS):
        with _Push(hosts) as p:
            back = g.pull("a", rank=pull_rank)
        pulls.append(p)
    if back.shape != arr.shape or back[0] != -1.0 or back[-1] != arr[-1]:
        raise RuntimeError("ddip pull returned wrong data")
    return pushes, pulls, first.rss_growth


# -- ipyparallel ----------------------------------------------------------------------------


class _Ipp:
    """An ipyparallel cluster with ssh engines on the hosts, started as its docs show."""

    def __init__(self, hosts, per_host: int, profile_dir: str):
        self.hosts, self.per_host, self.profile_dir = hosts, per_host, profile_dir
        self.cluster = self.client = self.view = None

    def start(self) -> float:
        h = self.hosts
        t0 = time.perf_counter()
        self.cluster = ipp_ssh_cluster({h.addr["A"]: self.per_host, h.addr["B"]: self.per_host}, h.ssh_config,
                                       h.me, self.profile_dir)
        self.client = self.cluster.start_and_connect_sync()
        self.view = self.client[:]
        took = time.perf_counter() - t0
        if len(self.client.ids) != 2 * self.per_host:
            raise RuntimeError(f"ipyparallel registered {len(self.client.ids)} engines, expected {2 * self.per_host}")
        return took

    def engine_on(self, host: str) -> int:
        """The id of an engine on `host` (its address is its ddip0's)."""
        # Code, not functions: ipyparallel pickles functions by reference, and the engines can't
        # import this module.
        self.view.execute(_ENGINE_ADDRESS % self.hosts.me, block=True)
        where = self.view.pull("_address", block=True)
        for eid, addr in zip(self.client.ids, where):
            if addr == self.hosts.addr[host]:
                return eid
        raise RuntimeError(f"no ipyparallel engine on {host}: {where}")

    def stop(self):
        try:
            if self.client is not None:
                self.client.close()
        finally:
            if self.cluster is not None:
                self.cluster.stop_cluster_sync()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# No packet is sent: connecting a UDP socket only picks the route, whose source address is read.
_ENGINE_ADDRESS = """
import socket
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as _s:
    _s.connect(("%s", 9))
    _address = _s.getsockname()[0]
"""


def _ipp_transfers(c: _Ipp, arr, hosts) -> tuple[list[_Push], list[_Push], int]:
    with _Push(hosts) as first:
        c.view.push({"a": arr}, block=True)
    pushes = []
    for _ in range(PUSH_REPS):
        with _Push(hosts) as p:
            c.view.push({"a": arr}, block=True)
        pushes.append(p)
    want = float(arr[-1])
    c.view.execute("_last = float(a[-1])", block=True)
    got = c.view.pull("_last", block=True)
    if got != [want] * len(c.client.ids):
        raise RuntimeError(f"ipyparallel push delivered wrong data: {got}")
    eid = c.engine_on("B")
    pulls = []
    for _ in range(PULL_REPS):
        with _Push(hosts) as p:
            back = c.client[eid].pull("a", block=True)
        pulls.append(p)
    if back.shape != arr.shape or back[-1] != arr[-1]:
        raise RuntimeError("ipyparallel pull returned wrong data")
    return pushes, pulls, first.rss_growth


# -- report ---------------------------------------------------------------------------------


def main() -> str:
    why = netns_hosts.missing()
    if why is not None:
        return f"Skipped: {why}. This benchmark builds two hosts from network namespaces with their own sshd.\n"
    try:
        import ipyparallel  # noqa: F401
    except ImportError:
        return "Skipped: needs ipyparallel (`pip install -e '.[bench]'`), the tool it is measured against.\n"
    import numpy as np

    import ddip
    import ddip.template

    # The one-host column forks its ranks from the kernel's rank template, as a notebook's would.
    ddip.prewarm()
    state = ddip.template._handle.wait_ready(180_000)[0]
    if state != "ready":
        raise RuntimeError("the rank template did not become ready: " + ddip.template.status())
    arr = np.arange(PUSH_MIB * MIB // 4, dtype=np.float32)
    profile_dir = tempfile.mkdtemp(prefix="ddip-bench-multihost-ipyparallel-")
    res: dict[str, object] = {}
    with netns_hosts.Hosts() as hosts:
        left = Leftovers(hosts)
        try:
            _bench_ddip(hosts, arr, res, left)
            _bench_ipp(hosts, arr, res, left, profile_dir)
            _bench_one_host(arr, res, left)
        finally:
            left.sweep("end")
            shutil.rmtree(profile_dir, ignore_errors=True)
    return _report(res, left, arr.nbytes)


def _bench_ddip(hosts, arr, res, left):
    _log("ddip: first 2 x 2 group with torch + gloo on fresh hosts")
    res["torch_first"] = _ready(lambda: _ddip_group(hosts, PER_HOST_RT, "gloo"))
    _log(f"ddip: {TORCH_LATER_REPS} later 2 x 2 groups with torch + gloo")
    res["torch_later"] = [_ready(lambda: _ddip_group(hosts, PER_HOST_RT, "gloo")) for _ in range(TORCH_LATER_REPS)]
    _log(f"ddip: {READY_REPS} 2 x 2 groups without torch")
    res["ready"] = [_ready(lambda: _ddip_group(hosts, PER_HOST_RT, None)) for _ in range(READY_REPS)]
    _log(f"ddip: round trip, 2 x 2, {RT_REPS} after {RT_WARMUP} warm-up")
    g = _ddip_group(hosts, PER_HOST_RT, None)
    try:
        res["rt"] = _round_trips(lambda: g.run("pass"))
    finally:
        close_group(g)
    _log(f"ddip: push {PUSH_MIB} MiB to 2 x {PER_HOST_PUSH}, pull from a rank on B")
    t0 = time.perf_counter()
    g = _ddip_group(hosts, PER_HOST_PUSH, None)
    res["ready8"] = time.perf_counter() - t0
    try:
        res["push"], res["pull"], res["push_first_rss"] = _ddip_transfers(g, arr, hosts, pull_rank=PER_HOST_PUSH)
    finally:
        close_group(g)
    import ddip

    ddip.hosts.release()  # the hosts' standing agents and templates stay for later groups until let go
    left.sweep("ddip")


def _bench_ipp(hosts, arr, res, left, profile_dir):
    _log("ipyparallel: 2 x 2 ssh engines: ready and round trip")
    c = _Ipp(hosts, PER_HOST_RT, profile_dir)
    try:
        res["ipp_ready"] = c.start()
        res["ipp_rt"] = _round_trips(lambda: c.view.execute("pass", block=True))
    finally:
        c.stop()
        left.sweep("ipyparallel")
    _log(f"ipyparallel: 2 x {PER_HOST_PUSH} ssh engines: push {PUSH_MIB} MiB, pull from an engine on B")
    c = _Ipp(hosts, PER_HOST_PUSH, profile_dir)
    try:
        res["ipp_ready8"] = c.start()
        res["ipp_push"], res["ipp_pull"], res["ipp_push_first_rss"] = _ipp_transfers(c, arr, hosts)
    finally:
        c.stop()
        left.sweep("ipyparallel")


def _bench_one_host(arr, res, left):
    n, n8 = 2 * PER_HOST_RT, 2 * PER_HOST_PUSH
    _log(f"one host: Group(n={n}) warm, with and without torch; round trip; push and pull with n={n8}")
    _ready(lambda: _local_group(n, "gloo"))  # untimed: the first fork after the template's start
    res["one_torch"] = [_ready(lambda: _local_group(n, "gloo")) for _ in range(READY_REPS)]
    res["one_ready"] = [_ready(lambda: _local_group(n, None)) for _ in range(READY_REPS)]
    g = _local_group(n, None)
    try:
        res["one_rt"] = _round_trips(lambda: g.run("pass"))
    finally:
        close_group(g)
    t0 = time.perf_counter()
    g = _local_group(n8, None)
    res["one_ready8"] = time.perf_counter() - t0
    try:
        res["one_push"], res["one_pull"], res["one_push_first_rss"] = _ddip_transfers(g, arr, None, pull_rank=n8 - 1)
    finally:
        close_group(g)
    left.sweep("ddip, one host")


def _report(res, left, nbytes) -> str:
    med = statistics.median
    push_t = _median_by(res["push"], lambda p: p.seconds)
    ipp_push_t = _median_by(res["ipp_push"], lambda p: p.seconds)
    one_push_t = _median_by(res["one_push"], lambda p: p.seconds)
    pull_t = _median_by(res["pull"], lambda p: p.seconds)
    ipp_pull_t = _median_by(res["ipp_pull"], lambda p: p.seconds)
    one_pull_t = _median_by(res["one_pull"], lambda p: p.seconds)
    # Bytes into each host during a push (the most of the timed pushes), out of host B during a pull.
    rx = {h: max(p.bytes[h][0] for p in res["push"]) for h in ("A", "B")}
    ipp_rx = {h: max(p.bytes[h][0] for p in res["ipp_push"]) for h in ("A", "B")}
    tx_b = max(p.bytes["B"][1] for p in res["pull"])
    ipp_tx_b = max(p.bytes["B"][1] for p in res["ipp_pull"])

    def rss(key):
        vals = [p.rss_growth for p in res[key]] + [res[key + "_first_rss"]]
        return None if any(v is None for v in vals) else max(vals)

    rt, ipp_rt, one_rt = med(res["rt"]), med(res["ipp_rt"]), med(res["one_rt"])
    ready, ipp_ready, one_ready = med(res["ready"]), res["ipp_ready"], med(res["one_ready"])
    later, one_torch = med(res["torch_later"]), med(res["one_torch"])
    rows = [  # step, ddip, ipyparallel, one host, formatted
        ("ready, 2 × 2, no torch", ready, ipp_ready, one_ready, secs),
        ("ready, 2 × 2, torch + gloo, first group on the hosts", res["torch_first"], None, None, secs),
        ("ready, 2 × 2, torch + gloo, a later group", later, None, one_torch, secs),
        (f"ready, 2 × {PER_HOST_PUSH}, no torch", res["ready8"], res["ipp_ready8"], res["one_ready8"], secs),
        ("`run(\"pass\")` round trip, 2 × 2", rt, ipp_rt, one_rt, ms),
        (f"push {PUSH_MIB} MiB to 2 × {PER_HOST_PUSH} ranks", push_t, ipp_push_t, one_push_t, secs),
        (f"pull {PUSH_MIB} MiB from a rank on host B", pull_t, ipp_pull_t, one_pull_t, secs),
    ]
    lines = ["| | ddip | ipyparallel over ssh | ddip, same ranks on one host | ipyparallel / ddip | ddip / one host |",
             "|---|---|---|---|---|---|"]
    for step, ours, theirs, one, fmt in rows:
        lines.append(f"| {step} | {fmt(ours)} | {fmt(theirs)} | {fmt(one)} | {times(theirs, ours)} | {times(ours, one)} |")
    a = nbytes
    lines += [
        f"| bytes into host A / B during a push | {mb(rx['A'])} / {mb(rx['B'])} "
        f"({rx['A'] / a:.2f}x / {rx['B'] / a:.2f}x the array) | {mb(ipp_rx['A'])} / {mb(ipp_rx['B'])} "
        f"({ipp_rx['A'] / a:.2f}x / {ipp_rx['B'] / a:.2f}x) | — (no link) | {times(max(ipp_rx.values()), max(rx.values()))} | — |",
        f"| bytes out of host B during a pull | {mb(tx_b)} ({tx_b / a:.2f}x) | {mb(ipp_tx_b)} ({ipp_tx_b / a:.2f}x) "
        f"| — (no link) | {times(ipp_tx_b, tx_b)} | — |",
        f"| notebook's peak RSS growth during a push | {mb(rss('push'))} | {mb(rss('ipp_push'))} "
        f"| {mb(rss('one_push'))} | — | — |",
    ]
    worst_rx = max(rx.values())
    push_ratio = ipp_push_t / push_t
    later_limit = TARGET_LATER_FACTOR * one_torch + TARGET_LATER_PLUS
    targets = [
        f"bytes per host within {TARGET_BYTES:g}x the array: {verdict(worst_rx <= TARGET_BYTES * a)} "
        f"({worst_rx / a:.2f}x)",
        f"push to 2 × {PER_HOST_PUSH} ranks ≥ {TARGET_PUSH:g}x faster than ipyparallel: "
        f"{verdict(push_ratio >= TARGET_PUSH)} ({push_ratio:.2f}x)",
        f"round trip ≤ {TARGET_RT:g}x the same ranks on one host: {verdict(rt <= TARGET_RT * one_rt)} "
        f"({rt / one_rt:.2f}x)",
        f"a later 2 × 2 torch + gloo group ready within {TARGET_LATER_FACTOR:g}x one warm host + "
        f"{TARGET_LATER_PLUS:g} s: {verdict(later <= later_limit)} ({secs(later)} vs {secs(later_limit)})",
    ]
    q = statistics.quantiles
    killed = "; ".join(f"{tool} {len(names)}" + (f" ({', '.join(sorted(set(names)))})" if names else "")
                       for tool, names in left.killed.items())
    notes = [
        f"Medians. Ready: {READY_REPS} groups per configuration (torch + gloo later groups: {TORCH_LATER_REPS}; "
        f"ipyparallel: one start per size, each takes tens of seconds). Round trip: {RT_REPS} after "
        f"{RT_WARMUP} warm-up (p10/p90: ddip {ms(q(res['rt'], n=10)[0])}/{ms(q(res['rt'], n=10)[-1])}, "
        f"ipyparallel {ms(q(res['ipp_rt'], n=10)[0])}/{ms(q(res['ipp_rt'], n=10)[-1])}, one host "
        f"{ms(q(res['one_rt'], n=10)[0])}/{ms(q(res['one_rt'], n=10)[-1])}). Push and pull: "
        f"{PUSH_REPS} and {PULL_REPS} timed after one untimed push; "
        f"push spread ddip {_spread(res['push'])}, ipyparallel {_spread(res['ipp_push'])}.",
        "The tools run one after another (ddip, ipyparallel, one host), not interleaved: an "
        "ipyparallel start over ssh takes tens of seconds.",
        "Bytes: the kernel's counters of each host's only interface (IP and TCP headers included, "
        "ssh and heartbeats too): the most of the timed transfers. The array is "
        f"{a / 1e6:.1f} MB ({PUSH_MIB} MiB).",
        "RSS: the notebook process's peak resident memory during a push above its resident memory "
        "just before (the most over the pushes, the first one included).",
        "The one-host column forks its ranks from the kernel's rank template (ready before timing); "
        "the first torch group there is untimed.",
        f"Processes still there {GRACE_S:g} s after their tool's stop, killed by pid: {killed or 'none'}.",
    ]
    return ("\n".join(lines) + "\n\nTargets: " + "; ".join(targets) + ".\n\n"
            + "\n".join(f"- {n}" for n in notes) + "\n")


def _spread(runs) -> str:
    ts = [p.seconds for p in runs]
    return f"{min(ts):.2f}-{max(ts):.2f} s"


if __name__ == "__main__":
    print(main())
