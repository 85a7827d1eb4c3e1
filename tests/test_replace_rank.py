"""Heal replaces a dead rank: a rank killed (SIGKILL, as the OOM killer does) is started again in
its slot (same rank, environment, warm template), torch.distributed's default group is rebuilt
with the same world size, and every survivor keeps its namespace; copy_from gives the new rank a
copy of a survivor's variables. Real ranks, real gloo, a real kernel."""

from __future__ import annotations

import os
import re
import signal

import pytest

import ddip
from conftest import wait_until
from ddip.errors import strip_ansi

pytest.importorskip("torch")

IMPORTS = "import os, torch, torch.distributed as dist\n"
# Every rank's own variables: what a survivor must still have after a heal.
SET_UP = IMPORTS + """
rank = dist.get_rank()
mine = torch.full((3,), float(rank))
note = {"rank": rank, "words": ["kept"]}
"""
ALL_REDUCE = IMPORTS + "u = torch.ones(1); dist.all_reduce(u); u.item()"


def _wait_dead(g, rank):
    assert wait_until(lambda: g.status()[rank]["state"] == "dead", 30), g.status()


def _kill_from_inside(g, rank):
    """The rank kills itself with SIGKILL in a cell (as the OOM killer would): the cell fails."""
    with pytest.raises(ddip.RemoteError) as info:
        g.run(f"import os\nif int(os.environ['RANK']) == {rank}: os.kill(os.getpid(), 9)")
    assert info.value.failures[0].died and info.value.failures[0].rank == rank


def test_a_killed_rank_is_replaced_in_its_slot_and_the_survivors_keep_their_variables():
    with ddip.Group(n=3, backend="gloo") as g:
        g.run(SET_UP)
        old = g.pids
        tmpl = g.runtime.template
        forks = tmpl.forks if tmpl is not None else None
        _kill_from_inside(g, 1)
        report = g.heal()
        assert report.ok and list(report.replaced) == [1] and report.copied_from is None
        new_pid = g.pids[1]
        assert report.replaced[1] == new_pid and new_pid != old[1] and g.pids[0::2] == old[0::2]
        if tmpl is not None:  # the group's ranks were forked from the warm template: so is the new one
            assert tmpl.forks == forks + 1
        assert [r["state"] for r in g.status()] == ["idle"] * 3
        env = g.run("import os; (os.getpid(), os.environ['RANK'], os.environ['WORLD_SIZE'], "
                    "os.environ['MASTER_PORT'], os.environ['DDIP_SLOT'])", ranks=[1])[0].value
        assert env == (new_pid, "1", "3", str(report.port), "1")
        # The new rank's namespace is empty; the survivors' are as they were.
        assert g.run("'note' in globals(), 'mine' in globals()", ranks=[1])[0].value == (False, False)
        kept = g.run("mine.tolist(), note", ranks=[0, 2])
        assert [r.value for r in kept] == [([0.0] * 3, {"rank": 0, "words": ["kept"]}),
                                           ([2.0] * 3, {"rank": 2, "words": ["kept"]})]
        assert [r.value for r in g.run(ALL_REDUCE)] == [3.0, 3.0, 3.0]
        text = str(report.describe())
        assert f"rank 1 is a new process (pid {new_pid})" in text and "empty namespace" in text
        assert "run your set-up cell again on it" in text and "DDP again" in text


