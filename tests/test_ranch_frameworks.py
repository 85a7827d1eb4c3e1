"""ranch with the training stacks users run — plain torch.distributed, Hugging Face's Trainer,
accelerate's Accelerator(), Lightning's strategy="ddp" — each twice in a row in one process, and
ranch's own interrupt kept out of an import in the notebook's rank. The test process plays the
notebook; the last tests do the same through a real Jupyter kernel. Tiny models built from
configs, synthetic data, 2 CPU ranks with gloo."""

from __future__ import annotations

import io
import os
import signal
import sys
import textwrap
import threading

import cloudpickle
import pytest

import ddip
import ddip.launch.oneshot
from conftest import Tee
from test_magics import running_kernel

pytest.importorskip("accelerate", reason="accelerate is a test extra (make setup installs it)")
pytest.importorskip("transformers", reason="transformers is a test extra (make setup installs it)")
pytest.importorskip("lightning", reason="lightning is a test extra (make setup installs it)")

# Functions here travel by value, as a notebook's do: children never import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def same_params(a, b):
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def falls(losses, k=3):
    return sum(losses[-k:]) / k < sum(losses[:k]) / k


def synthetic_regression(rank=0, n=64):
    import torch

    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(rank))
    return x, x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]])


def assert_notebook_is_as_found():
    import torch.distributed as dist

    assert not dist.is_initialized(), "ranch left a process group in the notebook"
    assert "RANK" not in os.environ and "ACCELERATE_USE_CPU" not in os.environ


# -- plain torch.distributed ---------------------------------------------------------------------


def ddp_that_leaves_its_group(steps=8):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # env://, from ranch's environment; never destroyed, on purpose
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = synthetic_regression(dist.get_rank())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return dist.get_world_size(), losses, params(model)


def all_reduce_rank():
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_world_size(), t.item()


def ddp_that_fails_on_rank_1():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 failed mid-training")
    dist.all_reduce(torch.ones(1))  # the notebook's rank waits for rank 1 in gloo


def test_torch_fn_that_leaves_its_process_group_runs_twice_also_after_a_failure_then_torchddp_launch_works():
    for fails in (False, True, False):
        if fails:
            with pytest.raises(ddip.RemoteError) as ei:
                ddip.ranch(2, ddp_that_fails_on_rank_1)
            assert (ei.value.failures[0].rank, ei.value.failures[0].ename) == (1, "RuntimeError")
        else:
            (w0, l0, p0), (w1, l1, p1) = ddip.ranch(2, ddp_that_leaves_its_group)
            assert w0 == w1 == 2
            assert same_params(p0, p1)  # DDP kept the ranks' weights identical
            assert falls(l0) and falls(l1), (l0, l1)
        assert_notebook_is_as_found()
    assert ddip.torchddp_launch(2, all_reduce_rank) == (2, 3.0)


def new_subgroup_in_the_notebook():
    import torch.distributed as dist

    if os.environ["RANK"] == "0":
        return dist.new_group([0]) is not None  # a group of the user's own default group
    return True


def test_a_default_group_the_notebook_had_before_is_left_alone_and_new_groups_go():
    import torch
    import torch.distributed as dist

    from ddip.rank.torchdist import process_groups

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        before = process_groups()
        assert ddip.ranch(2, new_subgroup_in_the_notebook) == [True, True]
        assert process_groups() == before  # the subgroup fn made is gone, the user's default stays
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 1.0
    finally:
        dist.destroy_process_group()


# -- Hugging Face Trainer ------------------------------------------------------------------------


