"""The Slurm launcher against a real single-node Slurm cluster started by this test: Debian's
munged, slurmctld and slurmd (22.05), each with a key, config, state, spool and logs of its own
in a temporary folder, on free loopback ports, and a munge socket of its own; the system's
/etc/munge and /etc/slurm are not used. Daemons run in the foreground (-D, -F) as children of
this test and are stopped by pid.

The node is named "127.0.0.2" (with NodeAddr=127.0.0.1): a name that resolves to this machine
over loopback without an /etc/hosts entry, but that ddip does not take for its own host, so its
ranks really are started through `srun` inside the allocation.

Needs root and the Debian packages slurmctld, slurmd, slurm-client and munge (`make setup`
installs them); skipped otherwise.
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

import pytest

import ddip

from conftest import alive, wait_until

NODE = "127.0.0.2"
DAEMONS = {"munged": "/usr/sbin/munged", "slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd"}
TOOLS = ("mungekey", "srun", "salloc", "sinfo", "squeue", "scancel")


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (to run munged, slurmctld and slurmd of its own)"
    for name, path in DAEMONS.items():
        if not os.access(path, os.X_OK):
            return f"needs {name} (make setup installs slurmctld, slurmd, slurm-client and munge)"
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return f"needs {tool} (make setup installs slurmctld, slurmd, slurm-client and munge)"
    return None


_why_not = _missing()
needs_slurm = pytest.mark.skipif(_why_not is not None, reason=_why_not or "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """munged + slurmctld + slurmd, one node (NODE) with 2 CPUs, partition "debug"."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="ddip-slurm-")
        self.procs: dict[str, subprocess.Popen] = {}
        self.job: str | None = None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def path(self, *parts) -> str:
        return os.path.join(self.dir, *parts)

    def _start(self):
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(self.path(sub), mode=0o700)
        os.chmod(self.dir, 0o755)
        os.chmod(self.path("munge"), 0o755)  # munged wants its socket's folder searchable by all
        key = self.path("munge", "munge.key")
        subprocess.run(["mungekey", "--create", "--keyfile", key], check=True, capture_output=True)
        os.chmod(key, 0o600)
        self.socket = self.path("munge", "munge.socket")
        conf = f"""\
ClusterName=ddiptest
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
StateSaveLocation={self.path("state")}
SlurmdSpoolDir={self.path("spool")}
SlurmctldPidFile={self.path("slurmctld.pid")}
SlurmdPidFile={self.path("slurmd.pid")}
SlurmctldLogFile={self.path("log", "slurmctld.log")}
SlurmdLogFile={self.path("log", "slurmd.log")}
SelectType=select/linear
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
NodeName={NODE} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""
        self.conf = self.path("slurm.conf")
        with open(self.conf, "w") as f:
            f.write(conf)
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            self.env.pop(name, None)

        self._daemon("munged", ["-F", "-f", "-S", self.socket, f"--key-file={key}",
                                f"--pid-file={self.path('munge', 'munged.pid')}",
                                f"--log-file={self.path('log', 'munged.log')}",
                                f"--seed-file={self.path('munge', 'munged.seed')}"])
        if not wait_until(lambda: os.path.exists(self.socket), 10):
            raise RuntimeError(f"munged did not start: {self.log('munged')}")
        self._daemon("slurmctld", ["-D", "-f", self.conf])
        self._daemon("slurmd", ["-D", "-f", self.conf, "-N", NODE])
        if not wait_until(lambda: self.sinfo() == "idle", 30):
            raise RuntimeError(f"the node never became idle (sinfo: {self.sinfo()!r}); "
                               f"{self.log('slurmctld')}\n{self.log('slurmd')}")

    def _daemon(self, name: str, args: list[str]):
        out = open(self.path("log", f"{name}.out"), "w")
        self.procs[name] = subprocess.Popen([DAEMONS[name], *args], stdout=out, stderr=subprocess.STDOUT,
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

    def slurm(self, *argv, timeout=30) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=timeout)

    def sinfo(self) -> str:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}: {self.log(name)}")
        out = self.slurm("sinfo", "-h", "-N", "-n", NODE, "-o", "%T")
        return out.stdout.strip() if out.returncode == 0 else ""

    def allocate(self) -> str:
        out = self.slurm("salloc", "-N1", "--no-shell", "--job-name=ddip-test", timeout=60)
        words = [w for w in (out.stdout + out.stderr).split() if w.isdigit()]
        if out.returncode != 0 or "Granted job allocation" not in out.stderr or not words:
            raise RuntimeError(f"salloc failed ({out.returncode}): {out.stderr.strip()}")
        self.job = words[-1]
        return self.job

    def steps(self) -> list[str]:
        out = self.slurm("squeue", "-h", "--steps", "-j", self.job, "-o", "%i %j")
        assert out.returncode == 0, out.stderr
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]

    def strays(self) -> list[str]:
        """Processes, other than the three daemons, started under this cluster's config: srun,
        slurmstepd, the agent and the ranks all inherit SLURM_CONF from the notebook or slurmd."""
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
        if self.job is not None and self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self.slurm("scancel", self.job)
        for name in ("slurmd", "slurmctld", "munged"):  # by pid, in reverse order of start
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.left = self.strays() if hasattr(self, "conf") else []
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    try:
        yield c
    finally:
        c.close()
    assert c.left == [], f"left running after the cluster stopped: {c.left}"


def _children() -> list[str]:
    """This process's children, zombies included (an unreaped srun would show here)."""
    out = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
        except OSError:
            continue
        state, ppid = tail.split()[:2]
        if int(ppid) == os.getpid():
            out.append(f"{pid} {head.split('(', 1)[1]} {state}")
    return out


