"""torch.distributed's rendezvous is bounded apart from the collectives' 30-minute timeout, and
a rank that never arrives is named."""

import os

import pytest

import ddip
from ddip.rank import torchdist
from conftest import children_of

torch = pytest.importorskip("torch")


class DiesBeforeRendezvous(ddip.TorchDDPCtx):
    def __enter__(self):
        if os.environ["RANK"] == "1":
            os._exit(5)
        return super().__enter__()


def _all_reduce():
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.timeout(60)
def test_a_child_dying_before_the_rendezvous_does_not_leave_the_notebook_waiting():
    # Before: the notebook (rank 0) waited in init_process_group for the 30-minute timeout.
    before = children_of(os.getpid())
    with pytest.raises(ddip.RemoteError) as ei:
        ddip.ranch(2, _all_reduce, ctx=DiesBeforeRendezvous())
    failures = ei.value.failures
    assert (failures[0].rank, failures[0].evalue) == (1, "exit code 5")
    own = [f for f in failures if f.rank == 0]
    assert own and "rank 1 failed before it arrived" in own[0].evalue
    assert children_of(os.getpid()) == before
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_the_rank_that_never_arrived_is_named():
    with pytest.raises(torchdist.RendezvousError, match=r"rank\(s\) 1, 2 never arrived within 0.5 s"):
        torchdist.rendezvous(0, 3, "127.0.0.1", ddip.kernel.group.free_port(), timeout=0.5)


def test_an_abort_hook_ends_the_wait_with_its_reason():
    with pytest.raises(torchdist.RendezvousError, match="rank 1 died"):
        torchdist.rendezvous(0, 2, "127.0.0.1", ddip.kernel.group.free_port(), timeout=30,
                             abort=lambda: "rank 1 died")


def test_a_normal_launch_still_rendezvous_and_reduces():
    assert ddip.ranch(3, _all_reduce, ctx=ddip.TorchDDPCtx()) == [3.0, 3.0, 3.0]
