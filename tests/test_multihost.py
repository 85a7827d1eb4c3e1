"""Groups across hosts, on one machine: each "host" is a Linux network namespace with its own
address and its own sshd (Debian's openssh-server), joined by veth pairs to a bridge in a hub
namespace, which the notebook's (root) namespace reaches through a veth of its own. ssh uses a
user key and a host key made for the test, through an ssh config given with -F. Traffic goes
only to addresses inside namespaces made here. Everything is removed at the end (by pid, by
name).

Needs root, iproute2, openssh-server and openssh-client (`make setup` installs them); skipped
otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

import ddip
from ddip.errors import RemoteError, StartError

from conftest import alive, wait_until
from fake_nvidia_smi import fake_gpus  # noqa: F401  (a fixture)

from netns_hosts import SSHD, Hosts, _missing, _port_open, _run  # noqa: F401  (shared with bench/)


_why_not = _missing()
needs_netns = pytest.mark.skipif(_why_not is not None, reason=_why_not or "")


@pytest.fixture(scope="module")
def hosts():
    h = Hosts()
    yield h
    h.close()


def _pids(g) -> list[int]:
    return [row["pid"] for row in g.status()]


ALL_REDUCE = """
import os, torch, torch.distributed as dist
t = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(t)
print("sum", int(t.item()), "on", os.environ["DDIP_HOST"])
(int(t.item()), os.environ["MASTER_ADDR"], os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"],
 os.environ["WORLD_SIZE"])
"""


@needs_netns
def test_two_hosts_train_together_fail_restart_and_close(hosts):
    a, b = hosts.addr["A"], hosts.addr["B"]
    g = ddip.Group(hosts=f"{a}:2,{b}:2", launcher=hosts.launcher, backend="gloo", timeout=120,
                   env={"GLOO_SOCKET_IFNAME": "ddip0"}, heartbeat_timeout=5)
    try:
        seen = []
        results = g.run(ALL_REDUCE, on_output=lambda rank, stream, text: seen.append((rank, stream, text)))
        assert [r.value for r in results] == [(10, a, "0", "2", "4"), (10, a, "1", "2", "4"),
                                              (10, a, "0", "2", "4"), (10, a, "1", "2", "4")]
        assert sorted((r, t) for r, s, t in seen if s == "stdout") == [
            (0, f"sum 10 on {a}\n"), (1, f"sum 10 on {a}\n"), (2, f"sum 10 on {b}\n"), (3, f"sum 10 on {b}\n")]
        # The agents connected back to the address that routes to the hosts, not 0.0.0.0.
        assert g._coord.link_address.startswith(hosts.me + ":")

        # The key never shows in a process listing: not on a command line, not in an environment.
        key_like = re.compile(rb"[0-9a-f]{64}")
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            for what in ("cmdline", "environ"):
                try:
                    with open(f"/proc/{pid}/{what}", "rb") as f:
                        assert not key_like.search(f.read()), f"something like a key in /proc/{pid}/{what}"
                except OSError:
                    pass

        # Strangers on the network: refused before anything is parsed, and the group goes on.
        host, port = g._coord.link_address.rsplit(":", 1)
        for junk in (b"GET / HTTP/1.1\r\n\r\n" * 8, b"\x80\x05\x95" + os.urandom(200)):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.settimeout(5)
                s.recv(64)  # the challenge
                s.sendall(junk)
                try:
                    answer = s.recv(64)
                except ConnectionResetError:  # closed with our junk unread
                    answer = b""
                assert answer == b"", "a connection with the wrong key must be closed unanswered"
        assert wait_until(lambda: g._coord.rejected_connections == 2, 5)
        assert "refused a connection from" in g._coord.last_rejection
        assert [r.value[0] for r in g.run(ALL_REDUCE)] == [10] * 4

        # One host's workers die: once their deaths are known (their host's agent reports them),
        # a request is refused with an error that names those ranks and the cause. (Sent before
        # that, it would fail as a RemoteError naming them: which one comes first is a race.)
        victims = _pids(g)[2:]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: [r["state"] for r in g.status()][2:] == ["dead", "dead"], 30)
        with pytest.raises(ddip.RankDeadError) as err:
            g.run("import time; time.sleep(30)", timeout=60)
        assert err.value.ranks == [2, 3]
        assert "killed by SIGKILL" in str(err.value)
        assert all(wait_until(lambda p=p: not alive(p), 5) for p in victims)

        g.restart()
        assert [r.value[0] for r in g.run(ALL_REDUCE)] == [10] * 4
        pids = _pids(g)
    finally:
        g.close()
    assert all(wait_until(lambda p=p: not alive(p), 10) for p in pids), "a remote worker outlived close()"


@needs_netns
def test_a_host_that_drops_off_the_network_fails_within_the_heartbeat_timeout(hosts):
    a, b = hosts.addr["A"], hosts.addr["B"]
    g = ddip.Group(hosts=f"{a}:1,{b}:1", launcher=hosts.launcher, backend=None, heartbeat_timeout=3)
    try:
        pids = _pids(g)
        hosts.set_link("B", False)
        start = time.monotonic()
        with pytest.raises(RemoteError) as err:
            g.run("import time; time.sleep(60)")
        took = time.monotonic() - start
        assert err.value.ranks[0] == 1 or 1 in err.value.ranks
        assert "no heartbeat" in str(err.value) or "lost the link" in str(err.value)
        assert took < 3 + 8, f"the dropped host was reported after {took:.1f} s"
        t0 = time.monotonic()
        g.close(grace=0.5)
        assert time.monotonic() - t0 < 15, "close() must not hang on an unreachable host"
    finally:
        hosts.set_link("B", True)
        g.close()
    # The agent on B heard nothing from the kernel for its timeout, and ended its worker.
    assert all(wait_until(lambda p=p: not alive(p), 15) for p in pids), "a worker on the cut-off host survived"


@needs_netns
@pytest.mark.timeout(120)
def test_a_rank_cut_off_while_idle_fails_requests_naming_its_host_then_is_reported_lost(hosts):
    # Taken off the network while idle: once reported unresponsive, a request to it fails at
    # once (it does not wait for an answer that can't come), naming the rank, its host and why.
    a, b = hosts.addr["A"], hosts.addr["B"]
    g = ddip.Group(hosts=f"{a}:1,{b}:1", launcher=hosts.launcher, backend=None, heartbeat_timeout=3)
    try:
        hosts.set_link("B", False)
        assert wait_until(lambda: [r["state"] for r in g.status()][1] != "idle", 30)
        with pytest.raises((ddip.RankUnresponsiveError, ddip.RankDeadError)) as err:
            g.run("1 + 1")
        assert err.value.ranks == [1]
        assert b in str(err.value) and ("no heartbeat" in str(err.value) or "lost the link" in str(err.value))
        # Its agent stops the rank after as long without the kernel, so the link can't come back:
        # the kernel closes it, and the rank is reported dead with the cause.
        assert wait_until(lambda: [r["state"] for r in g.status()][1] == "dead", 30)
        with pytest.raises(ddip.RankDeadError) as err:
            g.run("1 + 1")
        assert err.value.ranks == [1]
        assert f"lost the link to its host {b}: it acknowledged nothing for 3000 ms" in str(err.value), str(err.value)
        assert [r.value for r in g.run("1 + 1", ranks=[0])] == [2]  # the other host goes on
    finally:
        hosts.set_link("B", True)
        g.close(grace=0.5)


def _launcher_pid(host: str) -> int:
    """The ssh this process started for `host`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and argv[0] == b"ssh" and host.encode() in argv:
            return int(pid)
    raise AssertionError(f"no ssh to {host} among this process's children")


