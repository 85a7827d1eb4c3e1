"""One `ddip run` per node forming one job, as one torchrun per node does (srun, a Kubeflow pod, a
master and a worker started by hand): each "node" here is a separate `ddip run` process on this
machine, started the way a cluster starts them: statically (--nnodes --node-rank --master-addr
--master-port), through a c10d rendezvous (node ranks given on arrival), from Kubeflow's PET_*
variables, and elastically (--nnodes MIN:MAX). Real ranks, real gloo collectives across the nodes.

Every process a test starts is waited for and, if the test fails midway, killed by pid; ranks die
with their node's ddip run (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import wait_until

from conftest import DDIP  # noqa: E402
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
PY = sys.executable
HOST = socket.gethostname()

# Every rank says where it is, joins one gloo all_reduce across every node, and says the sum.
ALL_REDUCE = """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(os.environ["RANK"])])
    dist.all_reduce(t)
    print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"],
          "group", os.environ["GROUP_RANK"], "of", os.environ["GROUP_WORLD_SIZE"],
          "local", os.environ["LOCAL_RANK"], "of", os.environ["LOCAL_WORLD_SIZE"],
          "sum", int(t.item()), "restart", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
    dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(tmp_path, body: str, name="rank.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.fixture
def nodes():
    """start(args, env=None) -> Popen of one node's `ddip run ARGS`; what still runs at the end is
    killed by pid."""
    started = []

    def start(args, env=None):
        full = {k: v for k, v in os.environ.items()
                if not k.startswith(("PET_", "TORCHELASTIC_", "DDIP_RUN_KEY"))}
        full.update(env or {})
        p = subprocess.Popen([DDIP, "run", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=full)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate()


def finish(*procs, timeout=60):
    """[(exit code, stdout, stderr)] of each, in order."""
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *o) for p, o in zip(procs, outs)]


def said(out: str) -> list[str]:
    """The ranks' lines, without their labels, sorted."""
    return sorted(re.sub(r"^\[\d+\] ", "", line) for line in out.splitlines() if "rank " in line)


def static(port, nnodes, rank, *rest):
    return ["--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", "127.0.0.1",
            "--master-port", str(port), *rest]


def test_two_static_nodes_are_one_job_each_showing_its_own_ranks(nodes, tmp_path):
    port, rank_py = free_port(), script(tmp_path, ALL_REDUCE)
    n0 = nodes(static(port, 2, 0, "-n", "2", PY, rank_py))
    n1 = nodes(static(port, 2, 1, "-n", "2", PY, rank_py))
    (c0, out0, err0), (c1, out1, err1) = finish(n0, n1)
    assert (c0, c1) == (0, 0), err0 + err1
    # Each node shows its own ranks, labelled with their global rank.
    assert said(out0) == [f"rank {r} of 4 group 0 of 2 local {r} of 2 sum 6 restart 0"
                          for r in (0, 1)], out0
    assert said(out1) == [f"rank {r} of 4 group 1 of 2 local {r - 2} of 2 sum 6 restart 0"
                          for r in (2, 3)], out1
    assert re.findall(r"^\[(\d)\]", out1, re.M) and set(re.findall(r"^\[(\d)\]", out1, re.M)) == {"2", "3"}


def test_three_nodes_meet_through_a_c10d_rendezvous_and_get_node_ranks_on_arrival(nodes, tmp_path):
    port, rank_py = free_port(), script(tmp_path, ALL_REDUCE)
    args = ["--nnodes", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "job7", "-n", "1"]
    procs = [nodes([*args, "--log-dir", str(tmp_path / f"logs{i}"), PY, rank_py]) for i in range(3)]
    results = finish(*procs)
    assert [r[0] for r in results] == [0, 0, 0], "".join(r[2] for r in results)
    lines = sorted(line for r in results for line in said(r[1]))
    # One node per group rank, one rank each, and one sum over all three.
    assert lines == [f"rank {r} of 3 group {r} of 3 local 0 of 1 sum 3 restart 0" for r in range(3)]
    # Each node keeps its own ranks' logs in torchrun's layout, under the job's run id.
    logged = []
    for i, r in enumerate(results):
        (job_dir,) = (tmp_path / f"logs{i}").iterdir()
        assert re.fullmatch(r"job7_\w{8}", job_dir.name), job_dir.name
        logged.append((job_dir / "attempt_0" / "0" / "stdout.log").read_text().strip())
        assert said(r[1]) == [logged[-1]]
    assert sorted(logged) == lines
    # The one that bound the endpoint's port first hosts the job.
    assert sum("node 0 of job 'job7'" in r[2] for r in results) == 1


