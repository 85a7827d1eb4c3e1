"""What the bench modules share (not a benchmark itself: run.py picks up bench_*.py only)."""

from __future__ import annotations

import os

import psutil

GRACE_S = 5.0


def kill_leftovers(before: set[int], grace: float = GRACE_S) -> int:
    """Kills, by pid, every descendant of this process not in `before` that is still there after
    `grace` seconds (psutil checks the pid still names the same process); returns the count."""
    me = psutil.Process()
    left = [p for p in me.children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(left, timeout=grace) if left else ([], [])
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if alive:
        psutil.wait_procs(alive, timeout=grace)
    return len(alive)


class Leftovers:
    """Processes still there `grace` s after their tool's own stop, killed by pid, per tool: every
    process in one of `hosts`' network namespaces (tests/netns_hosts.py) that was not there at the
    start (their sshd), and every new descendant of this process."""

    def __init__(self, hosts, grace: float = GRACE_S):
        self.hosts, self.grace = hosts, grace
        self.baseline = {p for name in hosts.ns for p in hosts.pids(name)}  # the hosts' sshd
        self.before = {p.pid for p in psutil.Process().children(recursive=True)}  # sshd, the template
        self.killed: dict[str, list[str]] = {}

    def sweep(self, tool: str):
        procs = {}
        for name in self.hosts.ns:
            for pid in self.hosts.pids(name):
                if pid not in self.baseline and pid != os.getpid():
                    try:
                        procs[pid] = psutil.Process(pid)
                    except psutil.NoSuchProcess:
                        pass
        for p in psutil.Process().children(recursive=True):
            if p.pid not in self.before:
                procs.setdefault(p.pid, p)
        _, alive = psutil.wait_procs(list(procs.values()), timeout=self.grace) if procs else ([], [])
        names = []
        for p in alive:
            try:
                names.append(" ".join(p.cmdline()[:3]) or p.name())
                p.kill()  # psutil checks the pid still names the same process (start time) first
            except psutil.NoSuchProcess:
                pass
        if alive:
            _, still = psutil.wait_procs(alive, timeout=self.grace)
            if still:
                raise RuntimeError(f"processes {[p.pid for p in still]} survived SIGKILL")
        self.killed.setdefault(tool, []).extend(names)

    def summary(self) -> str:
        """'ddip 0; ipyparallel 2 (names)' for the notes."""
        return "; ".join(f"{tool} {len(names)}" + (f" ({', '.join(sorted(set(names)))})" if names else "")
                         for tool, names in self.killed.items()) or "none"


def close_group(g, grace: float = GRACE_S):
    """Closes a ddip Group and waits for its ranks to be gone (a Leftovers sweep kills what is left)."""
    procs = []
    for pid in g.pids:
        if pid is not None:  # psutil.Process(None) would be this process
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
    g.close()
    psutil.wait_procs(procs, timeout=grace)


def ipp_ssh_cluster(engines: dict[str, int], ssh_config: str, controller_ip: str, profile_dir: str,
                    engine_timeout: int = 60):
    """An ipyparallel Cluster (not started) with ssh engines as its docs show: `engines` {host: n}
    for SSHEngineSetLauncher, reached with the ssh config `ssh_config` (-F), this venv's Python
    there, the controller listening on `controller_ip`, its engines given `engine_timeout` s to
    register (ipyparallel's default 60 is too short for 128 on 2 cores). scp gets -O: the netns hosts' sshd has no
    sftp subsystem, and -O is scp's own protocol."""
    import logging
    import sys

    import ipyparallel
    from traitlets.config import Config

    c = Config()
    c.SSHEngineSetLauncher.engines = dict(engines)
    c.SSHEngineSetLauncher.remote_python = sys.executable
    c.SSHEngineSetLauncher.ssh_args = ["-F", ssh_config]
    c.SSHEngineSetLauncher.scp_args = ["-O", "-F", ssh_config]
    return ipyparallel.Cluster(engines="ssh", n=sum(engines.values()), profile_dir=profile_dir,
                               controller_ip=controller_ip, log_level=logging.ERROR, config=c,
                               engine_timeout=engine_timeout)


# -- the report tables' cells ('—' where a tool gave no number) ------------------------------------


def secs(t) -> str:
    return "—" if t is None else f"{t:.3f} s"


def ms(t) -> str:
    return "—" if t is None else f"{t * 1e3:.2f} ms"


def mb(n) -> str:
    return "—" if n is None else f"{n / 1e6:.1f} MB"


def times(a, b) -> str:
    """a / b, as 'N.Nx'; '—' when either is missing."""
    if a is None or b is None or b == 0:
        return "—"
    r = a / b
    return f"{r:.0f}x" if r >= 20 else f"{r:.2f}x"


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"
