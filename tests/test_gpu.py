"""GPU paths: NCCL groups, GPU lists, CUDA tensors pushed to ranks. Skipped without an NVIDIA GPU."""

import pytest

import ddip
from conftest import requires_gpu

pytestmark = requires_gpu


@pytest.fixture(scope="module")
def ngpu():
    return ddip.group.gpu_count()


def test_nccl_group_on_all_gpus(ngpu):
    with ddip.Group(gpus="all") as g:
        assert g.backend == "nccl" and g.size == ngpu
        res = g.run("import os, torch, torch.distributed as dist\n"
                    "t = torch.ones(2, device='cuda') * (dist.get_rank() + 1)\ndist.all_reduce(t)\n"
                    "(dist.get_backend(), torch.cuda.current_device(), os.environ['CUDA_VISIBLE_DEVICES'], t.tolist())")
        total = ngpu * (ngpu + 1) / 2
        visible = ",".join(map(str, range(ngpu)))
        assert [r.value for r in res] == [("nccl", i, visible, [total, total]) for i in range(ngpu)]


def test_gpu_subset_in_reverse_order(ngpu):
    order = list(reversed(range(ngpu)))[: max(1, ngpu - 1)]
    with ddip.Group(gpus=order) as g:
        devices = g.apply(lambda: __import__("torch").cuda.current_device())
        assert devices == list(range(len(order)))
        assert [g.device(r) for r in range(len(order))] == [f"cuda:{i} (GPU {gid})" for i, gid in enumerate(order)]


def test_cuda_tensor_pushed_to_ranks_arrives_on_their_gpu():
    import torch

    with ddip.Group(gpus=[0]) as g:
        g.push(t=torch.arange(4.0, device="cuda"))
        (dev, total), = [r.value for r in g.run("(str(t.device), t.sum().item())")]
        assert (dev, total) == ("cuda:0", 6.0)


def test_cpu_ranks_on_a_gpu_machine_see_no_gpu():
    with ddip.Group(n=2, backend="gloo") as g:
        assert g.apply(lambda: __import__("torch").cuda.is_available()) == [False, False]


def test_nonexistent_gpu_is_a_clear_error(ngpu):
    with pytest.raises(ValueError, match=f"GPU {ngpu} does not exist: this machine has GPUs 0-{ngpu - 1}"):
        ddip.Group(gpus=[ngpu])
