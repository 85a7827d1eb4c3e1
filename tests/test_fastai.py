"""fastai v2 distributed training in ddip ranks: a tiny Learner on synthetic data, 2 CPU ranks
with gloo, through ranch(ctx=ddip.apps.fastai.ctx()) and through a Group set up by setup_group()."""

import io
import os
import re
import sys

import cloudpickle
import pytest

import ddip
from conftest import render

fastai = pytest.importorskip("fastai", reason="fastai is not installed (make setup installs it)")
pytest.importorskip("accelerate", reason="fastai's distributed training needs accelerate")
import ddip.apps.fastai as ddip_fastai  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def fit_tiny_learner(epochs=8):
    """Linear regression y = 3x - 1 (+ noise) with a fastai Learner under learn.distrib_ctx()."""
    import torch
    from fastai.data.core import DataLoaders
    from fastai.distributed import DistributedTrainer  # noqa: F401 - patches Learner.distrib_ctx
    from fastai.learner import Learner
    from fastai.losses import MSELossFlat
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)  # same data and same initial weights on every rank
    x = torch.randn(256, 1)
    y = 3 * x - 1 + 0.05 * torch.randn(256, 1)
    train, valid = TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:])
    dls = DataLoaders(DataLoader(train, batch_size=16, shuffle=True), DataLoader(valid, batch_size=32))
    model = torch.nn.Linear(1, 1)
    before = [p.detach().clone().flatten().tolist() for p in model.parameters()]
    learn = Learner(dls, model, loss_func=MSELossFlat(), lr=0.3)
    with learn.distrib_ctx():
        assert isinstance(learn.model, torch.nn.Linear)  # DDP wraps it only during fit
        learn.fit(epochs)
    after = [p.detach().flatten().tolist() for p in learn.model.parameters()]
    return {"rank": int(os.environ["RANK"]), "before": before, "after": after,
            "valid_loss": learn.recorder.values[-1][1] if learn.recorder.values else None,
            "cbs": sorted(type(cb).__name__ for cb in learn.cbs)}


def test_fastai_learner_trains_with_ddp_across_two_cpu_ranks(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    res = ddip.ranch(2, fit_tiny_learner, ctx=ddip_fastai.ctx())
    monkeypatch.undo()
    assert [r["rank"] for r in res] == [0, 1]
    assert res[0]["before"] == res[1]["before"]
    assert res[0]["after"] == res[1]["after"]  # DDP kept the ranks' weights identical
    [[w0], [b0]] = res[0]["after"]
    assert abs(w0 - 3) < 0.6 and abs(b0 + 1) < 0.6, res[0]["after"]  # it learned y = 3x - 1
    assert res[0]["valid_loss"] < 0.5
    text = "\n".join(render(out.getvalue()))  # as a notebook or a terminal shows it
    # Metrics come from rank 0 (the notebook) only: fastai drops them from the other ranks.
    assert re.search(r"epoch\s+train_loss\s+valid_loss", text), text
    assert len(re.findall(r"\b7\s+\d+\.\d+\s+\d+\.\d+\s+\d\d:\d\d", text)) == 1  # last epoch's row, once
    assert "[rank 1]" not in text
    assert "ProgressCallback" in res[0]["cbs"]
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_setup_group_prepares_a_persistent_group_for_fastai():
    with ddip.Group(n=2, backend="gloo") as g:
        ddip_fastai.setup_group(g)
        assert g.run("hasattr(Learner, 'distrib_ctx'), DistributedTrainer.__name__, "
                     "os.environ['ACCELERATE_USE_CPU']")[0].value == (True, "DistributedTrainer", "true")
        res = g.apply(fit_tiny_learner, 2)
    assert res[0]["after"] == res[1]["after"] and res[0]["before"] == res[1]["before"]
    assert res[0]["after"] != res[0]["before"]
