"""A Slurm node lost mid-cell, on a cluster of 2 nodes of its own (tests/slurm_cluster.py's
Cluster.in_namespaces(), as in test_slurm_nodes.py; a module of its own, so that its cluster never
runs beside that one's in this process): the node's slurmd, slurmstepd, agent and rank are killed
by pid at once. Needs root, network namespaces and Debian's Slurm and munge; skipped otherwise.
"""

from __future__ import annotations

import pytest

import ddip

from conftest import wait_until
from slurm_cluster import Cluster, missing

_why_not = missing(netns=True)
pytestmark = pytest.mark.skipif(_why_not is not None, reason=_why_not or "")


@pytest.fixture
def cluster():
    """A cluster of 2 nodes of this test's own: it loses one."""
    c = Cluster.in_namespaces(2)
    try:
        yield c
    finally:
        c.close()
    assert c.left == [], f"left running after the cluster stopped: {c.left}"


def test_a_node_lost_mid_cell_is_named_and_the_others_go_on(cluster, monkeypatch):
    job = cluster.allocate(2)
    nodelist = cluster.job_state(job)["NodeList"]
    # The notebook runs inside the allocation: what salloc's shell would have set.
    for name, value in cluster.job_env(SLURM_JOB_ID=job, SLURM_JOB_NODELIST=nodelist).items():
        monkeypatch.setenv(name, value)
    nodes = ddip.hosts.slurm_hosts()
    assert len(nodes) == 2, nodes
    lost = nodes[1]
    g = ddip.Group(hosts={h: 1 for h in nodes}, launcher="slurm", backend=None, timeout=60)
    killed = []

    def on_output(rank, stream, text):
        # Rank 1 is mid-cell: its node dies, slurmd and all.
        if rank == 1 and "sleeping" in text and not killed:
            killed.extend(cluster.lose(lost))

    try:
        steps = dict(s.split() for s in cluster.steps(job, "%i %N"))
        assert sorted(steps.values()) == nodes, steps
        with pytest.raises(ddip.RemoteError) as err:
            g.run("import time; print('sleeping', flush=True); time.sleep(120)", on_output=on_output)
        assert any("ddip.remote" in cmd for cmd in killed) and any("slurmd" in cmd for cmd in killed), killed
        root = err.value.failures[0]
        assert root.rank == 1 and root.ename == "RankDied", err.value.headline
        assert f"lost the link to its host {lost}" in root.evalue, root.evalue
        assert str(err.value).startswith(f"code failed on ranks 0,1; root cause on rank 1: RankDied: lost the "
                                         f"link to its host {lost}"), str(err.value)
        # Rank 0's cell was stopped because of it; then rank 0 goes on, rank 1 stays dead.
        assert [f.rank for f in err.value.failures] == [1, 0], str(err.value)
        assert wait_until(lambda: [row["state"] for row in g.status()] == ["idle", "dead"], 30), g.status()
        assert [r.value for r in g.run("1 + 1", ranks=[0])] == [2]
    finally:
        g.close()
    assert ddip.hosts.release() == 2
    # The live node's step ends; the lost node's stays in Slurm's books until Slurm itself
    # learns the node is gone (SlurmdTimeout), or the node comes back and the job is cancelled.
    assert wait_until(lambda: [s for s in cluster.steps(job, "%i %N") if not s.endswith(f" {lost}")] == [], 15), \
        cluster.steps(job, "%i %N")
    assert wait_until(lambda: cluster.strays() == [], 15), f"left running: {cluster.strays()}"
    # A node that comes back (rebooted) lets the allocation end; then nothing is left in Slurm.
    cluster.restart(lost)
    assert cluster.slurm("scancel", job).returncode == 0
    assert wait_until(lambda: cluster.queue() == [], 30), f"left in squeue: {cluster.queue()}"
