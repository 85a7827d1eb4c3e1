"""ddip on a real Slurm cluster of several nodes (tests/slurm_cluster.py's
Cluster.in_namespaces(): slurmctld here, one slurmd per network-namespace host, each node named by
its namespace's address). What a user on a cluster does:

- a Jupyter kernel started inside `salloc -N 4` (the kernel is salloc's command, so it has
  salloc's whole environment) makes `%makedip --launcher slurm` across the allocation's nodes;
- an `sbatch` job runs one `ddip run` per node with `srun`, joined through a c10d rendezvous, as
  torchrun job files do (issue 32);
- (test_slurm_node_lost.py: a node lost mid-cell is named.)

All traffic stays on loopback and the namespaces the cluster made; the cluster's daemons are
stopped by pid and its namespaces deleted at the end, and nothing started under its config may
outlive it. Needs root, network namespaces and Debian's Slurm and munge; skipped otherwise.
"""

from __future__ import annotations

import os
import re

import pytest

import ddip

from conftest import wait_until
from slurm_cluster import Cluster, SlurmKernel, missing

_why_not = missing(netns=True)
pytestmark = pytest.mark.skipif(_why_not is not None, reason=_why_not or "")

NODES = 4


@pytest.fixture(scope="module")
def cluster():
    c = Cluster.in_namespaces(NODES)
    try:
        yield c
    finally:
        c.close()
    assert c.left == [], f"left running after the cluster stopped: {c.left}"


# Where a rank runs: the node's address (the source address toward the first node), the node
# Slurm says it is on, its network namespace, and a gloo all_reduce of the ranks across nodes.
WHERE = """
import json, os, socket, torch, torch.distributed as dist
_s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
_s.connect((os.environ["MASTER_ADDR"], 9))
_t = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(_t)
where = (int(os.environ["RANK"]), _s.getsockname()[0], os.environ.get("SLURMD_NODENAME"),
         os.environ.get("SLURM_JOB_ID"), os.readlink("/proc/self/ns/net"), int(_t.item()))
"""


def test_a_kernel_inside_salloc_makes_a_group_across_the_allocations_nodes(cluster, tmp_path):
    nodes = sorted(cluster.nodes)
    k = SlurmKernel.start(cluster, tmp_path, salloc=NODES)
    try:
        job = k.value("os.environ['SLURM_JOB_ID']")
        cluster.jobs.append(job)  # cancelled at close() should the kernel not give it back
        assert k.value("ddip.hosts.slurm_hosts()") == nodes
        cell = k.run('hosts = ",".join(f"{h}:1" for h in ddip.hosts.slurm_hosts())\n'
                     "%makedip --hosts $hosts --launcher slurm --backend gloo", timeout=180)
        assert cell.ok, cell.outputs
        # One job step per node, each named ddip, all in the kernel's allocation.
        steps = cluster.steps(job)
        assert len(steps) == NODES and all(s.startswith(f"{job}.") and s.endswith(" ddip") for s in steps), steps
        cell = k.run("%%dip\n" + WHERE)
        assert cell.ok, cell.outputs
        where = k.value("[r.value for r in get_ipython().magics_manager.registry['DipMagics'].group.run('where')]")
        total = NODES * (NODES + 1) // 2
        assert [(w[0], w[1], w[2], w[3], w[5]) for w in where] == [
            (r, node, node, job, total) for r, node in enumerate(nodes)], where
        # Each rank in its node's own network namespace.
        assert len({w[4] for w in where}) == NODES, where
        assert {w[4] for w in where} != {os.readlink("/proc/self/ns/net")}

        assert k.run("%makedip -k").ok
        assert k.value("ddip.hosts.release()") == NODES
        assert wait_until(lambda: cluster.steps(job) == [], 15), f"job steps left: {cluster.steps(job)}"
    finally:
        k.stop()
    # The kernel's end ends salloc, which gives the allocation back.
    assert wait_until(lambda: cluster.queue() == [], 30), f"left in squeue: {cluster.queue()}"
    assert wait_until(lambda: cluster.strays() == [], 15), f"left running: {cluster.strays()}"


TRAIN = """
import os, socket, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank()) + 1])
dist.all_reduce(t)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((os.environ["MASTER_ADDR"], 9))
e = os.environ
print("rank", e["RANK"], "of", e["WORLD_SIZE"], "local", e["LOCAL_RANK"], "node", e["GROUP_RANK"],
      "at", s.getsockname()[0], "sum", int(t.item()), "job", e.get("SLURM_JOB_ID"), flush=True)
dist.destroy_process_group()
"""

# A job file as torchrun's users write it, with `torchrun` replaced by `ddip run`.
SBATCH = """\
#!/bin/bash
#SBATCH --job-name=ddip-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output={out}
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun ddip run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint $head:29500 \\
    --rdzv-id $SLURM_JOB_ID python train.py
"""


def test_an_sbatch_job_runs_one_ddip_run_per_node_joined_by_c10d(cluster, tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    out = tmp_path / "job.out"
    (tmp_path / "job.sh").write_text(SBATCH.format(out=out))
    p = cluster.slurm("sbatch", "--parsable", f"--chdir={tmp_path}", str(tmp_path / "job.sh"), env=cluster.job_env())
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip().split(";")[0]
    cluster.jobs.append(job)
    state = cluster.finished(job, 240)
    text = out.read_text() if out.exists() else ""
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), f"{state}\n{text}"
    # Each rank's line, labelled with its global rank by its node's ddip run.
    lines = [m.groups() for m in re.finditer(r"(?m)^\[(\d)\] rank (\d) (.*)$", text)]
    nodes = cluster.hostnames(state["NodeList"])
    assert len(nodes) == 2, state
    # Every rank of the 4 joined one gloo all_reduce: 1 + 2 + 3 + 4; node ranks 0 and 1 each ran
    # two local ranks at its own address.
    assert len(lines) == 4, text
    assert all(label == rank for label, rank, _ in lines), text
    ranks = {int(rank): dict(zip(rest.split()[::2], rest.split()[1::2])) for _, rank, rest in lines}
    assert sorted(ranks) == [0, 1, 2, 3], text
    assert all(r["of"] == "4" and r["sum"] == "10" and r["job"] == job for r in ranks.values()), text
    at = {r["node"]: set() for r in ranks.values()}
    for r in ranks.values():
        at[r["node"]].add((r["at"], r["local"]))
    assert sorted(at) == ["0", "1"], text
    assert sorted(a for a, _ in at["0"] | at["1"]) == sorted(nodes * 2), text
    assert all(len({a for a, _ in v}) == 1 and {l for _, l in v} == {"0", "1"} for v in at.values()), text
    assert wait_until(lambda: cluster.queue() == [], 30), f"left in squeue: {cluster.queue()}"
    assert wait_until(lambda: cluster.strays() == [], 15), f"left running: {cluster.strays()}"
