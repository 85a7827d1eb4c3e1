"""The network-namespace hosts of tests/netns_hosts.py, which the multihost tests and
bench/bench_multihost.py stand on: their links count what crosses them host by host, pids() sees
what runs in a host, and the context manager removes everything. Needs root, iproute2 and openssh
(skipped otherwise)."""

from __future__ import annotations

import subprocess

import psutil
import pytest

from conftest import alive, wait_until
from netns_hosts import Hosts, missing

_why_not = missing()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=_why_not or "")

MB = 1_000_000


def _ssh(hosts, name, command, **kw):
    return subprocess.run(["ssh", "-F", hosts.ssh_config, hosts.addr[name], command], capture_output=True,
                          timeout=60, **kw)


def test_three_hosts_count_the_bytes_that_cross_each_link_and_are_removed_at_the_end():
    with Hosts(("A", "B", "C")) as h:
        assert [h.addr[n] for n in "ABC"] == [f"{h.net}.2", f"{h.net}.3", f"{h.net}.4"]
        names = [h.ns[n] for n in "ABC"] + [h.hub]
        before = h.link_counters()
        payload = bytes(range(256)) * (8 * MB // 256)
        out = _ssh(h, "B", "wc -c", input=payload)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [str(len(payload)).encode()]
        after = h.link_counters()
        got = {n: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in "ABC"}
        # B received the payload (plus ssh's framing and TCP/IP headers); A and C saw next to nothing.
        assert len(payload) <= got["B"][0] < 1.1 * len(payload), got
        assert got["B"][1] < 1 * MB, got
        for n in "AC":
            assert got[n][0] < 0.1 * MB and got[n][1] < 0.1 * MB, got

        # Back from C: counted as sent by C.
        before = h.link_counters()
        out = _ssh(h, "C", "head -c 3000000 /dev/zero")
        assert out.returncode == 0 and len(out.stdout) == 3 * MB, out.stderr
        after = h.link_counters()
        assert 3 * MB <= after["C"][1] - before["C"][1] < 3.3 * MB

        # pids(): what runs under a host's sshd is in that host's namespace, not in the others'.
        p = subprocess.Popen(["ssh", "-F", h.ssh_config, h.addr["A"], "exec sleep 60"], stdin=subprocess.DEVNULL)
        try:
            def sleeping(name):
                return [pid for pid in h.pids(name) if _cmd(pid)[:2] == ["sleep", "60"]]
            assert wait_until(lambda: sleeping("A"), 20), h.pids("A")
            assert not sleeping("B") and not sleeping("C")
            pid = sleeping("A")[0]
        finally:
            p.kill()
            p.wait()
        sshd = [q.pid for q in h.sshd]
    assert all(wait_until(lambda x=x: not alive(x), 10) for x in sshd), "an sshd outlived the hosts"
    # The remote sleep outlives its ssh client (nothing reads its stdin); close() ends it by pid.
    assert wait_until(lambda: not alive(pid), 10), "a process under a host's sshd outlived the hosts"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in listed.split()], listed


def test_bad_host_names_are_refused_before_anything_is_made():
    for bad in ([], ["A", "A"], ["A-B"], ["ABCDE"]):
        with pytest.raises(ValueError, match="host names must be"):
            Hosts(bad)


def _cmd(pid):
    try:
        return psutil.Process(pid).cmdline()
    except psutil.NoSuchProcess:
        return []