def test_kubeflows_pet_variables_alone_form_the_job(nodes, tmp_path):
    port, rank_py = free_port(), script(tmp_path, ALL_REDUCE)

    def pet(rank):
        # As Kubeflow's trainer sets them in every pod, for torchrun.
        return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(rank),
                "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}

    n1 = nodes([PY, rank_py], env=pet(1))
    n0 = nodes([PY, rank_py], env=pet(0))
    (c0, out0, err0), (c1, out1, err1) = finish(n0, n1)
    assert (c0, c1) == (0, 0), err0 + err1
    assert said(out0) == ["rank 0 of 2 group 0 of 2 local 0 of 1 sum 1 restart 0"]
    assert said(out1) == ["rank 1 of 2 group 1 of 2 local 0 of 1 sum 1 restart 0"]


def test_an_elastic_job_starts_with_the_minimum_after_the_last_call(nodes, tmp_path):
    port, rank_py = free_port(), script(tmp_path, ALL_REDUCE)
    args = ["--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-conf", "last_call_timeout=1", "-n", "1", PY, rank_py]
    results = finish(nodes(args), nodes(args))
    assert [r[0] for r in results] == [0, 0], "".join(r[2] for r in results)
    lines = sorted(line for r in results for line in said(r[1]))
    assert lines == [f"rank {r} of 2 group {r} of 2 local 0 of 1 sum 1 restart 0" for r in range(2)]


def established_to(port: int) -> int:
    """Connections from this machine to `port` (a node's link to the job's host, or one waiting in
    its listener's backlog)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[2].split(":")[1], 16) == port and f[3] == "01":
                n += 1
    return n


def test_a_restart_admits_the_node_that_came_later(nodes, tmp_path):
    port = free_port()
    go = tmp_path / "go"
    rank_py = script(tmp_path, textwrap.dedent(f"""
        import os, pathlib, time
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            # The first attempt fails once the late node waits at the door.
            while not pathlib.Path({str(go)!r}).exists():
                time.sleep(0.05)
            raise SystemExit(3)
    """) + textwrap.dedent(ALL_REDUCE))
    args = ["--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-conf", "last_call_timeout=1", "--max-restarts", "1", "-n", "1", PY, rank_py]
    first = [nodes(args), nodes(args)]
    wait_until(lambda: established_to(port) == 1, timeout=30)  # the second node's link
    late = nodes(args)
    wait_until(lambda: established_to(port) == 2, timeout=30)
    go.write_text("")
    results = finish(*first, late)
    assert [r[0] for r in results] == [0, 0, 0], "".join(r[2] for r in results)
    lines = sorted(line for r in results for line in said(r[1]))
    assert lines == [f"rank {r} of 3 group {r} of 3 local 0 of 1 sum 3 restart 1" for r in range(3)]


FAILS_ON_NODE_1 = """
    import os, sys, time, torch.distributed as dist
    dist.init_process_group("gloo")
    if os.environ["RANK"] == "2":
        raise ValueError("bad batch on rank 2")
    dist.barrier()  # the others wait here for rank 2, which never comes
