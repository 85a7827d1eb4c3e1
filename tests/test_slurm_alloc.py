"""Slurm nodes asked for from the notebook (issue 34, item 4): a real Jupyter kernel that is NOT
inside an allocation, as on a cluster's login node or in an Open OnDemand JupyterLab, runs
`%makedip --slurm "-N 2"` against a real 2-node Slurm cluster (tests/slurm_cluster.py's
Cluster.in_namespaces(): slurmctld here, one slurmd per network-namespace host).

The request is made to pend by a job that holds both nodes (Cluster.allocate), released from the
test once the notebook shows the wait with Slurm's reason. What is checked: the group spans the
granted job's nodes; the wait is one display updated in place; Ctrl-C while pending withdraws the
request and leaves the running group as it was; Slurm's refusal is named; `%makedip -k`, the
kernel's shutdown and the kernel's death each leave nothing in squeue.

Needs root, network namespaces and Debian's Slurm and munge; skipped otherwise.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
from pathlib import Path

import psutil
import pytest

from conftest import wait_until
from slurm_cluster import Cluster, SlurmKernel, missing

import ddip
from ddip.hosts.allocation import SlurmRequestError, ranks_per_node

_why_not = missing(netns=True)

NODES = 2
BIN = Path(sys.executable).parent
GROUP = "get_ipython().magics_manager.registry['DipMagics'].group"


@pytest.fixture(scope="module")
def cluster():
    if _why_not is not None:
        pytest.skip(_why_not)
    c = Cluster.in_namespaces(NODES)
    try:
        yield c
    finally:
        c.close()
    assert c.left == [], f"left running after the cluster stopped: {c.left}"


@pytest.fixture
def kernel(cluster, tmp_path):
    k = SlurmKernel.start(cluster, tmp_path)
    try:
        yield k
    finally:
        k.stop()
        for job in list(cluster.jobs):
            cluster.slurm("scancel", job)
    assert wait_until(lambda: cluster.queue() == [], 30), f"left in squeue: {cluster.queue()}"
    assert wait_until(lambda: cluster.strays() == [], 15), f"left running: {cluster.strays()}"


def slurm_processes(cluster) -> list[str]:
    """What the job ran or left, while the kernel (which has Slurm's config too) still runs."""
    return [p for p in cluster.strays() if any(w in p for w in ("salloc", "srun", "slurmstepd", "ddip.remote"))]


def texts(seen) -> list[str]:
    return [c["data"].get("text/plain", "") for k, c in seen if k in ("display_data", "update_display_data")]


def errors(seen) -> list[dict]:
    return [c for k, c in seen if k == "error"]


def hold_nodes(cluster) -> str:
    """Another job takes every node, so the notebook's request pends (reason: Resources)."""
    job = cluster.allocate(NODES)
    assert wait_until(lambda: f"{job} RUNNING" in cluster.queue(), 30), cluster.queue()
    return job


def when_pending(action):
    """on_message that runs `action` once, when the notebook shows the job pending for Resources."""
    done = threading.Event()

    def on_message(kind, content):
        if kind in ("display_data", "update_display_data") and not done.is_set():
            if "PENDING (Resources)" in content["data"].get("text/plain", ""):
                done.set()
                action()
    return on_message, done


WHERE = """
import os, socket, torch, torch.distributed as dist
_s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
_s.connect((os.environ["MASTER_ADDR"], 9))
_t = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(_t)
where = (int(os.environ["RANK"]), _s.getsockname()[0], os.environ.get("SLURM_JOB_ID"), int(_t.item()))
"""


def test_makedip_slurm_waits_for_the_nodes_then_spans_them_and_k_ends_the_job(cluster, kernel):
    holder = hold_nodes(cluster)
    on_message, released = when_pending(lambda: cluster.slurm("scancel", holder))
    reply, seen = kernel.cell('%makedip --slurm "-N 2 --ntasks-per-node 2" --backend gloo', on_message)
    assert reply["status"] == "ok", (errors(seen), cluster.queue())
    assert released.is_set(), texts(seen)
    # The wait: one display, redrawn in place, with the job's state and Slurm's reason.
    kinds = [k for k, _ in seen if k in ("display_data", "update_display_data")]
    assert kinds[0] == "display_data" and set(kinds[1:]) == {"update_display_data"}, kinds
    ids = {c["transient"]["display_id"] for k, c in seen if k in ("display_data", "update_display_data")}
    assert len(ids) == 1, ids
    job = kernel.value(f"{GROUP}.slurm_job")
    cluster.jobs.append(job)
    assert any(t.startswith(f"Slurm job {job} PENDING (Resources)") and "Ctrl-C cancels" in t
               for t in texts(seen)), texts(seen)
    assert texts(seen)[-1].startswith(f"Slurm job {job} granted"), texts(seen)

    nodes = cluster.hostnames(cluster.job_state(job)["NodeList"])
    assert sorted(nodes) == sorted(cluster.nodes), nodes
    out = "".join(c.get("text", "") for k, c in seen if k == "stream")
    assert f"4 rank(s) on Slurm job {job} ({','.join(nodes)}) ready" in out, out
    # The job is the notebook's own, not the kernel's (which runs in none): one ddip step per node.
    assert cluster.queue() == [f"{job} RUNNING"]
    assert sorted(s.split()[1] for s in cluster.steps(job, "%i %N")) == sorted(nodes)
    assert kernel.run("%%dip\n" + WHERE).ok
    where = kernel.value(f"[r.value for r in {GROUP}.run('where')]")
    # --ntasks-per-node 2: ranks 0, 1 on the first node, 2, 3 on the second; all in one all_reduce.
    assert [tuple(w) for w in where] == [(r, nodes[r // 2], job, 10) for r in range(4)], where

    # -r starts fresh ranks in the same job; -k ends it.
    pids = kernel.value(f"{GROUP}.pids")
    cell = kernel.run("%makedip -r")
    assert cell.ok and f"restarting the group in Slurm job {job}" in cell.stream(), cell.outputs
    assert kernel.value(f"{GROUP}.pids") != pids and kernel.value(f"{GROUP}.slurm_job") == job
    assert cluster.queue() == [f"{job} RUNNING"]
    assert kernel.value(f"""[r.value for r in {GROUP}.run("import os; os.environ['SLURM_JOB_ID']")]""") == [job] * 4
    info = kernel.run("%makedip -i").stream()
    assert f"group: --slurm '-N 2 --ntasks-per-node 2' --backend gloo" in info and f"Slurm job: {job}" in info, info
    cell = kernel.run("%makedip -k")
    assert cell.ok and f"Slurm job {job} ended" in cell.stream(), cell.outputs
    assert wait_until(lambda: cluster.queue() == [], 30), f"left in squeue: {cluster.queue()}"
    assert wait_until(lambda: slurm_processes(cluster) == [], 15), f"left running: {slurm_processes(cluster)}"


def test_ctrl_c_while_pending_cancels_the_request_and_changes_nothing_else(cluster, kernel):
    cell = kernel.run("%makedip -n 1 --backend none")
    assert cell.ok, cell.outputs
    pids = kernel.value(f"{GROUP}.pids")
    cell = kernel.run('%makedip -r --slurm "-N 2" -n 2')
    assert cell.reply["status"] == "error" and "--slurm asks Slurm for the nodes" in cell.reply["evalue"] \
        and "leave out -n, -g, --hosts" in cell.reply["evalue"], cell.reply
    holder = hold_nodes(cluster)
    on_message, interrupted = when_pending(kernel.km.interrupt_kernel)
    reply, seen = kernel.cell('%makedip -r --slurm "-N 2"', on_message)
    assert interrupted.is_set(), texts(seen)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
    assert "the request for Slurm nodes (salloc -N 2) was cancelled; nothing else changed" in reply["evalue"]
    # Only the holder's job is left; the notebook's request is gone from Slurm.
    assert wait_until(lambda: cluster.queue() == [f"{holder} RUNNING"], 15), cluster.queue()
    # The group that ran before runs on, as it was.
    assert kernel.value(f"{GROUP}.pids") == pids
    assert kernel.value(f"[r.value for r in {GROUP}.run('6 * 7')]") == [42]
    assert cluster.slurm("scancel", holder).returncode == 0
    assert kernel.run("%makedip -k").ok


@pytest.mark.parametrize("options, says", [
    ("--gpus-per-node 8", "Invalid generic resource (gres) specification"),
    ("--bogus-option", "unrecognized option '--bogus-option'"),
])
def test_options_slurm_refuses_are_named_and_change_nothing(cluster, kernel, options, says):
    reply, seen = kernel.cell(f'%makedip --slurm "{options}"')
    assert reply["status"] == "error" and reply["ename"] == "SlurmRequestError", reply
    assert f"Slurm refused salloc {options}" in reply["evalue"] and says in reply["evalue"], reply["evalue"]
    assert "nothing was allocated" in reply["evalue"]
    assert kernel.value(f"{GROUP} is None") is True
    assert cluster.queue() == []


def test_the_kernels_shutdown_ends_the_job(cluster, kernel):
    assert kernel.run('%makedip --slurm "-N 2" --backend none').ok
    job = kernel.value(f"{GROUP}.slurm_job")
    cluster.jobs.append(job)
    assert cluster.queue() == [f"{job} RUNNING"]
    kernel.stop()  # the notebook's "Shut Down Kernel": the kernel exits
    assert wait_until(lambda: cluster.queue() == [], 30), f"left in squeue: {cluster.queue()}"


@pytest.mark.parametrize("when", ["granted", "pending"])
def test_the_kernels_death_ends_the_job(cluster, kernel, when):
    """SIGKILL: no atexit, no close(). Granted, salloc's command sees its stdin pipe close;
    pending, salloc gets SIGHUP (PR_SET_PDEATHSIG) and withdraws the request."""
    holder = hold_nodes(cluster) if when == "pending" else None
    if holder is None:
        assert kernel.run('%makedip --slurm "-N 2" --backend none').ok
        job = kernel.value(f"{GROUP}.slurm_job")
        cluster.jobs.append(job)
        assert cluster.queue() == [f"{job} RUNNING"]
    else:
        # The kernel dies while its request pends: the cell never finishes.
        kernel.kc.execute('%makedip --slurm "-N 2" --backend none')
        shown = []
        while not any("PENDING (Resources)" in t for t in shown):
            msg = kernel.kc.get_iopub_msg(timeout=60)
            if msg["msg_type"] in ("display_data", "update_display_data"):
                shown.append(msg["content"]["data"].get("text/plain", ""))
    pid = kernel.km.provisioner.pid
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10)
    if holder is not None:
        assert wait_until(lambda: cluster.queue() == [f"{holder} RUNNING"], 15), cluster.queue()
        assert cluster.slurm("scancel", holder).returncode == 0
    assert wait_until(lambda: cluster.queue() == [], 30), f"left in squeue: {cluster.queue()}"


def test_the_ranks_per_node_come_from_the_jobs_options():
    # salloc's environment for the job: what the options asked for decides.
    assert ranks_per_node({"SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "2(x2)"}) == ([1, 1], 0)
    assert ranks_per_node({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4",
                           "SLURM_TASKS_PER_NODE": "4(x2)"}) == ([4, 4], 0)
    assert ranks_per_node({"SLURM_JOB_NUM_NODES": "3", "SLURM_NTASKS": "5",
                           "SLURM_TASKS_PER_NODE": "2(x2),1"}) == ([2, 2, 1], 0)
    assert ranks_per_node({"SLURM_JOB_NUM_NODES": "4", "SLURM_GPUS_PER_NODE": "8"}) == ([8] * 4, 8)
    assert ranks_per_node({"SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_PER_NODE": "a100:4"}) == ([4, 4], 4)
    with pytest.raises(ValueError, match="9 tasks on a node with 8 GPUs"):
        ranks_per_node({"SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_PER_NODE": "8", "SLURM_NTASKS_PER_NODE": "9",
                        "SLURM_TASKS_PER_NODE": "9"})


def test_bad_slurm_arguments_are_refused_before_slurm_is_asked(tmp_path, monkeypatch):
    for kwargs, says in [(dict(slurm="-N 2", n=2), "leave out n="),
                         (dict(slurm="-N 2", hosts={"a": 1}), "leave out n=, gpus=, hosts="),
                         (dict(slurm=""), "salloc's options as one string"),
                         (dict(slurm="-J 'x"), "unclosed quote"),
                         (dict(slurm="-N 2 --no-shell"), "--no-shell is not for a job ddip holds"),
                         (dict(slurm=["-N", "2"]), "salloc's options as a string"),
                         (dict(slurm="-N 2", timeout=-1), "timeout")]:
        with pytest.raises(ValueError, match=says):
            ddip.Group(**kwargs)
    monkeypatch.setenv("PATH", str(tmp_path))  # no salloc here
    with pytest.raises(SlurmRequestError, match="needs Slurm's salloc on PATH"):
        ddip.Group(slurm="-N 1")


class Terminal(io.StringIO):
    """sys.stderr of a script in a terminal; `on_write(text)` sees each write."""

    def __init__(self, on_write):
        super().__init__()
        self.on_write = on_write

    def write(self, text):
        self.on_write(text)
        return super().write(text)


def test_group_slurm_asks_for_the_nodes_and_close_gives_them_back(cluster, monkeypatch):
    """The API, from a script on the login node (no kernel): Group(slurm=...), its wait on one
    line of the terminal redrawn with a carriage return."""
    for name, value in cluster.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ddip0")
    monkeypatch.setenv("PATH", f"{BIN}:{os.environ['PATH']}")
    holder = hold_nodes(cluster)
    released = []

    def on_write(text):
        if "PENDING (Resources)" in text and not released:
            released.append(cluster.slurm("scancel", holder).returncode)
    terminal = Terminal(on_write)
    monkeypatch.setattr(sys, "stderr", terminal)
    g = ddip.Group(slurm="-N 2 -t 10", backend=None, timeout=60)
    try:
        assert released == [0], terminal.getvalue()
        shown = terminal.getvalue()
        assert shown.startswith("\r") and shown.endswith("\n") and shown.count("\n") == 1, repr(shown)
        assert f"\rSlurm job {g.slurm_job} PENDING (Resources)" in shown, repr(shown)
        assert shown.rsplit("\r", 1)[1].startswith(f"Slurm job {g.slurm_job} granted after"), repr(shown)
        job = g.slurm_job
        cluster.jobs.append(job)
        assert cluster.queue() == [f"{job} RUNNING"]
        assert cluster.job_state(job)["TimeLimit"] == "00:10:00"
        nodes = cluster.hostnames(cluster.job_state(job)["NodeList"])
        code = "import os; (os.environ['SLURMD_NODENAME'], os.environ['SLURM_JOB_ID'], os.environ['WORLD_SIZE'])"
        assert [r.value for r in g.run(code)] == [(n, job, "2") for n in nodes]
        g.restart()  # fresh ranks, the same job
        assert g.slurm_job == job and cluster.queue() == [f"{job} RUNNING"]
        assert [r.value for r in g.run(code)] == [(n, job, "2") for n in nodes]
    finally:
        g.close()
    assert wait_until(lambda: cluster.queue() == [], 30), f"left in squeue: {cluster.queue()}"
    assert ddip.hosts.release() == 0  # the job's end ended the nodes' standing agents too
    assert wait_until(lambda: cluster.strays() == [], 15), f"left running: {cluster.strays()}"
