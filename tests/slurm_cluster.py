"""A real Slurm cluster for the tests, started by them: Debian's munged, slurmctld and one slurmd
per node (22.05), with a key, config, state, spool and logs of its own in a temporary folder, on
free ports, and a munge socket of its own; the system's /etc/munge and /etc/slurm are not used.
Daemons run in the foreground (-D, -F) as children of the test and are stopped by pid.

Two shapes:

- `Cluster.on_loopback()`: one node named "127.0.0.2" (NodeAddr 127.0.0.1), a name that resolves
  to this machine over loopback without an /etc/hosts entry, but that ddip does not take for its
  own host, so its ranks really are started through `srun`.
- `Cluster.in_namespaces(n)`: n nodes, each a network namespace (tests/netns_hosts.py's network,
  without sshd) running its own slurmd, entered with `nsenter --net=` (`ip netns exec` would
  remount /sys without the cgroup tree slurmd reads). A node is named by its namespace's address
  (so MASTER_ADDR and srun's --nodelist resolve without /etc/hosts); slurmctld runs in the root
  namespace at the hosts' subnet's .1, which every namespace reaches through its veth. Several
  slurmd run on one machine with `-N node` and a spool, pid file and log per node (%n); the munge
  socket is a file, shared by all.

Needs root and the Debian packages slurmctld, slurmd, slurm-client and munge (`make setup`
installs them), and network namespaces for the second shape; `missing()` says what is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import json
from pathlib import Path

import psutil
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

import netns_hosts
from conftest import alive, wait_until
from test_magics import Kernel

DAEMONS = {"munged": "/usr/sbin/munged", "slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd"}
TOOLS = ("mungekey", "srun", "salloc", "sbatch", "sinfo", "squeue", "scancel", "scontrol")
LOOPBACK_NODE = "127.0.0.2"


def missing(netns: bool = False) -> str | None:
    """Why a cluster can't be started here (the reason to skip), or None."""
    if os.geteuid() != 0:
        return "needs root (to run munged, slurmctld and slurmd of its own)"
    for name, path in DAEMONS.items():
        if not os.access(path, os.X_OK):
            return f"needs {name} (make setup installs slurmctld, slurmd, slurm-client and munge)"
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return f"needs {tool} (make setup installs slurmctld, slurmd, slurm-client and munge)"
    if netns and shutil.which("nsenter") is None:
        return "needs nsenter (util-linux)"
    return netns_hosts.missing() if netns else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Network(netns_hosts.Hosts):
    """netns_hosts' namespaces and links, without its sshd: the nodes are reached by Slurm."""

    def _ssh(self):
        pass