"""


def test_a_failure_on_node_1_stops_every_node_and_every_node_names_it(nodes, tmp_path):
    port, rank_py = free_port(), script(tmp_path, FAILS_ON_NODE_1)
    n0 = nodes(static(port, 2, 0, "-n", "2", PY, rank_py))
    n1 = nodes(static(port, 2, 1, "-n", "2", PY, rank_py))
    (c0, _, err0), (c1, _, err1) = finish(n0, n1)
    assert (c0, c1) == (1, 1), err0 + err1
    for err in (err0, err1):
        assert f"ddip run: rank 2 (on node 1, {HOST}) failed first: exit code 1" in err, err
        assert "ValueError: bad batch on rank 2" in err
        assert "ddip run: exit code 1" in err
    # Node 0 accounts for every rank; node 1 for its own.
    assert "rank 0: killed by SIGTERM (stopped by ddip run)" in err0
    assert "rank 3: killed by SIGTERM (stopped by ddip run)" in err1


HANGS = """
    import os, time, torch.distributed as dist
    dist.init_process_group("gloo")
    print("in", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("at", [0, 1])
def test_ctrl_c_at_any_node_stops_every_node(nodes, tmp_path, at):
    port, rank_py = free_port(), script(tmp_path, HANGS)
    procs = [nodes(static(port, 2, k, "-n", "1", PY, rank_py)) for k in (0, 1)]
    # Both ranks are in (init_process_group has returned on both sides).
    for p in procs:
        assert p.stdout.readline().strip() == f"[{procs.index(p)}] in"
    procs[at].send_signal(signal.SIGINT)
    results = finish(*procs)
    assert [r[0] for r in results] == [130, 130], "".join(r[2] for r in results)
    # Every node says so (a rank that ends by its KeyboardInterrupt is named with it).
    assert "forwarded SIGINT" in results[0][2], results[0][2]
    assert "forwarded SIGINT" in results[1][2], results[1][2]


def test_a_timeout_given_to_one_node_stops_every_node(nodes, tmp_path):
    port, rank_py = free_port(), script(tmp_path, HANGS)
    n0 = nodes(static(port, 2, 0, "-n", "1", PY, rank_py))
    n1 = nodes(static(port, 2, 1, "--timeout", "2", "-n", "1", PY, rank_py))
    (c0, _, err0), (c1, _, err1) = finish(n0, n1)
    assert (c0, c1) == (124, 124), err0 + err1
    assert "timed out after 2 s" in err0 and "timed out after 2 s" in err1


def test_a_node_that_vanishes_is_named(nodes, tmp_path):
    port, rank_py = free_port(), script(tmp_path, HANGS)
    n0 = nodes(static(port, 2, 0, "-n", "1", PY, rank_py))
    n1 = nodes(static(port, 2, 1, "-n", "1", PY, rank_py))
    assert n0.stdout.readline().strip() == "[0] in"
    assert n1.stdout.readline().strip() == "[1] in"
    n1.kill()
    (c0, _, err0), _ = finish(n0, n1)
    assert c0 == 1, err0
    assert f"ddip run: node 1, {HOST} failed first: its ddip run vanished" in err0, err0


def test_with_a_shared_key_a_node_without_it_cannot_join(nodes, tmp_path):
    port, rank_py = free_port(), script(tmp_path, ALL_REDUCE)
    key = {"DDIP_RUN_KEY": "a key both nodes share, 32 chars"}
    conf = ["--rdzv-conf", "join_timeout=3"]
    n0 = nodes(static(port, 2, 0, *conf, "-n", "1", PY, rank_py), env=key)
    stranger = nodes(static(port, 2, 1, *conf, "-n", "1", PY, rank_py))
    (c1, _, err1), = finish(stranger)
    assert c1 == 1
    assert "wants the job's shared key: give it with --key-file or DDIP_RUN_KEY" in err1
    friend = nodes(static(port, 2, 1, *conf, "-n", "1", PY, rank_py), env=key)
    (c0, out0, err0), (c2, out2, err2) = finish(n0, friend)
    assert (c0, c2) == (0, 0), err0 + err2
    assert said(out2) == ["rank 1 of 2 group 1 of 2 local 0 of 1 sum 1 restart 0"]


FAILS_FIRST_TIME = """
    import os, pathlib, sys, time
    rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    print("rank", rank, "restart", restart, "of", os.environ["TORCHELASTIC_MAX_RESTARTS"],
          flush=True)
    said = pathlib.Path(__file__).with_name(f"said-{rank}-{restart}")
    said.write_text("")
    if restart == "0" and rank == "1":
        # Once rank 0 has said it (else it could be stopped before), the first attempt fails.
        while not said.with_name("said-0-0").exists():
            time.sleep(0.01)
        sys.exit(3)
"""


def restarts_seen(out: str) -> list[str]:
    return sorted(set(re.findall(r"rank \d+ restart \d+ of \d+", out)))


def test_max_restarts_on_one_node_as_torchrun(nodes, tmp_path):
    rank_py = script(tmp_path, FAILS_FIRST_TIME)
    mine = nodes(["-n", "2", "--max-restarts", "2", PY, rank_py])
    (code, out, err), = finish(mine)
    theirs = subprocess.run([TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "2",
                             "--tee", "3", rank_py], capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if not k.startswith("PET_")})
    assert code == theirs.returncode == 0, err + theirs.stderr
    # The same attempts, seen from the ranks: the first fails, the second (restart 1) succeeds.
    # (torchrun's --tee copies a rank's log as it grows, and may miss a stopped rank's last
    # lines: from it, the attempt that succeeded.)
    assert restarts_seen(out) == [
        "rank 0 restart 0 of 2", "rank 0 restart 1 of 2", "rank 1 restart 0 of 2",
        "rank 1 restart 1 of 2"]
    assert {"rank 0 restart 1 of 2", "rank 1 restart 1 of 2"} <= set(restarts_seen(theirs.stdout))
    assert "rank 1 failed; restarting every rank (restart 1 of 2" in err


def test_restarts_run_out_with_torchruns_exit_code(nodes, tmp_path):
    rank_py = script(tmp_path, "import sys; sys.exit(3)\n")
    (code, _, err), = finish(nodes(["-n", "1", "--max-restarts", "1", PY, rank_py]))
    theirs = subprocess.run([TORCHRUN, "--nproc-per-node", "1", "--max-restarts", "1", rank_py],
                            capture_output=True, text=True, timeout=120)
    assert err.count("failed first: exit code 3") == 2, err
    assert (code, theirs.returncode) == (3, 1)  # see run.md: ddip run exits with the root cause's