@needs_netns
@pytest.mark.timeout(120)
def test_a_launcher_that_exits_after_its_host_connected_is_a_lost_host(hosts):
    a, b = hosts.addr["A"], hosts.addr["B"]
    g = ddip.Group(hosts=f"{a}:1,{b}:1", launcher=hosts.launcher, backend=None)
    try:
        pid = _pids(g)[1]
        os.kill(_launcher_pid(b), signal.SIGKILL)
        assert wait_until(lambda: [r["state"] for r in g.status()][1] == "dead", 30)
        with pytest.raises(ddip.RankDeadError) as err:
            g.run("1 + 1")
        assert err.value.ranks == [1]
        assert f"its launcher (ssh) ended with killed by SIGKILL while host {b} was connected" in str(err.value)
        # The link was closed, so its agent stopped the rank.
        assert wait_until(lambda: not alive(pid), 15), "the rank outlived its launcher"
        assert [r.value for r in g.run("1 + 1", ranks=[0])] == [2]
    finally:
        g.close()


def _listening_port(address: str, ours: bool = False) -> int | None:
    """A TCP port this machine listens on at `address`, as any local user sees it; with `ours`,
    one of this process's sockets only."""
    want = socket.inet_aton(address)[::-1].hex().upper()
    mine = set()
    if ours:
        for fd in os.listdir("/proc/self/fd"):
            try:
                mine.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and local.split(":")[0] == want and (not ours or f"socket:[{inode}]" in mine):
                return int(local.split(":")[1], 16)
    return None


@needs_netns
@pytest.mark.timeout(180)
def test_a_group_starts_while_strangers_hold_its_port_busy(hosts, capfd):
    # A local user opens 70 idle connections to the listener as soon as it appears (its port is
    # in /proc/net/tcp), from the notebook's own address; the launchers start only then.
    a, b = hosts.addr["A"], hosts.addr["B"]
    flag = os.path.join(hosts.dir, f"strangers-{time.monotonic_ns()}")
    launcher = (f"while [ ! -e {flag} ]; do sleep 0.02; done; "
                f"exec ssh -F {hosts.dir}/ssh_config -T -o BatchMode=yes {{host}} exec {{command}}")
    held, seen, stop = [], [], threading.Event()

    def strangers():
        # The group's listener: this process's own. Another process's on the same address (a
        # test run beside this one whose hosts got the same subnet) would take the connections,
        # and this group would refuse none of them.
        port = None
        while port is None and not stop.wait(0.005):
            port = _listening_port(hosts.me, ours=True)
        seen.append(port)
        for _ in range(70):
            try:
                held.append(socket.create_connection((hosts.me, port), timeout=5))
            except OSError:
                pass
        open(flag, "w").close()

    thread = threading.Thread(target=strangers, daemon=True)
    thread.start()
    try:
        g = ddip.Group(hosts=f"{a}:1,{b}:1", launcher=launcher, backend=None, timeout=60)
        try:
            assert len(held) == 70
            assert seen == [int(g._coord.link_address.rpartition(":")[2])]
            assert [r.value for r in g.run("1 + 1")] == [2, 2]
            rejected = g._coord.rejected_connections
        finally:
            g.close()
    finally:
        stop.set()
        thread.join(10)
        for s in held:
            s.close()
    # At most 8 + one per host from one address wait to authenticate; the older ones were closed.
    assert rejected >= 70 - 10
    # The kernel's log: a few refusals in full, then a count.
    err = capfd.readouterr().err
    assert len([l for l in err.splitlines() if l.startswith("ddip: refused a connection from")]) == 5, err
    # The last refusal: one closed to make room, or, where the group took longer than the handshake
    # timeout to start and close (a loaded machine), one of the last ten that waited it out.
    assert re.search(r"^ddip: refused \d+ more connection\(s\) before the group closed; the last: refused a "
                     rf"connection from {re.escape(hosts.me)}:\d+: (closed to make room|no valid handshake "
                     r"within \d+ ms)", err, re.M), err


