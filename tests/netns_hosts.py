"""Hosts on one machine, for the tests and benchmarks of groups across hosts: each "host" is a Linux
network namespace with its own address and its own sshd (Debian's openssh-server), joined by veth
pairs to a bridge in a hub namespace, which the notebook's (root) namespace reaches through a veth
of its own. ssh uses a user key and a host key made for them, through an ssh config given with -F.
Names carry this process's pid, so several runs can coexist. Everything is removed by close() (by
pid, by name).

    with Hosts() as hosts:                   # hosts A and B; Hosts(("A", "B", "C")) for three
        g = ddip.Group(hosts={hosts.addr["A"]: 2, hosts.addr["B"]: 2}, launcher=hosts.launcher)

Needs root, iproute2, openssh-server and openssh-client (`make setup` installs them); missing()
says what is missing, or None.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time

import psutil

SSHD = "/usr/sbin/sshd"
LINK = "ddip0"  # the hosts' interface: the same name on every host, so GLOO_SOCKET_IFNAME fits them all


def missing() -> str | None:
    """Why hosts can't be made here (the reason to skip), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"needs {tool} (make setup installs iproute2 and openssh-client)"
    if not os.path.exists(SSHD):
        return "needs sshd (make setup installs openssh-server)"
    probe = f"ddipprobe{os.getpid() % 100000}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "can't create network namespaces here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_missing = missing  # the name tests/test_multihost.py has always used


