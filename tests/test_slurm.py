"""The Slurm launcher against a real single-node Slurm cluster started by this test
(tests/slurm_cluster.py's Cluster.on_loopback(): Debian's munged, slurmctld and slurmd, with a
key, config, state, spool and logs of their own in a temporary folder, on free loopback ports;
daemons stopped by pid). tests/test_slurm_nodes.py runs a cluster of several nodes.

The node is named "127.0.0.2" (with NodeAddr=127.0.0.1): a name that resolves to this machine
over loopback without an /etc/hosts entry, but that ddip does not take for its own host, so its
ranks really are started through `srun` inside the allocation.

Needs root and the Debian packages slurmctld, slurmd, slurm-client and munge (`make setup`
installs them); skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import ddip

from conftest import alive, wait_until
from slurm_cluster import LOOPBACK_NODE, Cluster, missing

NODE = LOOPBACK_NODE
_why_not = missing()
needs_slurm = pytest.mark.skipif(_why_not is not None, reason=_why_not or "")


@pytest.fixture(scope="module")
def cluster():
    c = Cluster.on_loopback()
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