def test_max_restarts_restart_every_node(nodes, tmp_path):
    port, rank_py = free_port(), script(tmp_path, FAILS_FIRST_TIME)
    n0 = nodes(static(port, 2, 0, "--max-restarts", "1", "-n", "1", PY, rank_py))
    n1 = nodes(static(port, 2, 1, "--max-restarts", "1", "-n", "1", PY, rank_py))
    (c0, out0, err0), (c1, out1, err1) = finish(n0, n1)
    assert (c0, c1) == (0, 0), err0 + err1
    assert restarts_seen(out0) == ["rank 0 restart 0 of 1", "rank 0 restart 1 of 1"]
    assert restarts_seen(out1) == ["rank 1 restart 0 of 1", "rank 1 restart 1 of 1"]
    # The first attempt's failure was named on both nodes before the restart.
    for err in (err0, err1):
        assert f"rank 1 (on node 1, {HOST}) failed first: exit code 3" in err, err


def test_a_node_that_loses_the_jobs_host_stops_its_ranks_and_says_why(nodes, tmp_path):
    port, rank_py = free_port(), script(tmp_path, HANGS)
    n0 = nodes(static(port, 2, 0, "-n", "1", PY, rank_py))
    n1 = nodes(static(port, 2, 1, "-n", "1", PY, rank_py))
    assert n0.stdout.readline().strip() == "[0] in"
    assert n1.stdout.readline().strip() == "[1] in"
    n0.kill()
    _, (c1, _, err1) = finish(n0, n1)
    assert c1 == 1, err1
    assert "its link to the job's host (node 0) closed: that ddip run is gone; stopped its ranks" \
        in err1, err1


def test_each_network_namespace_host_runs_its_own_ddip_run_as_a_pod_would(tmp_path):
    from netns_hosts import Hosts, missing

    if missing():
        pytest.skip(missing())
    rank_py = script(tmp_path, ALL_REDUCE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["GLOO_SOCKET_IFNAME"] = "ddip0"  # the hosts' interface (netns_hosts.LINK)
    with Hosts(("A", "B")) as h:
        port = free_port()
        args = ["run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{h.addr['A']}:{port}", "--rdzv-id", "pods", PY, rank_py]
        # B first: its ddip run waits for A's, which hosts the job (the endpoint is A's address).
        procs = [subprocess.Popen(["ip", "netns", "exec", h.ns[n], DDIP, *args], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, text=True) for n in "BA"]
        try:
            (cb, outb, errb), (ca, outa, erra) = finish(*procs, timeout=120)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert (ca, cb) == (0, 0), erra + errb
    assert "node 0 of job 'pods'" in erra
    assert said(outa) == [f"rank {r} of 4 group 0 of 2 local {r} of 2 sum 6 restart 0"
                          for r in (0, 1)]
    assert said(outb) == [f"rank {r} of 4 group 1 of 2 local {r - 2} of 2 sum 6 restart 0"
                          for r in (2, 3)]


def test_a_node_whose_ranks_end_first_waits_for_the_jobs_end(nodes, tmp_path):
    # Node 1's rank is done at once; node 0's works on for several link timeouts (a checkpoint
    # being saved): node 1 hears the host's pings meanwhile, and both end well.
    rank_py = script(tmp_path, """
        import os, time
        if os.environ["GROUP_RANK"] == "0":
            time.sleep(4)
        print("rank", os.environ["RANK"], "done", flush=True)
    """)
    port = free_port()
    n0 = nodes(static(port, 2, 0, "--link-timeout", "1", "-n", "1", PY, rank_py))
    n1 = nodes(static(port, 2, 1, "--link-timeout", "1", "-n", "1", PY, rank_py))
    (c0, out0, err0), (c1, out1, err1) = finish(n0, n1)
    assert (c0, c1) == (0, 0), err0 + err1
    assert said(out0) == ["rank 0 done"] and said(out1) == ["rank 1 done"]


def test_max_restarts_with_hosts_counts_on_every_host(nodes, tmp_path):
    # A second "host" reached by a launcher command that starts its ddip run right here (--node): it is
    # told each attempt's count, so its rank sees restart 1 in the attempt that succeeds.
    rank_py = script(tmp_path, FAILS_FIRST_TIME)
    p = nodes(["--hosts", f"{HOST}:1,127.0.0.2:1", "--launcher", "H={host}; {command}",
               "--max-restarts", "1", "--", PY, rank_py])
    (code, out, err), = finish(p)
    assert code == 0, err
    assert restarts_seen(out) == ["rank 0 restart 0 of 1", "rank 0 restart 1 of 1",
                                  "rank 1 restart 0 of 1", "rank 1 restart 1 of 1"]