class Cluster:
    """munged + slurmctld + one slurmd per node, partition "debug" with every node in it."""

    @classmethod
    def on_loopback(cls, cpus: int = 2) -> "Cluster":
        return cls({LOOPBACK_NODE: "127.0.0.1"}, ctld_addr="127.0.0.1", cpus=cpus)

    @classmethod
    def in_namespaces(cls, n: int, cpus: int = 2) -> "Cluster":
        net = _Network(tuple(f"N{i}" for i in range(n)))
        try:
            return cls({a: a for a in net.addr.values()}, ctld_addr=net.me, cpus=cpus, network=net)
        except BaseException:
            net.close()
            raise

    def __init__(self, nodes: dict[str, str], ctld_addr: str, cpus: int, network=None):
        self.nodes = nodes  # name -> NodeAddr
        self.ctld_addr = ctld_addr
        self.cpus = cpus
        self.network = network
        # The namespace each node's slurmd runs in (None: this one).
        self.netns = {}
        if network is not None:
            self.netns = {network.addr[h]: f"/run/netns/{ns}" for h, ns in network.ns.items()}
        self.dir = tempfile.mkdtemp(prefix="ddip-slurm-")
        self.procs: dict[str, subprocess.Popen] = {}
        self.jobs: list[str] = []
        self.left: list[str] = []
        self.lost: set[str] = set()  # daemons of nodes lose() killed
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def path(self, *parts) -> str:
        return os.path.join(self.dir, *parts)

    @property
    def job(self) -> str | None:
        """The allocation allocate() took last."""
        return self.jobs[-1] if self.jobs else None

    def _start(self):
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(self.path(sub), mode=0o700)
        os.chmod(self.dir, 0o755)
        os.chmod(self.path("munge"), 0o755)  # munged wants its socket's folder searchable by all
        key = self.path("munge", "munge.key")
        subprocess.run(["mungekey", "--create", "--keyfile", key], check=True, capture_output=True)
        os.chmod(key, 0o600)
        self.socket = self.path("munge", "munge.socket")
        names = ",".join(self.nodes)
        node_lines = "".join(f"NodeName={name} NodeAddr={addr} CPUs={self.cpus} State=UNKNOWN\n"
                             for name, addr in self.nodes.items())
        conf = f"""\
ClusterName=ddiptest
SlurmctldHost=localhost({self.ctld_addr})
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
StateSaveLocation={self.path("state")}
SlurmdSpoolDir={self.path("spool", "%n")}
SlurmctldPidFile={self.path("slurmctld.pid")}
SlurmdPidFile={self.path("slurmd-%n.pid")}
SlurmctldLogFile={self.path("log", "slurmctld.log")}
SlurmdLogFile={self.path("log", "slurmd-%n.log")}
SelectType=select/linear
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
{node_lines}PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""
        self.conf = self.path("slurm.conf")
        with open(self.conf, "w") as f:
            f.write(conf)
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        for name in list(self.env):
            if name.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")) and name != "SLURM_CONF":
                del self.env[name]

        self._daemon("munged", DAEMONS["munged"],
                     ["-F", "-f", "-S", self.socket, f"--key-file={key}",
                      f"--pid-file={self.path('munge', 'munged.pid')}",
                      f"--log-file={self.path('log', 'munged.log')}",
                      f"--seed-file={self.path('munge', 'munged.seed')}"])
        if not wait_until(lambda: os.path.exists(self.socket), 10):
            raise RuntimeError(f"munged did not start: {self.log('munged')}")
        self._daemon("slurmctld", DAEMONS["slurmctld"], ["-D", "-f", self.conf])
        for node in self.nodes:
            os.makedirs(self.path("spool", node), mode=0o700)
            self._slurmd(node)
        if not wait_until(lambda: self.states() == {n: "idle" for n in self.nodes}, 60):
            raise RuntimeError(f"the nodes never became idle (sinfo: {self.states()!r}); "
                               + "\n".join(self.log(name) for name in self.procs))

    def job_env(self, **extra) -> dict:
        """What a user's shell on the login node passes to salloc/sbatch: this environment's
        programs first on PATH (ddip, python, torchrun), and gloo on the hosts' link (named alike
        on every node)."""
        path = f"{os.path.dirname(sys.executable)}:{self.env.get('PATH', '')}"
        return {**self.env, "PATH": path, "GLOO_SOCKET_IFNAME": netns_hosts.LINK, **extra}

    def _slurmd(self, node: str):
        argv = [DAEMONS["slurmd"], "-D", "-f", self.conf, "-N", node]
        if node in self.netns:
            argv = ["nsenter", f"--net={self.netns[node]}", *argv]  # nsenter execs slurmd: same pid
        self._daemon(f"slurmd-{node}", argv[0], argv[1:])

    def lose(self, node: str) -> list[str]:
        """The node dies: every process in its namespace (its slurmd, slurmstepd, what they
        started) is killed by pid at once. Returns their command lines. restart() brings it back."""
        out = subprocess.run(["ip", "netns", "pids", os.path.basename(self.netns[node])],
                             capture_output=True, text=True, check=True)
        killed, cmds = [], []
        for pid in map(int, out.stdout.split()):
            try:
                p = psutil.Process(pid)
                cmds.append(" ".join(p.cmdline()))
                p.kill()
                killed.append(p)
            except psutil.NoSuchProcess:
                pass
        self.lost.add(f"slurmd-{node}")
        self.procs[f"slurmd-{node}"].wait(10)
        psutil.wait_procs(killed, timeout=10)
        return cmds

    def restart(self, node: str):
        """The lost node's slurmd starts again (a rebooted node)."""
        self.lost.discard(f"slurmd-{node}")
        self._slurmd(node)

    def _daemon(self, name: str, program: str, args: list[str]):
        out = open(self.path("log", f"{name}.out"), "w")
        self.procs[name] = subprocess.Popen([program, *args], stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        out.close()

    def log(self, name: str) -> str:
        text = ""
        for suffix in (".out", ".log"):
            try:
                with open(self.path("log", name + suffix)) as f:
                    text += f.read()
            except OSError:
                pass
        return f"--- {name} ---\n{text[-3000:]}"

    def slurm(self, *argv, timeout=30, env=None) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, env={**self.env, **(env or {})},
                              timeout=timeout)

    def check_daemons(self):
        for name, p in self.procs.items():
            if name in self.lost:
                continue
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}: {self.log(name)}")

    def states(self) -> dict[str, str]:
        """Each node's state as sinfo says it (idle, allocated, down*, ...)."""
        self.check_daemons()
        out = self.slurm("sinfo", "-h", "-N", "-o", "%N %T")
        if out.returncode != 0:
            return {}
        return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)

    def sinfo(self) -> str:
        """The state of the only node (the loopback cluster's)."""
        return self.states().get(next(iter(self.nodes)), "")

    def allocate(self, nodes: int = 1) -> str:
        """salloc -N nodes --no-shell: the job id (cancelled at close())."""
        out = self.slurm("salloc", f"-N{nodes}", "--no-shell", "--job-name=ddip-test", timeout=60)
        words = [w for w in (out.stdout + out.stderr).split() if w.isdigit()]
        if out.returncode != 0 or "Granted job allocation" not in out.stderr or not words:
            raise RuntimeError(f"salloc failed ({out.returncode}): {out.stderr.strip()}")
        self.jobs.append(words[-1])
        return self.jobs[-1]

    def finished(self, job: str, timeout: float) -> dict[str, str]:
        """Waits until `job` has left squeue, then its record (scontrol show job: JobState,
        ExitCode, NodeList, ...). Polled here, 5 times a second: `sbatch --wait` looks only
        every few seconds, up to 10, after the job ended."""
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job)).get("JobState") in ("PENDING", "RUNNING", "COMPLETING"):
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} still {state.get('JobState')} after {timeout} s")
            time.sleep(0.2)
        return state

    def hostnames(self, nodelist: str) -> list[str]:
        """scontrol show hostnames: a node list ('10.0.0.[2-3]') as names."""
        out = self.slurm("scontrol", "show", "hostnames", nodelist)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    def job_state(self, job: str) -> dict[str, str]:
        """scontrol show job's fields of `job` ({} once slurmctld forgot it)."""
        out = self.slurm("scontrol", "show", "job", "-o", job)
        fields = (w.split("=", 1) for w in out.stdout.split() if "=" in w)
        return dict(f for f in fields if len(f) == 2) if out.returncode == 0 else {}

    def steps(self, job: str | None = None, fmt: str = "%i %j") -> list[str]:
        """The job's steps as 'JOBID.STEP NAME' (squeue --steps; fmt: squeue's -o)."""
        out = self.slurm("squeue", "-h", "--steps", "-j", job or self.job, "-o", fmt)
        assert out.returncode == 0, out.stderr
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]

    def queue(self) -> list[str]:
        """Every job in the cluster as 'JOBID STATE' (squeue)."""
        out = self.slurm("squeue", "-h", "-o", "%i %T")
        assert out.returncode == 0, out.stderr
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]

    def all_steps(self) -> list[str]:
        """Every job step in the cluster (squeue --steps)."""
        out = self.slurm("squeue", "-h", "--steps", "-o", "%i %j")
        assert out.returncode == 0, out.stderr
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]

    def strays(self) -> list[str]:
        """Processes, other than the daemons, started under this cluster's config: salloc, srun,
        slurmstepd, the agents and the ranks all inherit SLURM_CONF from the test or a slurmd."""
        mark = f"SLURM_CONF={self.conf}".encode()
        daemons = {p.pid for p in self.procs.values()}
        ctld = self.procs["slurmctld"].pid if "slurmctld" in self.procs else None
        found = []
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            if pid in daemons or pid == os.getpid() or not alive(pid):
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == ctld:
                        continue  # slurmctld's own helper, slurmscriptd
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if mark not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{pid}: {cmd}")
            except OSError:
                pass
        return found

    def close(self):
        ctld = self.procs.get("slurmctld")
        if self.jobs and ctld is not None and ctld.poll() is None:
            self.slurm("scancel", *self.jobs)
        # By pid, in reverse order of start: the slurmds, slurmctld, munged.
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.left = self.strays() if hasattr(self, "conf") else []
        if self.network is not None:
            self.network.close()  # what a namespace still holds is ended by pid; then it is deleted
        shutil.rmtree(self.dir, ignore_errors=True)