def hf_trainer(outdir):
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config)
    ids = torch.randint(0, 32, (64, 8), generator=torch.Generator().manual_seed(1))
    labels = ids[:, 1] % 2  # learnable from one token
    data = [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]
    args = TrainingArguments(outdir, per_device_train_batch_size=8, num_train_epochs=4, learning_rate=3e-3,
                             logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return args.world_size, args.process_index, losses, params(model)


def test_hf_trainer_runs_twice_in_a_row(tmp_path):
    for i in range(2):
        (w0, r0, l0, p0), (w1, r1, l1, p1) = ddip.ranch(2, hf_trainer, str(tmp_path / str(i)))
        assert (w0, r0, w1, r1) == (2, 0, 2, 1)
        assert same_params(p0, p1)
        assert falls(l0), l0
        assert_notebook_is_as_found()


# -- accelerate ----------------------------------------------------------------------------------


def accelerate_train(epochs=4):
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = synthetic_regression()
    loader = DataLoader(TensorDataset(x, y, torch.arange(len(x))), batch_size=8)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses, seen = [], []
    for epoch in range(epochs):
        for xb, yb, idx in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if epoch == 0:
                seen.append(acc.gather_for_metrics(idx))
    return {"type": acc.distributed_type.value, "world": acc.num_processes, "index": acc.process_index,
            "losses": losses, "params": params(acc.unwrap_model(model)),
            "seen": sorted(torch.cat(seen).tolist())}


def test_accelerator_without_arguments_is_multi_cpu_twice_in_a_row_and_the_notebooks_own_state_returns():
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    mine = PartialState()  # the notebook's own, from before: a world of one
    assert mine.distributed_type == DistributedType.NO
    for _ in range(2):
        r0, r1 = ddip.ranch(2, accelerate_train)
        assert (r0["type"], r0["world"], r0["index"]) == ("MULTI_CPU", 2, 0)
        assert (r1["type"], r1["world"], r1["index"]) == ("MULTI_CPU", 2, 1)
        assert same_params(r0["params"], r1["params"])
        assert falls(r0["losses"]) and falls(r1["losses"])
        assert r0["seen"] == r1["seen"] == list(range(64))  # both ranks' halves, gathered
        assert_notebook_is_as_found()
        again = PartialState()
        assert (again.distributed_type, again.num_processes, again.process_index) == (DistributedType.NO, 1, 0)


def accelerate_use_cpu():
    return os.environ.get("ACCELERATE_USE_CPU")


def test_a_cpu_launch_tells_accelerate_in_the_notebooks_rank_unless_the_user_chose(monkeypatch):
    assert ddip.ranch(2, accelerate_use_cpu) == ["true", "true"]
    monkeypatch.setenv("ACCELERATE_USE_CPU", "0")
    assert ddip.ranch(2, accelerate_use_cpu)[0] == "0"


# -- Lightning -----------------------------------------------------------------------------------


def lightning_fit(epochs=3):
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.losses = []

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    x, y = synthetic_regression()
    model = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    return trainer.world_size, trainer.global_rank, model.losses, params(model)


def lightning_flags():
    from lightning.fabric.utilities import imports
    from lightning.pytorch.trainer.connectors import accelerator_connector
    from lightning_utilities.core.rank_zero import rank_zero_only

    return imports._IS_INTERACTIVE, accelerator_connector._IS_INTERACTIVE, rank_zero_only.rank


def test_lightning_ddp_runs_twice_in_a_row_in_an_interactive_notebook(monkeypatch):
    # As in a notebook: IPython's shell sets sys.ps1, so Lightning, imported there, found it.
    monkeypatch.setattr(sys, "ps1", "In : ", raising=False)
    for name, module in list(sys.modules.items()):
        if name.startswith("lightning") and hasattr(module, "_IS_INTERACTIVE"):
            monkeypatch.setattr(module, "_IS_INTERACTIVE", True)
    # The second launch, with the notebook as rank 1, has Lightning set its rank to 1 in it.
    for caller_rank in (0, 1):
        (w0, g0, l0, p0), (w1, g1, l1, p1) = ddip.ranch(2, lightning_fit, caller_rank=caller_rank)
        assert (w0, g0, w1, g1) == (2, 0, 2, 1)
        assert same_params(p0, p1)
        assert falls(l0) and falls(l1), (l0, l1)
        assert_notebook_is_as_found()
        assert sys.ps1 == "In : " and lightning_flags() == (True, True, 0)


# -- ranch's own interrupt and imports -----------------------------------------------------------


def gated_module(tmp_path, name):
    """A module whose import blocks until the test writes to its gate (a FIFO), after telling
    `started` (another FIFO) that it is under way. Returns (started, gate)."""
    started, gate = tmp_path / f"{name}.started", tmp_path / f"{name}.gate"
    os.mkfifo(started)
    os.mkfifo(gate)
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(f"""\
        HALF = True
        with open({str(started)!r}, "w"):
            pass
        with open({str(gate)!r}) as f:
            f.read()
        COMPLETE = True
    """))
    return started, gate


def import_while_a_child_fails(name, started):
    import importlib
    import time

    if os.environ["RANK"] == "1":
        with open(started):  # the notebook's rank is inside the import now
            pass
        raise ValueError("rank 1 failed during the notebook's import")
    importlib.import_module(name)
    time.sleep(120)  # then waits, in Python, for rank 1 as a training step would


def dynamo_all_reduce():
    import torch
    import torch._dynamo  # noqa: F401 - what a half-initialized import broke for good
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.timeout(90)
def test_a_child_failing_while_the_notebook_imports_waits_for_the_import(tmp_path, monkeypatch):
    name = "ddip_test_gated_import"
    started, gate = gated_module(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ddip.launch.oneshot, "INTERRUPT_NOTICE_S", 1.0, raising=False)
    err = Tee("still running fn")
    monkeypatch.setattr(sys, "stderr", err)

    done = threading.Event()

    def open_the_gate_once_told():
        err.seen.wait(60)
        try:
            os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))  # EOF for the import's read
        except OSError:
            assert done.is_set()  # ENXIO: no import waits there any more

    opener = threading.Thread(target=open_the_gate_once_told)
    opener.start()
    try:
        with pytest.raises(ddip.RemoteError) as ei:
            ddip.ranch(2, import_while_a_child_fails, name, str(started))
    finally:
        done.set()
        err.seen.set()
        opener.join()
        monkeypatch.setattr(sys, "stderr", sys.__stderr__)
    module = sys.modules.get(name)
    assert module is not None and module.COMPLETE, "the import was interrupted half-way"
    root, rest = ei.value.failures[0], ei.value.failures[1:]
    assert (root.rank, root.ename) == (1, "ValueError")
    assert [(f.rank, f.ename) for f in rest] == [(0, "Stopped")]  # interrupted after the import
    assert [f.kind for f in rest] == ["stopped"]
    assert f"ddip: rank 1 failed, but the notebook's rank 0 is still running fn: it is inside `import {name}`" \
        in err.text
    assert ddip.ranch(2, dynamo_all_reduce, ctx=ddip.TorchDDPCtx()) == [2.0, 2.0]