ALL_REDUCE = """
import os, torch, torch.distributed as dist
t = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(t)
print("rank", os.environ["RANK"], "sum", int(t.item()), "step", os.environ.get("SLURM_STEP_ID"))
(int(t.item()), os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"],
 os.environ["LOCAL_WORLD_SIZE"], os.environ["MASTER_ADDR"], os.environ.get("SLURM_JOB_ID"), os.getpid())
"""


@needs_slurm
def test_a_group_started_by_srun_inside_an_allocation(cluster, monkeypatch):
    job = cluster.allocate()
    # The notebook runs "inside the allocation": what salloc's shell would have set.
    monkeypatch.setenv("SLURM_CONF", cluster.conf)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_JOB_NODELIST", NODE)
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "2")
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "2")
    assert ddip.hosts.slurm_hosts() == [NODE]

    before = _children()
    t0 = time.monotonic()
    g = ddip.Group(hosts={NODE: 2}, launcher="slurm", backend="gloo", bind="127.0.0.1", timeout=60)
    try:
        # The agent is a job step of our allocation, named by the launcher.
        steps = cluster.steps()
        assert len(steps) == 1 and steps[0].startswith(f"{job}.") and steps[0].endswith(" ddip"), steps
        seen = []
        results = g.run(ALL_REDUCE, on_output=lambda rank, stream, text: seen.append((rank, stream, text)))
        values = [r.value for r in results]
        assert [v[:6] for v in values] == [(3, "0", "0", "2", "2", NODE), (3, "1", "1", "2", "2", NODE)]
        # The ranks run under srun: inside the job, in the step's process tree.
        assert [v[6] for v in values] == [job, job]
        step_id = steps[0].split()[0].split(".")[1]
        assert sorted((r, t) for r, s, t in seen if s == "stdout") == [
            (0, f"rank 0 sum 3 step {step_id}\n"), (1, f"rank 1 sum 3 step {step_id}\n")]
        pids = [v[7] for v in values]
        assert [row["pid"] for row in g.status()] == pids and all(alive(p) for p in pids)
        assert [r.value for r in g.run("1 + 1")] == [2, 2]
        # What the check after close() looks for is there now: srun, slurmstepd, agent and ranks.
        running = " ".join(cluster.strays())
        assert all(what in running for what in ("srun", "slurmstepd", "ddip.remote", *map(str, pids))), running
    finally:
        g.close()
    # No rank outlives close(). The agent's job step stays for the kernel's next group (with the
    # node's warm rank template), and that group runs in the same step.
    assert all(wait_until(lambda p=p: not alive(p), 10) for p in pids), "a rank outlived close()"
    assert cluster.steps() == steps
    with ddip.Group(hosts={NODE: 2}, launcher="slurm", backend=None, bind="127.0.0.1", timeout=60) as g:
        assert [r.value for r in g.run("import os; os.environ['SLURM_STEP_ID']")] == [step_id, step_id]
        assert cluster.steps() == steps
    # Letting the host go ends the step; no job step outlives it; the allocation is still there.
    assert ddip.hosts.release() == 1
    assert wait_until(lambda: cluster.steps() == [], 15), f"a job step outlived release(): {cluster.steps()}"
    assert wait_until(lambda: cluster.strays() == [], 15), f"left running: {cluster.strays()}"
    assert wait_until(lambda: _children() == before, 10), f"children of the notebook left: {_children()}"
    out = cluster.slurm("squeue", "-h", "-j", job, "-o", "%T")
    assert out.stdout.strip() == "RUNNING", out
    assert time.monotonic() - t0 < 60


RUN_SCRIPT = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(t)
e = os.environ
print("rank", e["RANK"], "local", e["LOCAL_RANK"], "of", e["LOCAL_WORLD_SIZE"], "sum", int(t.item()),
      "job", e.get("SLURM_JOB_ID"), "step", e.get("SLURM_STEP_ID"), flush=True)
dist.destroy_process_group()
"""


@needs_slurm
def test_ddip_run_starts_a_hosts_ranks_through_srun(cluster, tmp_path):
    job = cluster.job or cluster.allocate()
    env = dict(os.environ, SLURM_CONF=cluster.conf, SLURM_JOB_ID=job, SLURM_JOB_NODELIST=NODE,
               SLURM_CPUS_ON_NODE="2", SLURM_JOB_CPUS_PER_NODE="2")
    script = tmp_path / "train.py"
    script.write_text(RUN_SCRIPT)
    ddip_cmd = os.path.join(os.path.dirname(sys.executable), "ddip")
    p = subprocess.run([ddip_cmd, "run", "--hosts", f"{NODE}:2", "--launcher", "slurm", "--",
                        sys.executable, str(script)], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = sorted(l for l in p.stdout.splitlines() if l.startswith("["))
    assert len(lines) == 2, p.stdout + p.stderr
    for r, line in enumerate(lines):
        # A job step of the allocation runs the host's ddip run, which starts its ranks.
        assert line.startswith(f"[{r}] rank {r} local {r} of 2 sum 3 job {job} step "), line
        assert not line.endswith("step None"), line
    assert wait_until(lambda: cluster.steps() == [], 15), f"a job step outlived ddip run: {cluster.steps()}"
    assert wait_until(lambda: cluster.strays() == [], 15), f"left running: {cluster.strays()}"