def _free_subnet(first: int) -> str:
    """10.213.X for the notebook and its hosts: the first X from `first` on that no interface here
    has. Two test runs side by side whose pids match modulo 200 would otherwise share a subnet,
    each with the notebook's address on its own link, and see each other's listeners there."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    used = {int(x) for x in re.findall(r"\binet 10\.213\.(\d+)\.", out)}
    for k in range(200):
        x = 20 + (first - 20 + k) % 200
        if x not in used:
            return f"10.213.{x}"
    raise RuntimeError("every subnet 10.213.20-219.0/24 is in use here: remove the hosts of finished test runs")


def _run(*argv, ns=None):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + [str(a) for a in argv]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")
    return out.stdout


def _port_open(addr, port) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_until(predicate, timeout: float = 10.0) -> bool:
    """Polls `predicate` until it holds; False if it never did within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class Hosts:
    """Hosts (namespaces A and B by default) with sshd each; the notebook at .1 of the same subnet,
    host i at .(2 + i). A context manager too: `with Hosts() as h:` closes them at the end."""

    def __init__(self, names=("A", "B")):
        names = list(names)
        if not names or len(set(names)) != len(names) or not all(n.isalnum() and len(n) <= 4 for n in names):
            raise ValueError(f"host names must be distinct, alphanumeric, at most 4 characters: {names!r}")
        if len(names) > 200:
            raise ValueError(f"at most 200 hosts in one subnet, got {len(names)}")
        self.id = os.getpid() % 100000
        self.net = _free_subnet(20 + self.id % 200)
        self.ns = {name: f"ddip{name}{self.id}" for name in names}
        self.hub = f"ddipHub{self.id}"
        self.addr = {name: f"{self.net}.{2 + i}" for i, name in enumerate(names)}
        self.me = f"{self.net}.1"
        self.root_if = f"ddr{self.id}"
        self.sshd: list[subprocess.Popen] = []
        self.dir = tempfile.mkdtemp(prefix="ddip-hosts-")
        try:
            self._network()
            self._ssh()
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _network(self):
        _run("ip", "netns", "add", self.hub)
        _run("ip", "link", "add", "br0", "type", "bridge", ns=self.hub)
        _run("ip", "link", "set", "br0", "up", ns=self.hub)
        for name, ns in self.ns.items():
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "set", "lo", "up", ns=ns)
            outer, inner = f"ddh{name}{self.id}", f"ddn{name}{self.id}"
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", outer, "netns", self.hub)
            _run("ip", "link", "set", outer, "master", "br0", "up", ns=self.hub)
            _run("ip", "link", "set", inner, "netns", ns)
            # The same interface name on every host, so GLOO_SOCKET_IFNAME fits them all.
            _run("ip", "link", "set", inner, "name", LINK, ns=ns)
            _run("ip", "addr", "add", f"{self.addr[name]}/24", "dev", LINK, ns=ns)
            _run("ip", "link", "set", LINK, "up", ns=ns)
        peer = f"ddhR{self.id}"
        _run("ip", "link", "add", self.root_if, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", self.hub)
        _run("ip", "link", "set", peer, "master", "br0", "up", ns=self.hub)
        _run("ip", "addr", "add", f"{self.me}/24", "dev", self.root_if)
        _run("ip", "link", "set", self.root_if, "up")

    def _ssh(self):
        d = self.dir
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{d}/host_key")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{d}/user_key")
        shutil.copy(f"{d}/user_key.pub", f"{d}/authorized_keys")
        with open(f"{d}/host_key.pub") as f:
            host_pub = " ".join(f.read().split()[:2])
        with open(f"{d}/known_hosts", "w") as f:
            for a in self.addr.values():
                f.write(f"{a} {host_pub}\n")
        with open(f"{d}/ssh_config", "w") as f:
            f.write(textwrap.dedent(f"""\
                Host *
                  User root
                  IdentityFile {d}/user_key
                  IdentitiesOnly yes
                  UserKnownHostsFile {d}/known_hosts
                  StrictHostKeyChecking yes
                  ConnectTimeout 5
                """))
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        for name, ns in self.ns.items():
            self.sshd.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", "/dev/null",
                 "-o", f"ListenAddress={self.addr[name]}", "-o", f"HostKey={d}/host_key",
                 "-o", f"AuthorizedKeysFile={d}/authorized_keys", "-o", "StrictModes=no",
                 "-o", "UsePAM=no", "-o", "PidFile=none", "-o", "PermitRootLogin=prohibit-password"],
                stdout=subprocess.DEVNULL, stderr=open(f"{d}/sshd-{name}.log", "w")))
        for a in self.addr.values():
            assert wait_until(lambda: _port_open(a, 22), 10), f"sshd on {a} did not come up"

    @property
    def ssh_config(self) -> str:
        return f"{self.dir}/ssh_config"

    @property
    def launcher(self) -> str:
        return f"ssh -F {self.dir}/ssh_config"

    def set_link(self, name: str, up: bool):
        _run("ip", "link", "set", LINK, "up" if up else "down", ns=self.ns[name])

    def link_bytes(self, name: str) -> tuple[int, int]:
        """(received, sent) bytes so far on host `name`'s link, as its kernel counts them: every
        byte that crossed between that host and the others or the notebook (headers included)."""
        out = _run("ip", "-j", "-s", "-n", self.ns[name], "link", "show", "dev", LINK)
        stats = json.loads(out)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def link_counters(self) -> dict[str, tuple[int, int]]:
        """link_bytes() of every host."""
        return {name: self.link_bytes(name) for name in self.ns}

    def pids(self, name: str) -> list[int]:
        """Every process in host `name`'s network namespace (its sshd and what runs under it)."""
        out = subprocess.run(["ip", "netns", "pids", self.ns[name]], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def close(self):
        for p in self.sshd:
            p.terminate()
        for p in self.sshd:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        # A process left in a host (a remote command whose client is gone) would live on unseen
        # in a deleted namespace: ended here by pid, as psutil finds it (pid and start time).
        left = []
        for ns in self.ns.values():
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in out.stdout.split():
                try:
                    left.append(psutil.Process(int(pid)))
                    left[-1].kill()
                except psutil.NoSuchProcess:
                    pass
        psutil.wait_procs(left, timeout=5)
        for ns in [*self.ns.values(), self.hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.root_if], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)