def test_copy_from_gives_the_new_rank_a_survivors_variables_and_names_what_it_skipped():
    with ddip.Group(n=2, backend="gloo") as g:
        g.run(SET_UP + "import json, threading\nlog = open(os.devnull)\nclass Box:\n    size = 7\nbox = Box()\n"
                       "lock = threading.Lock()\nbig = torch.arange(1 << 20, dtype=torch.float64)\n"
                       "same = [mine, mine]\nlocal_rank = int(os.environ['LOCAL_RANK']); steps = 0\n"
                       "gpu = torch.device('cuda', local_rank); cpu = torch.device('cpu')\n"
                       "from torch.utils.data import DataLoader, DistributedSampler\n"
                       "sampler = DistributedSampler(range(8), num_replicas=2, rank=rank)\n"
                       "loader = DataLoader(range(8), sampler=sampler)")
        _kill_from_inside(g, 1)
        report = g.heal(copy_from=0)
        assert report.ok and report.copied_from == 0 and list(report.replaced) == [1]
        assert {"mine", "note", "box", "Box"} <= set(report.copied)
        assert {"json", "torch"} <= set(report.copied)  # modules travel by name: imported there
        assert report.skipped["log"].startswith("an open file")
        assert report.skipped["lock"].startswith("lock can't be pickled (TypeError"), report.skipped
        assert not {"log", "In", "Out", "open"} & set(report.copied)
        assert g.run("json.dumps([1]), torch.__name__", ranks=[1])[0].value == ("[1]", "torch")
        got = g.run("import os\n(mine.tolist(), note, box.size, os.environ['RANK'])", ranks=[1])[0].value
        assert got == ([0.0] * 3, {"rank": 0, "words": ["kept"]}, 7, "1")  # rank 0's, in rank 1
        # Rank 0's identity is never handed to rank 1: its rank, local rank, GPU, data shard.
        assert set(report.identity) == {"rank", "local_rank", "gpu", "sampler", "loader"}, report.skipped
        assert report.skipped["rank"].startswith("rank 0's own rank (0)")
        assert report.skipped["gpu"].startswith("rank 0's own GPU (cuda:0)")
        assert report.skipped["loader"].startswith("rank 0's own data shard (a loader whose sampler is a "
                                                   "DistributedSampler with rank=0)")
        assert not {"rank", "local_rank", "gpu", "sampler", "loader"} & set(report.copied)
        assert {"steps", "cpu"} <= set(report.copied)  # an int not named like a rank; a CPU device
        assert "On rank(s) 1: set gpu, loader, local_rank, rank, sampler again" in report.describe()
        # 8 MiB of tensor (through shared memory), and what referred to one object still does.
        total = float((1 << 20) * ((1 << 20) - 1) / 2)
        assert g.run("big.sum().item(), same[0] is mine", ranks=[1])[0].value == (total, True)
        assert g.run("mine.tolist(), rank", ranks=[0])[0].value == ([0.0] * 3, 0)  # rank 0 untouched
        assert "log" in report.describe() and "an open file" in report.describe()
        assert [r.value for r in g.run(ALL_REDUCE)] == [2.0, 2.0]
        # names=: those only.
        _kill_from_inside(g, 1)
        report = g.heal(copy_from=0, names=["mine"])
        assert report.copied == ["mine"] and report.skipped == {}
        assert g.run("'mine' in globals(), 'note' in globals()", ranks=[1])[0].value == (True, False)


def test_rank_0_killed_while_its_peer_waits_in_a_collective_is_replaced():
    with ddip.Group(n=2, backend="gloo") as g:
        g.run(SET_UP)
        with pytest.raises(ddip.RemoteError) as info:
            g.run(IMPORTS + "if dist.get_rank() == 0: os.kill(os.getpid(), 9)\n"
                            "t = torch.ones(1); dist.all_reduce(t)")
        assert info.value.failures[0].rank == 0 and info.value.failures[0].died
        report = g.heal(copy_from=1, names=["note"])
        assert list(report.replaced) == [0] and report.copied == ["note"]
        # The new rank 0 opened the group's store itself, on the port the report names.
        assert g.run("import os; os.environ['MASTER_PORT'], os.environ['RANK']", ranks=[0])[0].value == \
            (str(report.port), "0")
        assert g.run("note", ranks=[0])[0].value == {"rank": 1, "words": ["kept"]}
        assert g.run("mine.tolist()", ranks=[1])[0].value == [1.0] * 3
        assert [r.value for r in g.run(ALL_REDUCE)] == [2.0, 2.0]


def test_a_group_without_torch_distributed_gets_its_dead_rank_replaced_too():
    with ddip.Group(n=2, backend=None) as g:
        g.push(x=5)
        old = g.pids
        _kill_from_inside(g, 0)
        report = g.heal(copy_from=1)
        assert report.ok and report.port is None and list(report.replaced) == [0] and report.copied == ["os", "x"]
        assert g.pids[0] == report.replaced[0] != old[0] and g.pids[1] == old[1]
        assert [r.value for r in g.run("import os; x, os.environ['RANK']")] == [(5, "0"), (5, "1")]
        text = report.describe()
        assert "rank 0 is a new process" in text and "with a copy of rank 1's variables (os, x)" in text
        assert "torch.distributed" not in text and "DDP" not in text, text
        with pytest.raises(ddip.HealError, match="no torch.distributed to heal"):  # nothing dead: as before
            g.heal()