class SlurmKernel(Kernel):
    """A real ipykernel beside a Cluster, with ddip's magics loaded: on the "login node" (Slurm's
    config and programs, no allocation: a notebook that asks Slurm for nodes itself), or, with
    salloc=N, as `salloc -N N`'s command (a notebook started inside an allocation, with salloc's
    whole environment)."""

    @classmethod
    def start(cls, cluster: Cluster, root: Path, salloc: int | None = None) -> "SlurmKernel":
        name = "ddip-login" if salloc is None else "ddip-salloc"
        spec = root / "kernels" / name
        spec.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        if salloc is None:
            bin_dir = os.path.dirname(sys.executable)
            env = {**cluster.env, "PATH": f"{bin_dir}:{cluster.env.get('PATH', '')}", "GLOO_SOCKET_IFNAME": "ddip0"}
            assert not any(k.startswith("SLURM_JOB") for k in env)
        else:
            argv = ["salloc", f"-N{salloc}", "--job-name=ddip-notebook", *argv]
            env = cluster.job_env()
        (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": name, "language": "python"}))
        km = KernelManager(kernel_name=name, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(root / "kernels")]))
        km.start_kernel(cwd=str(root), env=env)
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=90)
        except BaseException:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
            raise
        k = cls(km, kc)
        assert k.run("import os, ddip\n%load_ext ddip").ok
        return k

    def value(self, expr: str):
        """`expr`'s value in the kernel, through JSON."""
        cell = self.run(f"import json; print(json.dumps({expr}))")
        assert cell.ok, cell.outputs
        return json.loads(cell.stream().strip().splitlines()[-1])

    def cell(self, code: str, on_message=None, timeout: float = 180) -> tuple[dict, list]:
        """Runs `code`; (the execute reply, every iopub message as (kind, content)) with
        on_message(kind, content) called as each arrives."""
        seen = []

        def collect(kind, content):
            seen.append((kind, content))
            if on_message is not None:
                on_message(kind, content)
        return self.execute(code, timeout, collect, seen), seen

    def stop(self):
        """Shuts the kernel down as a notebook does (inside salloc, salloc then ends and gives
        the nodes back)."""
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=False)
