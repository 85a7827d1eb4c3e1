"""GPU paths on a real machine: NCCL groups, GPU lists in any order, CUDA tensors moving between the
notebook and ranks, DDP training, NCCL one-shot launches, the notebook's CUDA_VISIBLE_DEVICES, and
the notebook's CUDA left untouched. Skipped without an NVIDIA GPU (or without a CUDA build of torch).

Numbers in gpus= are positions in the notebook's visible list, so the expected GPU of each rank is
read from CUDA itself, as the notebook would see it (`kernel_uuids`: device index -> UUID, in a
fresh process with the test's environment), never from nvidia-smi's order. Checks whose outcome
depends on the test process's CUDA state run in fresh subprocesses.
"""

import json
import os
import subprocess
import textwrap

import pytest

import ddip
from conftest import PY, requires_gpu


def _cuda_torch() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.version.cuda is not None


# The torch check only runs where there is a GPU (importing torch costs seconds).
pytestmark = [requires_gpu, pytest.mark.skipif(ddip.kernel.group.gpu_count() > 0 and not _cuda_torch(),
                                               reason="needs PyTorch built with CUDA")]

FRESH_TIMEOUT_S = 240


def gpu_uuid(text) -> str:
    """torch prints a device's UUID bare; nvidia-smi and CUDA_VISIBLE_DEVICES prefix it with GPU-."""
    text = str(text)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def run_fresh(code: str, env: dict | None = None) -> dict:
    """Runs `code` in a fresh Python process (CUDA untouched there until the code touches it) and
    returns what it printed as `RESULT <json>`."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    p = subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env,
                       timeout=FRESH_TIMEOUT_S, cwd=os.path.dirname(os.path.abspath(__file__)))
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, \
        f"exit code {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def ngpu():
    return ddip.kernel.group.gpu_count()


@pytest.fixture(scope="module")
def visible():
    """The test process's visible entries: what gpus='all' gives, position by position."""
    return ddip.gpus.inventory()[0]


@pytest.fixture(scope="module")
def kernel_uuids(ngpu):
    """UUID of each of the notebook's device indices, as CUDA in the notebook would see them."""
    uuids = run_fresh("""
        import json, torch
        print("RESULT " + json.dumps([str(torch.cuda.get_device_properties(i).uuid)
                                      for i in range(torch.cuda.device_count())]))
    """)
    uuids = [gpu_uuid(u) for u in uuids]
    assert len(uuids) == ngpu, f"ddip counts {ngpu} visible GPUs, CUDA sees {len(uuids)}"
    return uuids


def physical_uuids() -> set[str]:
    return {g.uuid for g in ddip.gpus.physical_gpus() if g.uuid}


RANK_GPU = ("import os, torch, torch.distributed as dist\n"
            "t = torch.ones(2, device='cuda') * (dist.get_rank() + 1)\n"
            "dist.all_reduce(t)\n"
            "dev = torch.cuda.current_device()\n"
            "(dist.get_backend(), dist.get_rank(), dev, os.environ['CUDA_VISIBLE_DEVICES'], t.tolist(),\n"
            " str(torch.cuda.get_device_properties(dev).uuid))")