def test_bad_input_is_refused_and_changes_nothing():
    with ddip.Group(n=2, backend="gloo") as g:
        g.run(SET_UP)
        with pytest.raises(ValueError, match="no rank is dead"):
            g.heal(copy_from=0)
        _kill_from_inside(g, 1)
        pids = g.pids
        with pytest.raises(ValueError, match=r"copy_from=1: rank 1 is dead itself; copy from a living rank \(0\)"):
            g.heal(copy_from=1)
        with pytest.raises(ValueError, match=r"no rank 5 in this group \(ranks: \[0, 1\]\)"):
            g.heal(copy_from=5)
        with pytest.raises(TypeError, match="copy_from must be a rank number"):
            g.heal(copy_from="0")
        for names in ("mine", [1], [], ["not a name"]):
            with pytest.raises(TypeError, match="names must be a non-empty list of variable names"):
                g.heal(copy_from=0, names=names)
        with pytest.raises(ValueError, match="give copy_from=RANK too"):
            g.heal(names=["mine"])
        with pytest.raises(NameError, match=r"names=\['nothing_here'\]: not defined on rank 0; nothing was changed"):
            g.heal(copy_from=0, names=["mine", "nothing_here"])
        assert g.pids == pids and [r["state"] for r in g.status()] == ["idle", "dead"]
        report = g.heal(copy_from=0, names=["mine"])  # and then it heals
        assert report.copied == ["mine"] and [r.value for r in g.run(ALL_REDUCE)] == [2.0, 2.0]


def test_a_dead_rank_in_a_dip_cell_says_heal_replaces_it_and_makedip_heal_copy_from_does(tmp_path):
    from test_magics import running_kernel

    train = TRAIN
    digest = f"hashlib.md5(str({PARAMS}).encode()).hexdigest()"
    with running_kernel(tmp_path) as k:
        assert k.run("%makedip -n 2").ok
        assert k.run("%%dip\n" + train + "rank = dist.get_rank()\ntrain(3)").ok
        own = k.run("%%dip -r 0\nmine = 'only on rank 0'; mine")
        assert own.ok
        cell = k.run("%%dip\nif dist.get_rank() == 1: os.kill(os.getpid(), 9)")
        err = strip_ansi("".join("\n".join(o["traceback"]) for o in cell.of_type("error")))
        assert not cell.ok and "%makedip --heal (g.heal()) replaces the dead rank" in err, err
        cell = k.run("%makedip --heal --copy-from 5")
        assert not cell.ok and "--copy-from: no rank 5 in this group" in strip_ansi(str(cell.outputs))
        cell = k.run("%makedip --heal --copy-from 0")
        out = cell.stream()
        assert cell.ok and re.search(r"healed in \d+\.\d\d s: .* all 2 ranks", out), cell.outputs
        assert re.search(r"rank 1 is a new process \(pid \d+\), .*with a copy of rank 0's variables \(.*model", out)
        assert re.search(r"not copied: ddp \(it holds the old process group: make it again on the new rank\)",
                         out), out
        assert "wrap the model in DDP again" in out, out
        # Only what is true: the modules came by name (no import again), rank 0's `rank` did not.
        assert "import the modules" not in out and "On rank(s) 1: set rank again" in out, out
        cell = k.run("%%dip --ranks 1\nrank")
        assert not cell.ok and cell.of_type("error")[0]["ename"] == "NameError", cell.outputs
        # Rank 1's parameters are rank 0's (copied), and so is how far it trained.
        cell = k.run(f"%%dip --see all\nimport hashlib\n{digest}, len(losses)")
        values = re.findall(r"Out\[(\d):\d+\]: (.*)", "\n".join(cell.plain))
        assert cell.ok and [v[0] for v in values] == ["0", "1"] and values[0][1] == values[1][1], cell.plain
        # No imports again: rank 0's modules (torch, dist, DDP's class) came with the copy.
        cell = k.run("%%dip --see all\n"
                     f"import hashlib\nddp = DDP(model)\nn = len(losses)\ntrain(5)\nlosses[n] > losses[-1], {digest}")
        assert cell.ok, cell.outputs
        values = re.findall(r"Out\[(\d):\d+\]: \((True), (.*)\)", "\n".join(cell.plain))
        assert [v[0] for v in values] == ["0", "1"] and values[0][2] == values[1][2], cell.plain
        assert "only on rank 0" in "".join(k.run("%%dip -r 0\nmine").plain)  # rank 0's own, untouched
        k.run("%makedip -k")


