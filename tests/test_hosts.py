"""ddip.hosts: host lists, GPUs per host, the rank layout and launcher command lines, as data
(Python's forms over the launch plan, cpp/ddip/plan.hpp, whose own rules cpp/tests/test_plan.cpp
tests). Groups that really span hosts: tests/test_multihost.py."""

from __future__ import annotations

import os
import re

import pytest

import ddip
from conftest import children_of
from ddip import hosts as H


def test_host_lists():
    hs = H.parse_hosts("node1:4,node2:2")
    assert [(h.name, h.ranks, h.gpus, h.local) for h in hs] == [("node1", 4, [], False), ("node2", 2, [], False)]
    hs = H.parse_hosts("node1[0,1] node2[3]")
    assert [(h.name, h.ranks, h.gpus) for h in hs] == [("node1", 2, ["0", "1"]), ("node2", 1, ["3"])]
    assert H.parse_hosts({"localhost": 2, "node2": [2, 3]})[0].local
    for bad in ("", "node1", "node1:0", "node1:2,node1:2", "node1[]", "node1[0,0]", "node1:x"):
        with pytest.raises(ValueError):
            H.parse_hosts(bad)


def test_gpus_for_every_host_or_per_host_as_data():
    # -g with --hosts: the same GPUs on each host listed by name, or each host's own.
    assert H.with_gpus("node1,node2", "0,1") == "node1[0,1] node2[0,1]"
    assert H.with_gpus("node1 node2", [2, 3]) == "node1[2,3] node2[2,3]"
    assert H.with_gpus("node1,node2", "node2:2,3 node1:0,1") == "node1[0,1] node2[2,3]"  # --hosts' order
    assert H.with_gpus(None, "node1:0,1 node2:GPU-ab12") == "node1[0,1] node2[GPU-ab12]"
    lay = H.layout(H.with_gpus("node1,node2", "node1:0,1 node2:3"), bind="10.0.0.1")
    assert [(lay.local_rank[s], lay.gpus(s)) for s in range(3)] == [(0, ["0", "1"]), (1, ["0", "1"]), (0, ["3"])]
    for hosts, gpus, words in (
        ("node1:2,node2", "0,1", "by name only"),
        ("node1,node2", "all", "can't count the GPUs of other hosts"),
        ("node1,node2", "node1:0", "give each host's GPUs once"),
        (None, "0,1", "need the hosts"),
        ("node1", "node1:0,0", "lists a GPU twice"),
        ({"node1": 1}, "0", "a dict says each host's GPUs itself"),
        ("node1", "node1:", "write HOST:GPUS"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            H.with_gpus(hosts, gpus)
    # Group(hosts=, gpus=) takes the same: checked before anything starts.
    with pytest.raises(ValueError, match="can't count the GPUs of other hosts"):
        ddip.Group(hosts="node1,node2", gpus="all")


def test_layout_numbers_ranks_host_by_host():
    lay = H.layout("localhost:2,node2[5,6]", launcher="ssh", bind="10.0.0.1")
    assert lay.slot_host == [0, 0, 1, 1] and lay.local_rank == [0, 1, 0, 1]
    assert lay.master_addr == "10.0.0.1"  # rank 0 here: the address the other hosts reach
    assert lay.launch_env(3) == dict(local_world_size=2, rank_offset=2, group_rank=1, group_world_size=2)
    assert lay.gpus(3) == ["5", "6"] and lay.gpus(0) is None and lay.remote(3) and not lay.remote(1)
    lay = H.layout("node1:1,node2:1", launcher="ssh", bind="10.0.0.1")
    assert lay.master_addr == "node1"
    assert 29500 <= lay.master_port() <= 30499  # rank 0 elsewhere: torchrun's customary range


def test_launcher_commands():
    py = "/venv/bin/python"
    assert H.launcher_argv("ssh", "n1", py) == ["ssh", "-T", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=10",
                                                 "-o", "ServerAliveCountMax=3", "n1",
                                                 "exec /venv/bin/python -m ddip.remote"]
    # The user's ssh options come first, so they win (ssh takes an option's first value), as in
    # ddip run: it is the same launch plan.
    assert H.launcher_argv("ssh -F cfg -o BatchMode=no", "n1", py)[1:5] == ["-F", "cfg", "-o", "BatchMode=no"]
    with pytest.raises(ValueError, match="can't start with '-'"):
        H.layout("-v:1")
    assert H.launcher_argv("docker exec -i {host} {command}", "c1", py) == [
        "/bin/sh", "-c", "docker exec -i c1 /venv/bin/python -m ddip.remote"]
    with pytest.raises(ValueError):
        H.launcher_argv("mpirun", "n1", py)
    with pytest.raises(ValueError):
        H.launcher_argv("ssh {host}", "n1", py)


def test_srun_command_as_data(monkeypatch):
    # The command as data; tests/test_slurm.py runs it on a real single-node Slurm.
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "32(x2),32")
    argv = H.launcher_argv("slurm --gres=gpu:4", "gpu07", "/venv/bin/python")
    assert argv == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=gpu07", "--overlap",
                    "--kill-on-bad-exit=1", "--job-name=ddip", "--cpus-per-task=32", "--gres=gpu:4",
                    "/venv/bin/python", "-m", "ddip.remote"]
    # Nodes with different CPU counts: no count (a small node would refuse the big one's).
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "32,8")
    assert not any(a.startswith("--cpus-per-task") for a in H.launcher_argv("slurm", "gpu07", "x"))
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        H.slurm_hosts(env={})


def test_ranch_with_another_host_first_says_to_list_this_machine_first():
    # The documented answer for a host list in the wrong order, whether or not the other host's
    # name resolves from here (.invalid never does, RFC 6761): nothing is asked of the network
    # before the list itself is checked, and nothing starts.
    other = "node2.invalid"
    before = children_of(os.getpid())
    env_before = dict(os.environ)
    with pytest.raises(ValueError) as ei:
        ddip.ranch(None, print, hosts=f"{other}:2")
    msg = str(ei.value)
    assert f"hosts= puts rank 0 on {other}: list this machine first" in msg, msg
    assert f"hosts='localhost:1,{other}:...'" in msg and "caller_rank=None" in msg, msg
    assert children_of(os.getpid()) == before and dict(os.environ) == env_before
    # Every rank a child: the list goes, and the name that does not resolve is what is wrong.
    with pytest.raises(ValueError, match=rf"can't resolve host {re.escape(other)} .*check the name, or give its address"):
        ddip.ranch(None, print, hosts=f"{other}:2", caller_rank=None)
    assert children_of(os.getpid()) == before