def test_nccl_group_over_all_visible_gpus(ngpu, visible, kernel_uuids):
    with ddip.Group(gpus="all") as g:
        assert g.backend == "nccl" and g.size == ngpu and g.gpus == visible
        values = [r.value for r in g.run(RANK_GPU)]
    total = float(ngpu * (ngpu + 1) // 2)
    for rank, (backend, dist_rank, dev, cvd, t, uuid) in enumerate(values):
        assert (backend, dist_rank, dev) == ("nccl", rank, rank)  # rank r on device index r
        assert cvd == ",".join(visible)  # every rank sees the group's GPUs, in order
        assert t == [total, total]
        assert gpu_uuid(uuid) == kernel_uuids[rank]  # the notebook's device `rank`
    if physical_uuids() and not any(e.startswith("MIG-") for e in visible):
        assert {gpu_uuid(v[5]) for v in values} <= physical_uuids()


def test_gpus_in_reverse_order_put_rank_0_on_the_listed_gpu(ngpu, visible, kernel_uuids):
    if ngpu < 2:
        pytest.skip("needs 2 GPUs")
    with ddip.Group(gpus=[1, 0]) as g:
        assert g.gpus == [visible[1], visible[0]]
        assert [g.device(r) for r in range(2)] == [f"cuda:0 (GPU {visible[1]})", f"cuda:1 (GPU {visible[0]})"]
        values = [r.value for r in g.run(RANK_GPU)]
        rows = g.status()
    assert [v[2] for v in values] == [0, 1]  # tutorial code's device index = rank still works
    assert [v[3] for v in values] == [f"{visible[1]},{visible[0]}"] * 2
    assert [v[4] for v in values] == [[3.0, 3.0]] * 2
    assert [gpu_uuid(v[5]) for v in values] == [kernel_uuids[1], kernel_uuids[0]]
    phys = ddip.gpus.physical_gpus()
    if "CUDA_VISIBLE_DEVICES" not in os.environ and os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" \
            and phys and phys[1].uuid:
        assert gpu_uuid(values[0][5]) == phys[1].uuid  # positions are nvidia-smi's indices then
    # Status reads GPU use with nvidia-smi (processes may be invisible to it in a container).
    for row, uuid in zip(rows, [kernel_uuids[1], kernel_uuids[0]]):
        if row["gpu"] is not None:
            assert row["gpu"]["uuid"] == uuid and row["gpu"]["used_mib"] > 0


def test_cuda_tensors_land_on_each_ranks_device_and_on_the_cpu_in_a_notebook_without_cuda(ngpu):
    gpus = list(range(min(ngpu, 2)))
    out = run_fresh(f"""
        import json, torch, ddip
        gpus = {gpus!r}
        out = {{}}
        with ddip.Group(gpus=gpus) as g:
            g.run("import os, torch\\nx = torch.arange(4.0, device='cuda') + int(os.environ['RANK'])",
                  values=False)
            x = g.pull("x", rank=len(gpus) - 1)
            out["pulled"] = [str(x.device), x.tolist(), torch.cuda.is_initialized()]
            t = torch.arange(4.0, device="cuda")  # now the notebook's own code starts CUDA
            p = torch.nn.Parameter(torch.ones(2, device="cuda"))
            g.push(t=t, p=p)
            out["pushed"] = [r.value for r in g.run(
                "(str(t.device), t.sum().item(), type(p).__name__, str(p.device), p.requires_grad)")]
            back = g.pull("t", rank=len(gpus) - 1)
            out["back"] = [str(back.device), back.tolist()]
        print("RESULT " + json.dumps(out))
    """)
    last = len(gpus) - 1
    assert out["pulled"] == ["cpu", [float(last + i) for i in range(4)], False]
    assert out["pushed"] == [[f"cuda:{r}", 6.0, "Parameter", f"cuda:{r}", True] for r in range(len(gpus))]
    assert out["back"] == ["cuda:0", [0.0, 1.0, 2.0, 3.0]]  # the notebook's current device, once it has CUDA


DDP_STEPS, DDP_LR, DDP_BATCH = 5, 0.1, 8

DDP_TRAIN = f"""
import os, torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
rank = int(os.environ["LOCAL_RANK"])
torch.manual_seed(0)
model = nn.Linear(4, 1).double().to(rank)
ddp = DDP(model, device_ids=[rank])
gen = torch.Generator().manual_seed(100 + dist.get_rank())
X = torch.randn({DDP_BATCH}, 4, generator=gen, dtype=torch.float64).to(rank)
y = torch.randn({DDP_BATCH}, 1, generator=gen, dtype=torch.float64).to(rank)
opt = torch.optim.SGD(ddp.parameters(), lr={DDP_LR})
for _ in range({DDP_STEPS}):
    opt.zero_grad()
    nn.functional.mse_loss(ddp(X), y).backward()
    opt.step()
(str(model.weight.device), model.weight.detach().cpu().tolist(), model.bias.detach().cpu().tolist())
"""


def _reference_weights(world: int):
    """One process over the ranks' batches concatenated, on the CPU in float64."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1).double()
    init = model.weight.detach().clone()
    Xs, ys = [], []
    for rank in range(world):
        gen = torch.Generator().manual_seed(100 + rank)
        Xs.append(torch.randn(DDP_BATCH, 4, generator=gen, dtype=torch.float64))
        ys.append(torch.randn(DDP_BATCH, 1, generator=gen, dtype=torch.float64))
    X, y = torch.cat(Xs), torch.cat(ys)
    opt = torch.optim.SGD(model.parameters(), lr=DDP_LR)
    for _ in range(DDP_STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(X), y).backward()
        opt.step()
    return init, model.weight.detach(), model.bias.detach()


def test_ddp_training_on_gpu_ranks_matches_one_process_over_all_the_data(ngpu):
    import torch

    gpus = list(range(min(ngpu, 2)))
    with ddip.Group(gpus=gpus) as g:
        assert g.backend == "nccl"
        values = [r.value for r in g.run(DDP_TRAIN)]
    init, weight, bias = _reference_weights(len(gpus))
    assert not torch.allclose(weight, init, atol=1e-3)  # it did train
    for rank, (device, w, b) in enumerate(values):
        assert device == f"cuda:{rank}"
        assert torch.allclose(torch.tensor(w, dtype=torch.float64), weight, rtol=0, atol=1e-8), (rank, w, weight)
        assert torch.allclose(torch.tensor(b, dtype=torch.float64), bias, rtol=0, atol=1e-8), (rank, b, bias)


def test_cold_nccl_launches_put_each_rank_on_its_gpu(ngpu, visible, kernel_uuids):
    # Two GPUs: the notebook is rank 0 on its cuda:1, a child is rank 1 on the notebook's cuda:0.
    # One GPU: two ranks can't share it under NCCL, so one child rank runs it all.
    gpus, caller = ([1, 0], 0) if ngpu >= 2 else ([0], None)
    out = run_fresh(f"""
        import json, ddip

        def fn():
            import os, torch, torch.distributed as dist
            dev = torch.cuda.current_device()
            t = torch.ones(2, device="cuda") * (dist.get_rank() + 1)
            dist.all_reduce(t)
            return (dist.get_backend(), dist.get_rank(), t.tolist(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                    dev, str(torch.cuda.get_device_properties(dev).uuid), "DDIP_SLOT" in os.environ)

        gpus, caller = {gpus!r}, {caller!r}
        out = {{"launch": ddip.torchddp_launch(len(gpus), fn, gpus=gpus, caller_rank=caller),
                "ranch": ddip.ranch(len(gpus), fn, ctx=ddip.TorchDDPCtx(gpus=gpus), caller_rank=caller)}}
        print("RESULT " + json.dumps(out))
    """)
    n = len(gpus)
    total = float(n * (n + 1) // 2)
    listed = ",".join(visible[p] for p in gpus)
    expected = []
    for rank, pos in enumerate(gpus):
        if rank == caller:  # the notebook keeps its view and uses its own device index
            expected.append(["nccl", rank, [total, total], os.environ.get("CUDA_VISIBLE_DEVICES"), pos,
                             kernel_uuids[pos], False])
        else:  # a child: the listed GPUs in its env before Python started, device LOCAL_RANK
            expected.append(["nccl", rank, [total, total], listed, rank, kernel_uuids[pos], True])
    got = [[*v[:5], gpu_uuid(v[5]), v[6]] for v in out["ranch"]]
    assert got == expected
    launch = out["launch"]
    assert [*launch[:5], gpu_uuid(launch[5]), launch[6]] == expected[0]  # torchddp_launch: rank 0's value


@pytest.mark.parametrize("form", ["index", "uuid"])
def test_the_notebooks_cuda_visible_devices_is_the_universe(form, visible, kernel_uuids):
    # A notebook that sees only the last GPU (by its entry, or by its UUID): "all" is that one.
    if form == "uuid" and any(e.startswith("MIG-") for e in visible):
        pytest.skip("MIG devices: their UUIDs are not the GPU's")
    entry = visible[-1] if form == "index" else kernel_uuids[-1]
    out = run_fresh("""
        import json, ddip
        out = {}
        with ddip.Group(gpus="all") as g:
            out["gpus"] = g.gpus
            out["ranks"] = [r.value for r in g.run(
                "import os, torch\\n(os.environ['CUDA_VISIBLE_DEVICES'], torch.cuda.device_count(), "
                "str(torch.cuda.get_device_properties(0).uuid))")]
        try:
            ddip.Group(gpus=[1])
        except ValueError as exc:
            out["error"] = str(exc)
        print("RESULT " + json.dumps(out))
    """, env={"CUDA_VISIBLE_DEVICES": entry})
    assert out["gpus"] == [entry]
    [(cvd, count, uuid)] = out["ranks"]
    assert (cvd, count, gpu_uuid(uuid)) == (entry, 1, kernel_uuids[-1])
    assert out["error"].startswith(f"GPU 1 is not visible: the notebook sees 1 GPU (CUDA_VISIBLE_DEVICES={entry}): "
                                   f"give positions 0")


def test_the_notebooks_cuda_stays_uninitialized_while_a_gpu_group_works(ngpu, visible, kernel_uuids):
    gpus = list(range(min(ngpu, 2)))
    out = run_fresh(f"""
        import json, os, torch, ddip
        gpus = {gpus!r}
        out = {{}}
        with ddip.Group(gpus=gpus) as g:
            res = g.run("import torch\\nx = torch.ones(3, device='cuda') * 2\\nx", values=False)
            out["values"] = [r.value for r in res]
            out["shown"] = [r.format[0]["text/plain"] for r in res]
            g.push(a=torch.arange(3.0), b={{"k": 1}})
            g.run("c = (a.to('cuda') * x).cpu()\\nc_list = c.tolist()", values=False)
            out["c"] = g.pull("c").tolist()
            out["pulled"] = g.pull(["b", "c_list"], rank=len(gpus) - 1)
            rows = g.status()
            out["status"] = [[row["rank"], row["device"], row["state"]] for row in rows]
            out["gpu"] = [row["gpu"] for row in rows]
            out["own_gpu_use"] = ddip.gpus.usage([os.getpid()])
            out["initialized"] = torch.cuda.is_initialized()
        print("RESULT " + json.dumps(out))
    """)
    n = len(gpus)
    assert out["initialized"] is False
    assert out["own_gpu_use"] == {}
    assert out["values"] == [None] * n  # only the display form comes back
    assert out["shown"] == [f"tensor([2., 2., 2.], device='cuda:{r}')" for r in range(n)]
    assert out["c"] == [0.0, 2.0, 4.0]
    assert out["pulled"] == [{"k": 1}, [0.0, 2.0, 4.0]]
    assert out["status"] == [[r, f"cuda:{r} (GPU {visible[r]})", "idle"] for r in range(n)]
    for r, gpu in enumerate(out["gpu"]):
        if gpu is not None:  # nvidia-smi may not see the ranks' processes (a container)
            assert gpu["uuid"] == kernel_uuids[r] and gpu["used_mib"] > 0


def test_cpu_ranks_on_a_gpu_machine_see_no_gpu():
    with ddip.Group(n=2, backend="gloo") as g:
        assert g.apply(lambda: __import__("torch").cuda.is_available()) == [False, False]
        assert g.apply(lambda: __import__("os").environ["CUDA_VISIBLE_DEVICES"]) == ["", ""]


def test_a_gpu_that_is_not_visible_is_a_clear_error(ngpu, visible):
    from conftest import children_of

    before = children_of(os.getpid())
    with pytest.raises(ValueError) as err:
        ddip.Group(gpus=[ngpu])
    msg = str(err.value)
    assert msg.startswith(f"GPU {ngpu} is not visible: the notebook sees {ngpu} GPU")
    assert (f"positions 0-{ngpu - 1}" if ngpu > 1 else "positions 0,") in msg
    assert children_of(os.getpid()) == before


def test_gpu_ranks_are_not_forced_to_cpu_for_accelerate(ngpu):
    with ddip.Group(gpus=[0]) as g:
        env = g.apply(lambda: __import__("os").environ.get("ACCELERATE_USE_CPU"))
    assert env == [None]


def test_nccl_group_heals_after_a_rank_raises_mid_step(ngpu):
    """NCCL peers are freed only by their own abort (the heal's ABORT_SIGNAL thread)."""
    if ngpu < 2:
        pytest.skip("NCCL needs a GPU per rank: needs 2 GPUs")
    with ddip.Group(gpus=[0, 1]) as g:
        g.run("import torch, torch.distributed as dist\nx = 41")
        with pytest.raises(ddip.RemoteError) as info:
            g.run("t = torch.ones(4, device='cuda')\n"
                  "if dist.get_rank() == 1:\n    raise ValueError('bad batch')\n"
                  "dist.all_reduce(t); torch.cuda.synchronize()")
        assert info.value.failures[0].rank == 1
        assert info.value.heal is not None and info.value.heal.ok, info.value.heal
        out = g.run("t = torch.ones(2, device='cuda'); dist.all_reduce(t); t.tolist(), x")
        assert [r.value for r in out] == [([2.0, 2.0], 41)] * 2


def test_a_dead_nccl_rank_comes_back_with_the_copy_on_its_own_gpu(ngpu):
    """Issue 27: a rank killed (as the OOM killer would) is replaced by `heal(copy_from=0)`; the
    CUDA tensors copied from rank 0 land on the new rank's own GPU, and NCCL works again."""
    if ngpu < 2:
        pytest.skip("NCCL needs a GPU per rank: needs 2 GPUs")
    with ddip.Group(gpus=[0, 1]) as g:
        g.run("import os, torch, torch.distributed as dist\n"
              "w = torch.full((4,), float(dist.get_rank()) + 1, device='cuda')")
        with pytest.raises(ddip.RemoteError) as info:
            g.run("if dist.get_rank() == 1: os.kill(os.getpid(), 9)")
        assert info.value.failures[0].died and info.value.failures[0].rank == 1
        report = g.heal(copy_from=0)
        assert report.ok and list(report.replaced) == [1] and "w" in report.copied, report.describe()
        where = g.run("str(w.device), w.tolist(), torch.cuda.current_device()")
        assert [r.value for r in where] == [("cuda:0", [1.0] * 4, 0), ("cuda:1", [1.0] * 4, 1)]
        out = g.run("t = torch.ones(2, device='cuda'); dist.all_reduce(t); torch.cuda.synchronize(); t.tolist()")
        assert [r.value for r in out] == [[2.0, 2.0]] * 2


def test_an_nccl_hang_is_named_by_its_collective(ngpu):
    """Issue 27 with NCCL: rank 1 skips the all_reduce rank 0 waits in; the timed-out cell's
    message names it from the flight recorder, and heal frees rank 0."""
    if ngpu < 2:
        pytest.skip("NCCL needs a GPU per rank: needs 2 GPUs")
    with ddip.Group(gpus=[0, 1]) as g:
        g.run("import time, torch, torch.distributed as dist\nt = torch.ones(1024, device='cuda')\n"
              "dist.all_reduce(t); torch.cuda.synchronize()")
        with pytest.raises(TimeoutError) as info:
            g.run("if dist.get_rank() == 0:\n    dist.all_reduce(t); torch.cuda.synchronize()\n"
                  "else:\n    time.sleep(60)", timeout=5)
        message = str(info.value)
        assert "=> rank 1 has not entered all_reduce #2 (float32[1024]), which rank 0 has waited in" in message, message
        assert g.heal().ok
        out = g.run("t = torch.ones(2, device='cuda'); dist.all_reduce(t); torch.cuda.synchronize(); t.tolist()")
        assert [r.value for r in out] == [[2.0, 2.0]] * 2