def import_module(name):
    import importlib

    if os.environ["RANK"] == "0":
        importlib.import_module(name)


@pytest.mark.timeout(60)
def test_the_users_ctrl_c_during_an_import_is_immediate_as_always(tmp_path, monkeypatch):
    name = "ddip_test_gated_import_ctrl_c"
    started, _ = gated_module(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    main = threading.get_ident()

    def press_ctrl_c_once_started():
        with open(started):
            pass
        signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=press_ctrl_c_once_started)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt) as ei:
            ddip.ranch(2, import_module, name)
    finally:
        t.join()
    assert name not in sys.modules  # Python's own behaviour: the user asked for it
    files = [os.path.basename(str(entry.path)) for entry in ei.traceback]
    assert f"{name}.py" in files and files[-1] != "launch.py", files  # it ends in the import, not in ddip
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def ignore_sigint_as_lightning_does_after_an_interrupt():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_sigint_handler_fn_leaves_in_the_notebook_is_undone():
    assert ddip.ranch(2, ignore_sigint_as_lightning_does_after_an_interrupt) == [True, True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.skipif(ddip.kernel.group.gpu_count() < 2, reason="needs two NVIDIA GPUs")
def test_the_notebooks_current_cuda_device_is_restored():
    import torch

    torch.cuda.set_device(0)
    ddip.ranch(2, lambda: None, ctx=ddip.TorchDDPCtx(gpus=[1, 0]))  # the notebook's rank on GPU 1
    assert torch.cuda.current_device() == 0


# -- through a real kernel -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with running_kernel(tmp_path_factory.mktemp("jupyter")) as k:
        yield k


@pytest.mark.timeout(120)
def test_in_a_kernel_a_child_failing_during_the_notebooks_import_leaves_the_kernel_working(kernel, tmp_path):
    name = "ddip_kernel_gated_import"
    started, gate = gated_module(tmp_path, name)
    setup = kernel.run(f"import sys, ddip, ddip.launch.oneshot\nsys.path.insert(0, {str(tmp_path)!r})\n"
                       f"ddip.launch.oneshot.INTERRUPT_NOTICE_S = 1.0")
    assert setup.ok, setup.outputs
    opened = []

    def open_the_gate_once_told(out):
        if not opened and out["type"] == "stream" and "still running fn" in out["text"]:
            opened.append(out["text"])
            os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))  # EOF for the import's read

    cell = kernel.run(textwrap.dedent(f"""\
        def fn():
            import importlib, os, time
            if os.environ["RANK"] == "1":
                with open({str(started)!r}):
                    pass
                raise ValueError("rank 1 failed during the notebook's import")
            importlib.import_module({name!r})
            time.sleep(120)
        ddip.ranch(2, fn)
    """), on_output=open_the_gate_once_told)
    assert opened, cell.outputs
    [error] = cell.of_type("error")
    assert error["ename"] == "RankFailedError" and "root cause on rank 1: ValueError" in error["evalue"], error
    check = kernel.run(textwrap.dedent(f"""\
        import torch
        def fn():
            import torch._dynamo, torch.distributed as dist
            t = torch.ones(1)
            dist.all_reduce(t)
            return t.item()
        print(sys.modules[{name!r}].COMPLETE, ddip.ranch(2, fn, ctx=ddip.TorchDDPCtx()))
    """))
    assert check.ok, check.outputs
    assert check.stream().strip().splitlines()[-1] == "True [2.0, 2.0]"


@pytest.mark.timeout(180)
def test_in_a_kernel_lightning_ddp_runs_twice_in_a_row(kernel):
    import inspect

    # Defined in the kernel, as a notebook would.
    source = "\n".join(inspect.getsource(f) for f in (params, synthetic_regression, lightning_fit))
    cell = kernel.run("import ddip, sys, torch\n" + source + textwrap.dedent("""
        runs = [ddip.ranch(2, lightning_fit) for _ in range(2)]
        from lightning.fabric.utilities import imports
        import torch.distributed as dist
        print([(w0, g0, w1, g1, all(torch.equal(a, b) for a, b in zip(p0, p1)), sum(l0[-3:]) < sum(l0[:3]))
               for (w0, g0, l0, p0), (w1, g1, l1, p1) in runs],
              imports._IS_INTERACTIVE, hasattr(sys, "ps1"), dist.is_initialized())
    """), timeout=170)
    assert cell.ok, cell.outputs
    last = cell.stream().strip().splitlines()[-1]
    assert last == "[(2, 0, 2, 1, True, True), (2, 0, 2, 1, True, True)] True True False", cell.stream()
