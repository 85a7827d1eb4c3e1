"""Heal: a rank raises in a DDP step while its peers wait for it in a collective; the group gets a
working torch.distributed back by itself (Group.run, %%dip) or on request (Group.heal(),
%makedip --heal), and every rank keeps its variables. Real ranks, real gloo, a real kernel."""

from __future__ import annotations

import re

import pytest

import ddip
from ddip.errors import strip_ansi

pytest.importorskip("torch")

SETUP = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)  # the same data and initial weights on every rank
X = torch.randn(64, 4)
Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
model = torch.nn.Linear(4, 1)
ddp = DDP(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
losses, steps = [], 0
def train(n, fail_rank=None, fail_at=None):
    global steps
    rank = dist.get_rank()
    for i in range(n):
        xb, yb = X[rank::2], Y[rank::2]  # each rank its own half
        loss = torch.nn.functional.mse_loss(ddp(xb), yb)
        if rank == fail_rank and i == fail_at:
            raise ValueError(f"bad batch on rank {rank} at step {steps}")
        opt.zero_grad()
        loss.backward()  # DDP's all_reduce: a peer that raised above leaves this rank waiting
        opt.step()
        losses.append(loss.item())
        steps += 1
"""

PARAMS = "[p.detach().flatten().tolist() for p in model.parameters()]"


@pytest.fixture(scope="module")
def group():
    with ddip.Group(n=2, backend="gloo") as g:
        g.run(SETUP)
        yield g


def test_a_rank_raising_mid_step_heals_the_group_and_training_goes_on(group):
    group.run("train(5)")
    before = group.run(f"steps, len(losses), {PARAMS}")
    with pytest.raises(ddip.RemoteError) as info:
        group.run("train(5, fail_rank=1, fail_at=2)")
    err = info.value
    # The root cause comes first; the peer's broken collective after it.
    assert err.failures[0].rank == 1 and err.failures[0].ename == "ValueError"
    assert "bad batch on rank 1 at step 7" in err.failures[0].evalue
    heal = err.heal
    assert heal is not None and heal.ok, heal
    assert heal.failed == [1] and heal.released == [0] and heal.world_size == 2
    text = str(err)
    assert "ddip healed the group" in text and "rank 1 raised while rank 0 waited in a collective" in text
    assert "DistributedDataParallel" in text  # what the user must make again

    # Every rank kept its namespace: the steps done before the failure, the model, the losses.
    after = group.run(f"steps, len(losses), {PARAMS}, dist.get_world_size(), int(os.environ['MASTER_PORT'])")
    (s0, n0, p0, w0, port0), (s1, n1, p1, w1, port1) = [r.value for r in after]
    assert (s0, s1) == (7, 7) and (n0, n1) == (7, 7)  # 5 + 2 steps before rank 1 raised
    assert w0 == w1 == 2 and port0 == port1 == heal.port
    assert before[0].value[0] == 5

    # The rebuilt group works: an all_reduce sums both ranks.
    sums = group.run("t = torch.tensor([float(dist.get_rank() + 1)]); dist.all_reduce(t); t.item()")
    assert [r.value for r in sums] == [3.0, 3.0]

    # Training goes on once the model is wrapped again: weights stay identical, loss keeps falling.
    group.run("ddp = DDP(model)\ntrain(20)")
    res = [r.value for r in group.run(f"{PARAMS}, losses")]
    assert res[0][0] == res[1][0]
    losses = res[0][1]
    assert len(losses) == 27 and losses[-1] < losses[0] / 2, losses


def test_heal_on_request_releases_a_rank_stuck_in_a_collective(group):
    # Only rank 0 enters the all_reduce: it waits for rank 1 forever and can't be interrupted.
    with pytest.raises(TimeoutError) as info:
        group.run("t = torch.ones(1); dist.all_reduce(t)", ranks=[0], timeout=1)
    assert "did not stop" in str(info.value)
    assert [r["state"] for r in group.status()] == ["busy", "idle"]
    report = group.heal()
    assert report.ok and report.released == [0] and report.world_size == 2
    assert [r["state"] for r in group.status()] == ["idle", "idle"]
    sums = group.run("t = torch.ones(2); dist.all_reduce(t); t.tolist()")
    assert [r.value for r in sums] == [[2.0, 2.0], [2.0, 2.0]]


def test_heal_frees_a_stuck_rank_from_its_own_side_while_its_peer_is_busy(group):
    # Rank 0 waits in an all_reduce that rank 1 never joins; rank 1 is busy in Python, so its
    # group can't be torn down for rank 0's sake: rank 0 is freed by its own abort thread.
    with pytest.raises(TimeoutError):
        group.run("t = torch.ones(1); dist.all_reduce(t)", ranks=[0], timeout=1)
    busy = group.apply_async(_busy_python, ranks=[1])
    report = group.heal()
    assert report.ok and report.released == [0, 1]
    with pytest.raises(ddip.RemoteError, match="KeyboardInterrupt"):
        busy.result()  # interrupted by the heal, after its grace
    out = group.run("t = torch.ones(1); dist.all_reduce(t); t.item()")
    assert [r.value for r in out] == [2.0, 2.0]


def _busy_python():
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.01)


RESET_EVERY_HANDLER = """
import signal
for s in signal.valid_signals():  # what Lightning's teardown does: getsignal() of a C handler is SIG_DFL
    try:
        signal.signal(s, signal.getsignal(s) if signal.getsignal(s) is not None else signal.SIG_DFL)
    except (OSError, ValueError, TypeError, RuntimeError):
        pass
"""


def test_stacks_and_heal_survive_code_that_resets_every_signal_handler():
    with ddip.Group(n=2, backend="gloo") as g:
        g.run(SETUP + RESET_EVERY_HANDLER)
        stacks = g.stacks()
        assert all("most recent call first" in stacks[r] for r in (0, 1)), stacks
        assert [r["state"] for r in g.status()] == ["idle", "idle"]
        # Heal's abort, after the handlers were reset again: rank 0 stuck alone in an all_reduce.
        g.run(RESET_EVERY_HANDLER)
        with pytest.raises(TimeoutError):
            g.run("t = torch.ones(1); dist.all_reduce(t)", ranks=[0], timeout=1)
        report = g.heal()
        assert report.ok and report.released == [0], report
        out = g.run("t = torch.ones(1); dist.all_reduce(t); t.item()")
        assert [r.value for r in out] == [2.0, 2.0]
        assert [r["state"] for r in g.status()] == ["idle", "idle"]


def test_a_failure_outside_collectives_does_not_heal(group):
    port = group.master_port
    with pytest.raises(ddip.RemoteError) as info:
        group.run("if dist.get_rank() == 1: raise KeyError('nope')")
    assert info.value.heal is None  # rank 0 was done: nothing waited, nothing to rebuild
    assert group.master_port == port
    assert "healed" not in str(info.value)


def test_heal_refuses_a_group_without_torch_distributed():
    with ddip.Group(n=2, backend=None) as g:
        with pytest.raises(ddip.HealError, match="no torch.distributed to heal") as info:
            g.heal()
        assert not info.value.report.ok and info.value.report.seconds == 0
        assert "start it with a backend" in str(info.value)


def test_a_dead_rank_is_replaced_by_heal():
    # More in test_replace_rank.py: the survivors' variables, copy_from, bad input.
    with ddip.Group(n=2, backend="gloo") as g:
        with pytest.raises(ddip.RemoteError) as info:
            g.run("import os, torch, torch.distributed as dist\n"
                  "if dist.get_rank() == 1: os._exit(3)\n"
                  "dist.all_reduce(torch.ones(1))")
        assert info.value.failures[0].died and info.value.failures[0].rank == 1
        assert info.value.heal is None
        report = g.heal()
        assert report.ok and list(report.replaced) == [1] and g.pids[1] == report.replaced[1]
        out = g.run("import torch, torch.distributed as dist\nt = torch.ones(1); dist.all_reduce(t); t.item()")
        assert [r.value for r in out] == [2.0, 2.0]


# -- through a real kernel ------------------------------------------------------------------------


def test_dip_cell_heals_and_makedip_heal(tmp_path):
    from test_magics import running_kernel

    with running_kernel(tmp_path) as k:
        assert k.run("%makedip -n 2").ok
        assert k.run("%%dip\n" + SETUP + "train(3)").ok
        cell = k.run("%%dip\ntrain(3, fail_rank=1, fail_at=1)")
        assert not cell.ok
        err = strip_ansi(cell.stream("stderr"))
        assert re.search(r"ddip healed the group in \d+\.\d\d s: rank 1 raised while rank 0 waited", err), err
        tracebacks = "\n".join(strip_ansi("\n".join(o["traceback"])) for o in cell.of_type("error"))
        assert "ValueError: bad batch on rank 1 at step 4" in tracebacks
        cell = k.run("%%dip --see all\nddp = DDP(model)\ntrain(2)\nsteps, dist.get_world_size()")
        assert cell.ok, cell.outputs
        # Rank 0's heal note, once (in the healed cell, or as the next one's background output).
        noted = err + strip_ansi(cell.stream("stderr"))
        assert noted.count("this rank's process groups were aborted") == 1, noted
        assert re.findall(r"Out\[(\d):\d+\]: \(6, 2\)", "\n".join(cell.plain)) == ["0", "1"], cell.plain
        cell = k.run("%makedip --heal")
        assert cell.ok and re.search(r"healed in \d+\.\d\d s: .* all 2 ranks", cell.stream()), cell.outputs
        cell = k.run("%%dip\nt = torch.ones(1); dist.all_reduce(t); t.item(), steps")
        assert cell.ok and re.fullmatch(r"Out\[0:\d+\]: \(2\.0, 6\)", "".join(cell.plain)), cell.outputs
        cell = k.run("%makedip --heal -r")
        assert not cell.ok and "--heal rebuilds" in cell.stream("stderr")
        k.run("%%dip\nif dist.get_rank() == 1: os._exit(3)")
        cell = k.run("%makedip --heal")  # the dead rank is replaced (test_replace_rank.py: --copy-from)
        assert cell.ok and re.search(r"rank 1 is a new process \(pid \d+\)", cell.stream()), cell.outputs
        k.run("%makedip -k")