TRAIN = IMPORTS + """
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
X = torch.randn(64, 4); Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
model = torch.nn.Linear(4, 1)
ddp = DDP(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
losses = []
def train(n):
    rank = dist.get_rank()
    for _ in range(n):
        loss = torch.nn.functional.mse_loss(ddp(X[rank::2]), Y[rank::2])
        opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
"""
PARAMS = "[p.detach().flatten().tolist() for p in model.parameters()]"
# Which rank, where, which process, started by whom (a host's agent), forked from a template.
WHO = ("import os, ddip.template\n(os.environ['RANK'], os.environ['DDIP_HOST'], os.getpid(), os.getppid(), "
       "ddip.template.forked)")


def test_a_dead_rank_on_a_network_namespace_host_comes_back_there_from_its_agents_template():
    """Through Group, as the other multi-host tests: both ranks on hosts made of network
    namespaces, each reached by ssh; rank 1's host's standing agent starts it again."""
    from netns_hosts import Hosts, _missing

    if _missing() is not None:
        pytest.skip(_missing())
    from test_multihost import _launcher_pid

    hosts = Hosts()
    try:
        a, b = hosts.addr["A"], hosts.addr["B"]
        with ddip.Group(hosts=f"{a}:1,{b}:1", launcher=hosts.launcher, backend="gloo", timeout=120,
                        env={"GLOO_SOCKET_IFNAME": "ddip0"}) as g:
            g.run(TRAIN + "train(3)")
            g.run("mine = 'only on rank 0'", ranks=[0])
            before = [r.value for r in g.run(WHO)]
            assert [w[:2] for w in before] == [("0", a), ("1", b)] and before[1][4], before
            _kill_from_inside(g, 1)
            report = g.heal(copy_from=0)
            assert report.ok and list(report.replaced) == [1] and report.copied_from == 0, report
            assert {"model", "opt", "X", "Y", "losses", "train", "mine"} <= set(report.copied)
            assert "ddp" in report.skipped
            after = [r.value for r in g.run(WHO)]
            assert after[0] == before[0], "rank 0 is the same process"
            rank, host, pid, agent, forked = after[1]
            # The same rank, on its host, started by the same agent from that host's template.
            assert (rank, host) == ("1", b) and pid != before[1][2]
            assert pid == report.replaced[1] == g.pids[1]
            assert agent == before[1][3] and forked
            assert f"rank 1 is a new process (pid {pid})" in report.describe()
            # A world of 2 again, rank 1 with rank 0's parameters and how far it trained.
            got = [r.value for r in g.run(f"dist.get_world_size(), {PARAMS}, len(losses)")]
            assert got[0] == got[1] and got[0][0] == 2 and got[0][2] == 3, got
            # Training goes on once DDP wraps the model again: loss falling, parameters identical.
            trained = [r.value for r in g.run(f"ddp = DDP(model)\nn = len(losses)\ntrain(5)\n"
                                              f"losses[n] > losses[-1], {PARAMS}")]
            assert trained[0][0] and trained[1][0] and trained[0][1] == trained[1][1], trained
            assert g.run("mine, len(losses)", ranks=[0])[0].value == ("only on rank 0", 8)
            # Rank 0 on its host too: the new one opens the group's store itself, there.
            g.run("theirs = 'only on rank 1'", ranks=[1])
            _kill_from_inside(g, 0)
            report = g.heal(copy_from=1, names=["model", "theirs"])
            assert list(report.replaced) == [0] and report.copied == ["model", "theirs"], report
            rank, host, pid, agent, forked = g.run(WHO, ranks=[0])[0].value
            assert (rank, host, agent, forked) == ("0", a, before[0][3], True) and pid != before[0][2]
            assert g.run("os.environ['MASTER_PORT'], theirs", ranks=[0])[0].value == \
                (str(report.port), "only on rank 1")
            assert [r.value for r in g.run(ALL_REDUCE)] == [2.0, 2.0]
            g.run("mine = 'only on rank 0'", ranks=[0])

            # A rank lost with its host's link has no agent there to start it: refused, naming
            # the host, and nothing changes.
            os.kill(_launcher_pid(b), signal.SIGKILL)
            _wait_dead(g, 1)
            refused = (rf"rank 1 on host {re.escape(b)} \(lost the link to its host .*\): that host's "
                       r"agent is gone with its link")
            with pytest.raises(ddip.HealError, match=refused) as err:
                g.heal()
            assert isinstance(err.value.__cause__, ddip.RankDeadError) and err.value.report.seconds == 0
            assert "%makedip -r (g.restart()) starts fresh ranks, with a new agent on that host" in str(err.value)
            assert [r["state"] for r in g.status()] == ["idle", "dead"]
            assert g.run("mine", ranks=[0])[0].value == "only on rank 0"
    finally:
        hosts.close()