@needs_netns
def test_no_remote_worker_survives_the_sigkill_of_the_notebook(hosts):
    a, b = hosts.addr["A"], hosts.addr["B"]
    script = textwrap.dedent(f"""
        import ddip, sys
        g = ddip.Group(hosts="{a}:1,{b}:1", launcher={hosts.launcher!r}, backend=None)
        print(*[row["pid"] for row in g.status()], flush=True)
        sys.stdin.read()
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(x) for x in pids)
    finally:
        p.kill()
        p.wait()
    assert all(wait_until(lambda x=x: not alive(x), 10) for x in pids), "a remote worker outlived the notebook"


# What a remote rank says about itself before it imports anything: its parent (the host's agent,
# which forks it from its template), whether it was forked, whether torch is already there, and
# whether CUDA was touched.
PROBE = """
import os, sys, ddip.template
(os.environ["DDIP_HOST"], os.getpid(), os.getppid(), ddip.template.forked, "torch" in sys.modules,
 sys.modules["torch"].cuda.is_initialized() if "torch" in sys.modules else None)
"""


def _templates_under(agent: int, ranks=()) -> list[int]:
    """The rank templates whose parent is `agent` (one pid namespace here: the "hosts" share it);
    `ranks` forked from them, whose command line is the template's, are left out."""
    found = []
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == agent and b"ddip.template.main()" in cmd and int(pid) not in ranks:
            found.append(int(pid))
    return found


def _children(pid: int) -> set[int]:
    out = set()
    for entry in [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == pid:
            out.add(int(entry))
    return out


def _maps_cuda(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libcuda" in f.read()


@needs_netns
def test_later_groups_and_restarts_fork_remote_ranks_from_each_hosts_own_template(hosts):
    a, b = hosts.addr["A"], hosts.addr["B"]
    kw = dict(hosts=f"{a}:2,{b}:2", launcher=hosts.launcher, backend=None, warm=True, timeout=120)

    def probe(g):
        rows = [r.value for r in g.run(PROBE)]
        assert [r[0] for r in rows] == [a, a, b, b]
        # Forked, torch already imported before the rank imported anything, CUDA untouched.
        assert [r[3:] for r in rows] == [(True, True, False)] * 4, rows
        agents = [r[2] for r in rows]
        assert agents[0] == agents[1] and agents[2] == agents[3] and agents[0] != agents[2]
        return [r[1] for r in rows], (agents[0], agents[2])

    g = ddip.Group(**kw)
    try:
        ranks, agents = probe(g)
        templates = [_templates_under(x, ranks) for x in agents]
        assert all(len(t) == 1 for t in templates), templates
        templates = [t[0] for t in templates]
        assert not any(_maps_cuda(t) for t in templates), "CUDA's driver library is loaded in a host's template"
    finally:
        g.close()
    # A closed group leaves each host its agent and template, and nothing else under the agent.
    assert all(wait_until(lambda p=p: not alive(p), 10) for p in ranks), "a remote rank outlived close()"
    assert [_children(x) for x in agents] == [{templates[0]}, {templates[1]}]
    assert all(alive(t) for t in templates) and not any(_children(t) for t in templates)

    g = ddip.Group(**kw)
    try:
        ranks2, agents2 = probe(g)
        assert agents2 == agents, "a later group's ranks come from the same standing agents"
        assert [_templates_under(x, ranks2) for x in agents] == [[templates[0]], [templates[1]]]
        assert set(ranks2).isdisjoint(ranks)
        g.restart()
        ranks3, agents3 = probe(g)
        assert agents3 == agents and set(ranks3).isdisjoint(ranks2)
        assert all(not alive(p) for p in ranks2)
    finally:
        g.close()
    # Letting the hosts go ends their agents and templates.
    assert ddip.hosts.release() == 2
    for pid in [*ranks3, *agents, *templates]:
        assert wait_until(lambda p=pid: not alive(p), 10), f"{pid} outlived ddip.hosts.release()"


@needs_netns
def test_a_hosts_agent_and_template_outlive_a_closed_group_but_not_the_notebooks_sigkill(hosts):
    a, b = hosts.addr["A"], hosts.addr["B"]
    script = textwrap.dedent(f"""
        import ddip, os, sys
        g = ddip.Group(hosts="{a}:1,{b}:1", launcher={hosts.launcher!r}, backend=None, warm=True)
        print(*[v for r in g.run("import os; (os.getpid(), os.getppid())") for v in r.value], flush=True)
        g.close()
        print("closed", flush=True)
        sys.stdin.read()
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        r0, agent0, r1, agent1 = [int(x) for x in p.stdout.readline().split()]
        assert p.stdout.readline() == "closed\n"
        assert wait_until(lambda: not alive(r0) and not alive(r1), 10), "a rank outlived close()"
        templates = _templates_under(agent0) + _templates_under(agent1)
        assert len(templates) == 2 and all(alive(x) for x in [agent0, agent1, *templates])
        assert [_children(agent0), _children(agent1)] == [{templates[0]}, {templates[1]}]
    finally:
        p.kill()
        p.wait()
    for pid in (agent0, agent1, *templates):
        assert wait_until(lambda x=pid: not alive(x), 15), f"{pid} outlived the notebook's SIGKILL"


# Python runs sitecustomize at start-up: where THREAD_ON_HOST names the host it runs on (THIS_HOST),
# it starts a thread that never ends, as a library that starts helper threads when loaded does. On
# that host the rank template then has a thread it can't stop, and refuses to serve (a fork would
# hold the thread's locks); the ranks there start cold, with the same thread, and work.
THREAD_AT_START = """
import os, threading, time
if os.environ.get("THREAD_ON_HOST") and os.environ.get("THREAD_ON_HOST") == os.environ.get("THIS_HOST"):
    threading.Thread(target=time.sleep, args=(1e9,), daemon=True).start()
"""


@needs_netns
@pytest.mark.timeout(240)
def test_a_host_whose_rank_template_cannot_serve_says_why_its_ranks_start_cold(hosts, tmp_path, capfd):
    a, b = hosts.addr["A"], hosts.addr["B"]
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(THREAD_AT_START)
    # Each host's agent, and so its template and its ranks, get this environment there.
    launcher = (f"ssh -F {hosts.ssh_config} {{host}} env PYTHONPATH={site} THREAD_ON_HOST={a} "
                f"THIS_HOST={{host}} {{command}}")
    capfd.readouterr()
    g = ddip.Group(hosts=f"{a}:1,{b}:1", launcher=launcher, backend=None, warm=True, timeout=120)
    try:
        for start in range(2):  # said at each group start there: a restart is one
            err = capfd.readouterr().err
            notes = [line for line in err.splitlines() if line.startswith("ddip: host ")]
            assert len(notes) == 1, err
            assert notes[0].startswith(f"ddip: host {a}: ranks start cold: the rank template failed: the template "
                                       f"still has 2 threads after its imports ("), notes
            assert notes[0].endswith("); it can't be forked safely"), notes
            # Host A's rank started cold and works; host B's was forked from its template.
            rows = [r.value for r in g.run(PROBE)]
            assert [(r[0], r[3]) for r in rows] == [(a, False), (b, True)], rows
            # Where the template's state is shown (ddip.template.status(), %makedip -v): A's note.
            status = ddip.template.status()
            assert notes[0].removeprefix("ddip: ") in status and f"host {b}" not in status, status
            if start == 0:
                g.restart()
    finally:
        g.close()
        ddip.hosts.release()  # these hosts' agents have this test's environment: not for later tests


def _rx_bytes(hosts, name: str) -> int:
    """Bytes that arrived on host `name`'s only link (its ddip0 veth) so far."""
    return int(_run("cat", "/sys/class/net/ddip0/statistics/rx_bytes", ns=hosts.ns[name]))


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def _reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


CHECKSUM = "import hashlib; hashlib.sha256(x.tobytes()).hexdigest()"


@needs_netns
def test_a_push_crosses_each_hosts_link_once_and_reaches_every_rank_there(hosts):
    np = pytest.importorskip("numpy")
    import hashlib
    a, b = hosts.addr["A"], hosts.addr["B"]
    g = ddip.Group(hosts=f"{a}:2,{b}:2", launcher=hosts.launcher, backend=None, timeout=120)
    try:
        x = np.random.default_rng(19).integers(0, 256, size=32 << 20, dtype=np.uint8)
        want = hashlib.sha256(x.tobytes()).hexdigest()
        before = {n: _rx_bytes(hosts, n) for n in hosts.ns}
        g.push(x=x)
        crossed = {n: _rx_bytes(hosts, n) - before[n] for n in hosts.ns}
        assert [r.value for r in g.run(CHECKSUM)] == [want] * 4
        for n, got in crossed.items():
            # Once per host (plus framing and heartbeats), not once per rank (2x).
            assert x.nbytes <= got < 1.1 * x.nbytes, f"{got} bytes crossed host {n}'s link for {x.nbytes}"
        # The host's copy is its ranks': a second push with other content reaches them as well.
        y = x[::-1].copy()
        g.push(x=y)
        assert [r.value for r in g.run(CHECKSUM)] == [hashlib.sha256(y.tobytes()).hexdigest()] * 4
    finally:
        g.close()


@needs_netns
def test_the_notebooks_memory_during_a_push_holds_one_copy_whatever_the_rank_count(hosts):
    np = pytest.importorskip("numpy")
    import hashlib
    a, b = hosts.addr["A"], hosts.addr["B"]
    g = ddip.Group(hosts=f"{a}:4,{b}:4", launcher=hosts.launcher, backend=None, timeout=180)
    try:
        x = np.random.default_rng(20).integers(0, 256, size=32 << 20, dtype=np.uint8)
        want = hashlib.sha256(x.tobytes()).hexdigest()
        _reset_peak_rss()
        start = _rss_kb("VmRSS")
        g.push(x=x)
        grew = (_rss_kb("VmHWM") - start) * 1024
        assert [r.value for r in g.run(CHECKSUM)] == [want] * 8
        # The segment (one copy) and bounded buffers; one copy per remote rank was 8x.
        assert grew < 2 * x.nbytes, f"the notebook's peak RSS grew by {grew} bytes for {x.nbytes} pushed to 8 ranks"
    finally:
        g.close()


class _Tap:
    """A relay between host A's agent and the kernel that can write a forged frame header into
    the agent -> kernel stream, at a frame boundary (it follows the sealed framing, see
    channel.hpp), as an attacker on the path could."""

    RESPONSE = 8 + 32 + 4 + 32  # the agent's handshake response, before the first frame

    def __init__(self, addr: str, real: str):
        import threading
        self.real = real  # a file where the launcher wrapper writes the kernel's address
        self.server = socket.create_server((addr, 0))
        self.port = self.server.getsockname()[1]
        self.inject = threading.Event()
        self.injected = threading.Event()
        self.threads = [threading.Thread(target=self._serve, daemon=True)]
        self.threads[0].start()

    def _serve(self):
        import threading
        agent, _ = self.server.accept()
        with open(self.real) as f:
            host, port = f.read().split()
        kernel = socket.create_connection((host, int(port)))
        self.socks = (agent, kernel)
        for target in (self._to_agent, self._to_kernel):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self.threads.append(t)

    def _to_agent(self):
        agent, kernel = self.socks
        while data := _recv(kernel):
            agent.sendall(data)
        agent.close()

    def _to_kernel(self):
        import select
        import struct
        agent, kernel = self.socks
        buf, skip = b"", self.RESPONSE
        while True:
            if not buf and skip == 0 and self.inject.is_set() and not self.injected.is_set():
                # A header announcing 1 GiB (within what a link accepts), and junk for its MAC.
                kernel.sendall(struct.pack("<QQHHi", 1 << 30, 7, 3, 0, 0) + b"\x00" * 32)
                self.injected.set()
            try:
                if not select.select([agent], [], [], 0.05)[0]:
                    continue
            except (OSError, ValueError):
                break  # close() closed the socket: the test is over
            data = _recv(agent)
            if not data:
                break
            buf += data
            while True:  # forward whole frames (and the handshake) only
                if skip:
                    n = min(skip, len(buf))
                    kernel.sendall(buf[:n])
                    buf, skip = buf[n:], skip - n
                    if skip:
                        break
                if len(buf) < 24:
                    break
                length, nfds = struct.unpack_from("<Q", buf)[0], struct.unpack_from("<H", buf, 18)[0]
                skip = 24 + 8 * nfds + 32 + length + 16  # header MAC (HMAC), body's (AES-GCM tag)
        kernel.close()

    def close(self):
        self.server.close()
        for s in getattr(self, "socks", ()):
            s.close()


def _recv(s) -> bytes:
    try:
        return s.recv(1 << 16)
    except OSError:
        return b""


@needs_netns
def test_a_forged_header_on_a_live_link_drops_that_host_only_and_allocates_nothing(hosts, tmp_path):
    a, b = hosts.addr["A"], hosts.addr["B"]
    real = tmp_path / "kernel-address"
    tap = _Tap(hosts.me, str(real))
    # The launcher: ssh, with host A's ticket pointed at the tap (and the real address noted).
    wrapper = tmp_path / "launch.py"
    wrapper.write_text(textwrap.dedent(f"""\
        import os, subprocess, sys
        host, command = sys.argv[1], " ".join(sys.argv[2:])
        line = b""
        while not line.endswith(b"\\n") and (c := os.read(0, 1)):
            line += c
        ticket = line.decode().split()
        if host == {a!r}:
            with open({str(real)!r}, "w") as f:
                f.write(ticket[1] + " " + ticket[2])
            ticket[1], ticket[2] = {hosts.me!r}, {str(tap.port)!r}
        ssh = subprocess.Popen(["ssh", "-F", {hosts.dir + "/ssh_config"!r}, "-T", "-o", "BatchMode=yes", host,
                                "exec " + command], stdin=subprocess.PIPE)
        ssh.stdin.write((" ".join(ticket) + "\\n").encode())
        ssh.stdin.flush()
        # The rest of the agent's stdin as it comes (it stays open for a standing agent; its end
        # of file lets the host go).
        try:
            while data := os.read(0, 4096):
                ssh.stdin.write(data)
                ssh.stdin.flush()
            ssh.stdin.close()
        except BrokenPipeError:
            pass
        sys.exit(ssh.wait())
        """))
    g = ddip.Group(hosts=f"{a}:1,{b}:1", launcher=f"{sys.executable} {wrapper} {{host}} {{command}}",
                   backend=None, timeout=60)
    try:
        assert [r.value for r in g.run("1 + 1")] == [2, 2]
        _reset_peak_rss()
        start = _rss_kb("VmRSS")
        tap.inject.set()
        assert tap.injected.wait(30), "the tap never found a frame boundary to inject at"
        assert wait_until(lambda: g.status()[0]["state"] == "dead", 30), g.status()
        with pytest.raises(ddip.RankDeadError) as err:
            g.run("1 + 1", ranks=[0])
        assert "frame header failed authentication" in str(err.value), str(err.value)
        # The other host's link is untouched, and the kernel allocated nothing for the 1 GiB.
        assert [r.value for r in g.run("1 + 1", ranks=[1])] == [2]
        assert g.status()[1]["state"] == "idle"
        grew = (_rss_kb("VmHWM") - start) * 1024
        assert grew < 64 << 20, f"the notebook's peak RSS grew by {grew} bytes for a forged header"
    finally:
        g.close()
        tap.close()


@needs_netns
def test_an_unreachable_host_is_a_clear_start_error(hosts):
    nobody = f"{hosts.net}.99"  # in the subnet, but no host has it
    with pytest.raises(StartError) as err:
        ddip.Group(hosts=f"{hosts.addr['A']}:1,{nobody}:1", launcher=hosts.launcher, backend=None, timeout=60)
    text = str(err.value)
    assert nobody in text and "ssh" in text and "exit code 255" in text


# -- `ddip run --hosts`: the native launcher across hosts ------------------------------------------

DDIP = os.path.join(os.path.dirname(sys.executable), "ddip")

# Written for torchrun: joins gloo from env://, all_reduces RANK+1, reports what it was given.
RUN_ALL_REDUCE = """
import os, torch, torch.distributed as dist
if os.path.exists("/sys/class/net/ddip0"):
    os.environ["GLOO_SOCKET_IFNAME"] = "ddip0"  # the test hosts' network
dist.init_process_group("gloo")
t = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(t)
e = os.environ
print("rank", e["RANK"], "local", e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], "group", e["GROUP_RANK"],
      e["GROUP_WORLD_SIZE"], "world", e["WORLD_SIZE"], "master", e["MASTER_ADDR"], "sum", int(t.item()),
      "cwd", os.getcwd(), flush=True)
dist.destroy_process_group()
"""

# Every rank says where it is; rank 3 fails, the others wait to be stopped (or interrupted).
RUN_FAIL = """
import os, sys, time
rank = int(os.environ["RANK"])
try:  # a test may press Ctrl-C as soon as the pid line is out
    print("pid", os.getpid(), flush=True)
    if rank == int(os.environ.get("FAIL_RANK", "-1")):
        time.sleep(1)
        print("rank", rank, "is giving up", file=sys.stderr, flush=True)
        sys.exit(7)
    time.sleep(120)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
"""


def _ddip_run(args, script, tmp_path, **kw):
    path = tmp_path / "script.py"
    path.write_text(script)
    return subprocess.Popen([DDIP, "run", *args, "--", sys.executable, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=tmp_path, **kw)


def _finish(p, timeout=120):
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:
        p.kill()
        p.communicate()
        raise
    return p.returncode, out, err


def _rank_pids(out: str) -> list[int]:
    return [int(m) for m in re.findall(r"^\[\d+\] pid (\d+)$", out, re.M)]


@needs_netns
def test_ddip_run_spans_two_hosts_over_ssh(hosts, tmp_path):
    a, b = hosts.addr["A"], hosts.addr["B"]
    p = _ddip_run(["--hosts", f"{a}:2,{b}:2", "--launcher", hosts.launcher], RUN_ALL_REDUCE, tmp_path)
    code, out, err = _finish(p)
    assert code == 0, err
    lines = sorted(l for l in out.splitlines() if l.strip())
    # Numbered host by host; torchrun's meaning of every variable; rank 0's host is MASTER_ADDR;
    # each remote rank runs in the launching directory (it exists there: one filesystem here).
    assert lines == [f"[{r}] rank {r} local {r % 2} 2 group {r // 2} 2 world 4 master {a} sum 10 cwd {tmp_path}"
                     for r in range(4)], out + err


@needs_netns
def test_ddip_run_across_hosts_names_the_first_failure_and_stops_every_host(hosts, tmp_path):
    a, b = hosts.addr["A"], hosts.addr["B"]
    # --env reaches ranks on every host (they start with their host's own environment).
    p = _ddip_run(["--hosts", f"{a}:2,{b}:2", "--launcher", hosts.launcher, "--env", "FAIL_RANK=3"],
                  RUN_FAIL, tmp_path)
    code, out, err = _finish(p)
    pids = _rank_pids(out)
    assert len(pids) == 4, out + err
    assert code == 7, err
    assert f"ddip run: rank 3 (on {b}) failed first: exit code 7" in err
    assert "  | rank 3 is giving up" in err  # its stderr's last lines, from the other host
    for r, host in ((0, a), (1, a), (2, b)):
        assert f"rank {r} (on {host}): killed by SIGTERM (stopped by ddip run)" in err, err
    assert "giving up" not in out
    assert all(wait_until(lambda x=x: not alive(x), 10) for x in pids), "a rank outlived ddip run"


@needs_netns
def test_ddip_run_forwards_ctrl_c_to_ranks_on_every_host(hosts, tmp_path):
    a, b = hosts.addr["A"], hosts.addr["B"]
    # --raw: each rank's own "interrupted" line (alike, a host's would be shown once, "[1,2]")
    p = _ddip_run(["--hosts", f"{a}:1,{b}:2", "--launcher", hosts.launcher, "--raw"], RUN_FAIL, tmp_path)
    seen = []
    while len(seen) < 3:  # every rank has started: its pid line arrived
        line = p.stdout.readline()
        assert line, p.stderr.read()
        seen.append(line)
    p.send_signal(signal.SIGINT)
    code, out, err = _finish(p)
    out = "".join(seen) + out
    assert sorted(l for l in out.splitlines() if "interrupted" in l) == ["[0] interrupted", "[1] interrupted",
                                                                         "[2] interrupted"], out + err
    assert code == 3 and "(after ddip run forwarded SIGINT)" in err, err
    assert all(wait_until(lambda x=x: not alive(x), 10) for x in _rank_pids(out))


@needs_netns
def test_ddip_run_kill_of_the_launcher_leaves_no_rank_on_any_host(hosts, tmp_path):
    a, b = hosts.addr["A"], hosts.addr["B"]
    p = _ddip_run(["--hosts", f"{a}:1,{b}:1", "--launcher", hosts.launcher], RUN_FAIL, tmp_path)
    seen = [p.stdout.readline(), p.stdout.readline()]
    pids = _rank_pids("".join(seen))
    assert len(pids) == 2, seen
    p.kill()  # no chance to stop anything: each host's ddip run hears its channel close
    _finish(p)
    assert all(wait_until(lambda x=x: not alive(x), 15) for x in pids), "a rank outlived the launcher's SIGKILL"


@needs_netns
def test_ddip_run_a_host_that_drops_off_the_network_is_named_and_its_ranks_stop(hosts, tmp_path):
    # No FIN, no RST: nothing closes. ssh gives up after --link-timeout of silence (ServerAlive),
    # and the host's own ddip run, hearing no ping for as long, stops its ranks by itself.
    a, b = hosts.addr["A"], hosts.addr["B"]
    p = _ddip_run(["--hosts", f"{a}:1,{b}:1", "--launcher", hosts.launcher, "--link-timeout", "6"],
                  RUN_FAIL, tmp_path)
    try:
        seen = [p.stdout.readline(), p.stdout.readline()]
        pids = dict(re.findall(r"^\[(\d+)\] pid (\d+)$", "".join(seen), re.M))
        assert len(pids) == 2, seen
        hosts.set_link("B", False)
        code, out, err = _finish(p, 90)
        assert code == 255, err
        assert f"ddip run: host {b} failed first" in err, err
        assert f"rank 0 (on {a}): killed by SIGTERM (stopped by ddip run)" in err, err
        assert wait_until(lambda: not alive(int(pids["1"])), 20), "the cut-off host's rank kept running"
    finally:
        hosts.set_link("B", True)


@needs_netns
def test_ddip_run_names_a_host_it_cannot_reach(hosts, tmp_path):
    nobody = f"{hosts.net}.99"  # in the subnet, but no host has it
    p = _ddip_run(["--hosts", f"{hosts.addr['A']}:1,{nobody}:1", "--launcher", hosts.launcher], RUN_FAIL, tmp_path)
    code, out, err = _finish(p)
    assert code == 255, err
    assert (f"ddip run: host {nobody} failed first: its launcher (or ddip run there) ended with exit code 255"
            in err)
    assert "ssh" in err.split("failed first")[1]  # ssh's own words, from the launcher's stderr
    assert "stopped by ddip run" in err
    assert all(wait_until(lambda x=x: not alive(x), 10) for x in _rank_pids(out))


def test_ddip_run_with_this_machine_and_a_launcher_command_host(tmp_path):
    # Another "host" reached by a launcher command that runs its ddip run right here: two ranks of
    # this machine's own, one behind the launcher, in one gloo group over loopback.
    p = _ddip_run(["--hosts", "localhost:2,here:1", "--launcher", "exec {command} # {host}",
                   "--master-addr", "127.0.0.1"], RUN_ALL_REDUCE, tmp_path)
    code, out, err = _finish(p)
    assert code == 0, err
    assert sorted(l for l in out.splitlines() if l.strip()) == [
        f"[0] rank 0 local 0 2 group 0 2 world 3 master 127.0.0.1 sum 6 cwd {tmp_path}",
        f"[1] rank 1 local 1 2 group 0 2 world 3 master 127.0.0.1 sum 6 cwd {tmp_path}",
        f"[2] rank 2 local 0 1 group 1 2 world 3 master 127.0.0.1 sum 6 cwd {tmp_path}"], out + err


def test_ddip_run_gpus_per_host(tmp_path, fake_gpus):
    # --gpus 'HOST:LIST ...' gives each host's ranks their GPUs (the list, in order; rank i of the
    # host uses device i). Nothing touches CUDA here: the ranks only print their environment.
    # This machine has no GPU: nvidia-smi's stand-in lists three (CUDA_VISIBLE_DEVICES alone
    # can't add any: a GPU-less machine gets an error for --gpus, like a group).
    fake_gpus(3)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,2"}
    p = subprocess.run([DDIP, "run", "--gpus", "here:1,0 there:2", "--launcher", "exec {command} # {host}",
                        "--master-addr", "127.0.0.1", "--", "sh", "-c",
                        'echo "$RANK $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $CUDA_VISIBLE_DEVICES"'],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.splitlines()) == ["[0] 0 0 2 0 1,0", "[1] 1 1 2 0 1,0", "[2] 2 0 1 1 2"], p.stdout


RUN_ROOT = """
import os, sys, time
rank = int(os.environ["RANK"])
flag = os.path.join(os.environ["FLAG_DIR"], "remote-failed")
if rank == 1:  # on the "remote" host: fails first
    print("rank 1 ran out of memory", file=sys.stderr, flush=True)
    open(flag, "w").close()
    sys.exit(3)
while not os.path.exists(flag):  # this machine's rank: fails because its peer did
    time.sleep(0.01)
time.sleep(0.2)
print("rank 0 lost its peer", file=sys.stderr, flush=True)
sys.exit(4)
"""


def test_ddip_run_root_cause_is_the_earliest_failure_even_when_its_report_comes_late(tmp_path):
    # The remote host's stderr (which carries its reports) is delayed by 1 s, so this machine
    # sees its own rank fail first; the report, stamped with the remote failure's time, wins.
    late = "exec 3>&1; {command} 2>&1 >&3 3>&- | { sleep 1; cat >&2; } # {host}"
    p = _ddip_run(["--hosts", "localhost:1,here:1", "--launcher", late, "--master-addr", "127.0.0.1",
                   "--env", f"FLAG_DIR={tmp_path}"], RUN_ROOT, tmp_path, env=dict(os.environ, FLAG_DIR=str(tmp_path)))
    code, out, err = _finish(p, 60)
    assert "ddip run: rank 1 (on here) failed first: exit code 3" in err, err
    assert "  | rank 1 ran out of memory" in err
    assert "  rank 0: exit code 4" in err
    assert code == 3


def test_ddip_run_report_after_a_progress_bar_redraw_is_still_read(tmp_path):
    # A rank's stderr ending in '\r' (a bar redrawn in place) is followed by its host's report.
    script = """
import os, sys, time
if os.environ["RANK"] == "0":
    for i in range(5):
        sys.stderr.write(f"\\r{i * 25}%")
        sys.stderr.flush()
    time.sleep(60)
time.sleep(0.5)
sys.exit(5)
"""
    p = _ddip_run(["--hosts", "here:2", "--launcher", "exec {command} # {host}", "--master-addr", "127.0.0.1"],
                  script, tmp_path)
    code, out, err = _finish(p, 60)
    assert code == 5, err
    assert "ddip run: rank 1 (on here) failed first: exit code 5" in err, err
    assert "ddip failed" not in err and "\x1e" not in err


def test_ddip_run_a_host_without_a_control_channel_is_the_root_cause(tmp_path):
    # A launcher that gives the host's ddip run no stdin (docker exec without -i, say): that
    # ddip run stops its ranks at once and says why; the launch fails instead of hanging.
    p = _ddip_run(["--hosts", "localhost:1,here:1", "--launcher", "exec {command} </dev/null # {host}",
                   "--master-addr", "127.0.0.1"], RUN_FAIL, tmp_path)
    code, out, err = _finish(p, 60)
    assert code == 1, err
    assert "ddip run: host here failed first: its launcher (or ddip run there) ended with exit code 1" in err
    assert "ddip run on here: its launcher gives it no stdin" in err and "need -i" in err
    assert "rank 0: killed by SIGTERM (stopped by ddip run)" in err
    assert all(wait_until(lambda x=x: not alive(x), 10) for x in _rank_pids(out))


def test_ddip_run_hosts_bad_input_is_a_usage_error(tmp_path):
    for args, words in (
        (["--hosts", "node1"], "has no rank count"),
        (["--hosts", "node1:0"], "needs 1 to 1024 ranks"),
        (["--hosts", "a:1,a:2"], "listed twice"),
        (["--hosts", "a:1", "-n", "2"], "excludes"),
        (["--hosts", "a,b", "--gpus", "all"], "can't count the GPUs of other hosts"),
        (["--gpus", "a:0 a:1"], "name host a twice"),
        (["--hosts=-v:1"], "can't start with '-'"),
        (["--hosts", "-v:1"], "--hosts: needs a value"),  # argparse's rule, as torchrun's
        (["--hosts", "a[0,0]"], "lists a GPU twice"),
        (["--hosts", "a:1", "--launcher", "telnet"], "must be ssh, slurm or a launcher command with {host} and"),
        (["--hosts", "a:1", "--launcher", "ssh {host}"], "has no {command}: a launcher command needs both"),
        (["--launcher", "ssh", "-n", "2"], "requires --hosts"),
    ):
        p = _ddip_run(args, "print('never')", tmp_path)
        code, out, err = _finish(p, 30)
        assert code == 2 and words in err and "never" not in out, (args, err)


def test_bad_multihost_input_changes_nothing():
    for kwargs in (dict(hosts="node1:2", n=2), dict(launcher="ssh", n=2), dict(hosts="node1:2", bind="nope"),
                   dict(hosts="localhost:1,node2:1", launcher="mpirun", bind="127.0.0.1")):
        with pytest.raises(ValueError):
            ddip.Group(**kwargs)


def test_a_launcher_that_fails_names_the_host_and_its_output():
    with pytest.raises(StartError) as err:
        ddip.Group(hosts="localhost:1,far:1", launcher="echo 'no route to {host}' >&2; exit 3; {command}",
                   bind="127.0.0.1", backend=None)
    assert "far" in str(err.value) and "exit code 3" in str(err.value) and "no route to far" in str(err.value)


def test_local_and_launcher_command_hosts_run_one_group():
    # Another "host" reached by a launcher command that runs its agent right here, over loopback TCP.
    with ddip.Group(hosts="localhost:1,here:2", launcher="exec {command} # {host}", bind="127.0.0.1",
                    backend="gloo") as g:
        r = g.run(ALL_REDUCE)
        assert [x.value[0] for x in r] == [6, 6, 6]
        assert [x.value[2:4] for x in r] == [("0", "1"), ("0", "2"), ("1", "2")]
        import numpy as np
        big = np.arange(1 << 19, dtype=np.int64)  # 4 MiB: a shared-memory segment here, in band over TCP
        g.push(big=big)
        assert [r.value for r in g.run("int(big.sum())")] == [int(big.sum())] * 3
        back = g.run("big * 2", ranks=[2])[0].value  # a reply buffer: a memfd there, bytes on the link
        assert np.array_equal(back, big * 2)
        # Interrupts, timeouts and stack dumps reach the ranks behind the link.
        with pytest.raises(TimeoutError):
            g.run("import time\nwhile True: time.sleep(0.05)", timeout=2)
        pending = g.apply_async(lambda: __import__("time").sleep(30))
        time.sleep(0.5)
        assert "<lambda>" in g.stacks(ranks=[2])[2]
        pending.cancel()
        assert all(r.error is not None and r.error.ename == "KeyboardInterrupt" for r in pending.results())
        assert [r.value for r in g.run("1 + 1")] == [2, 2, 2]


def test_makedip_hosts_flags(tmp_path):
    # In a plain IPython shell, in a process of its own: the magics' flags for hosts.
    script = textwrap.dedent("""
        from IPython.core.interactiveshell import InteractiveShell
        from IPython.core.error import UsageError
        ip = InteractiveShell.instance()
        ip.run_line_magic("load_ext", "ddip")
        for bad in ("--hosts node1:2 -n 2", "--launcher ssh -n 2", "--hosts 'node1[0,0]'",
                    "--hosts node1,node2 -g all", "--hosts node1,node2 -g 'node1:0'", "-g 'node1:0,0'"):
            try:
                ip.run_line_magic("makedip", bad)
                print("accepted", bad)
            except UsageError as exc:
                print("usage error:", str(exc).splitlines()[0][:60])
        ip.run_line_magic("makedip", '--hosts localhost:1,here:1 --launcher "exec {command} # {host}" '
                                     '--bind 127.0.0.1 --backend none')
        ip.run_cell_magic("dip", "--see all", "import os; print(os.environ['DDIP_HOST'], os.environ['RANK'])")
        ip.run_line_magic("makedip", "-i")
        ip.run_line_magic("makedip", "-k")
        # -g per host: a host's ranks get its GPU list (nothing here touches CUDA: backend none).
        ip.run_line_magic("makedip", "-g 'here:1,0' --launcher 'exec {command} # {host}' --bind 127.0.0.1 "
                                     "--backend none")
        ip.run_cell_magic("dip", "--see all", "import os; print('gpu', os.environ['DDIP_HOST'], os.environ['LOCAL_RANK'], "
                                              "os.environ['CUDA_VISIBLE_DEVICES'])")
        ip.run_line_magic("makedip", "-k")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("usage error:") == 6, out.stdout
    assert "localhost 0" in out.stdout and "here 1" in out.stdout, out.stdout
    assert "here: cpu" in out.stdout, out.stdout
    assert "gpu here 0 1,0" in out.stdout and "gpu here 1 1,0" in out.stdout, out.stdout
