"""The stacks users train with, unchanged, in a notebook's group (`%%dip`, through a real
kernel), in `%%diprun` and in `ddip run`: Lightning's strategy="ddp", Hugging Face's Trainer,
accelerate's Accelerator(), FSDP2 with torch.distributed.checkpoint across cells, torch.compile
and DataLoader workers in warm ranks. 2 CPU ranks, gloo, tiny models, synthetic data.

Each check is about training: world size 2, each rank its own place, identical parameters on
every rank afterwards, a falling loss, both ranks' data in gathered metrics."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ddip.errors import strip_ansi
from test_magics import running_kernel

pytest.importorskip("torch")

DDIP = os.path.join(os.path.dirname(sys.executable), "ddip")


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    with running_kernel(tmp_path_factory.mktemp("frameworks")) as kernel:
        cell = kernel.run("%makedip -n 2")
        assert cell.ok, cell.outputs
        yield kernel
        kernel.run("%makedip -k")


def dip(k, code: str, timeout: float = 240):
    """Runs a %%dip cell that sets `res` on every rank; returns [rank 0's res, rank 1's res]."""
    cell = k.run("%%dip --see all\n" + code, timeout=timeout)
    assert cell.ok, [strip_ansi(str(o))[-3000:] for o in cell.outputs]
    pulled = k.run("%dipull res\n_r0 = res\n%dipull -r 1 res\nimport json; print(json.dumps([_r0, res]))")
    assert pulled.ok, pulled.outputs
    return json.loads(pulled.stream().strip().splitlines()[-1]), cell


PARAMS = "[[round(v, 6) for v in p.detach().flatten().tolist()] for p in {}.parameters()]"

LIGHTNING = """
import os, torch, lightning as L
torch.manual_seed(0)
X = torch.randn(256, 4); Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
class Reg(L.LightningModule):
    def __init__(self):
        super().__init__(); self.net = torch.nn.Linear(4, 1); self.losses = []
    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
model = Reg()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16))
res = {"world": trainer.world_size, "rank": trainer.global_rank, "params": PARAMS,
       "first": model.losses[0], "last": model.losses[-1], "steps": len(model.losses)}
"""


def test_lightning_ddp_in_dip(k):
    (r0, r1), _ = dip(k, LIGHTNING.replace("PARAMS", PARAMS.format("model")))
    assert (r0["world"], r1["world"]) == (2, 2) and (r0["rank"], r1["rank"]) == (0, 1)
    assert r0["steps"] == r1["steps"] == 24  # 256 samples / 2 ranks / 16 per batch * 3 epochs
    assert r0["params"] == r1["params"]  # DDP kept the weights identical
    assert r0["last"] < r0["first"] / 10, (r0["first"], r0["last"])


def test_dipstack_and_heal_after_lightning_fit(k):
    # Lightning's teardown puts SIG_DFL back over handlers installed in C (ddip's real-time ones):
    # asking for stacks, or a heal, must still never kill a rank.
    dip(k, LIGHTNING.replace("PARAMS", PARAMS.format("model")))
    cell = k.run("%dipstack -r 0")
    text = strip_ansi(cell.stream())
    assert cell.ok and "most recent call first" in text and "dead" not in text, cell.outputs
    # The heal example of docs/magics.md: rank 1 raises while rank 0 waits in a collective.
    cell = k.run("%%dip\nimport torch.distributed as dist\n"
                 "if dist.get_rank() == 1: raise ValueError('bad batch on rank 1')\n"
                 "dist.all_reduce(torch.ones(1))")
    err = strip_ansi(cell.stream("stderr"))
    assert not cell.ok and "ddip healed the group" in err, err
    cell = k.run("%%dip --see all\nt = torch.ones(1); dist.all_reduce(t); t.item()")
    assert cell.ok and re.findall(r"Out\[(\d):\d+\]: 2\.0", "\n".join(cell.plain)) == ["0", "1"], cell.outputs


def test_rank_looks_launched_but_ipython_features_work(k):
    (r0, r1), cell = dip(k, "import sys\nres = [hasattr(sys, 'ps1'), bool(sys.flags.interactive)]\n"
                            "%time x = sum(range(1000))\nfrom IPython.display import display\ndisplay('shown')")
    assert r0 == r1 == [False, False]
    text = cell.stream()
    assert "Wall time" in text  # %time still works
    assert sum("'shown'" in p for p in cell.plain) == 2


def test_accelerator_without_arguments_in_dip(k):
    (r0, r1), cell = dip(k, """
import torch
from accelerate import Accelerator
acc = Accelerator()
torch.manual_seed(0)
X = torch.randn(128, 4); Y = X.sum(1, keepdim=True)
model = torch.nn.Linear(4, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16, shuffle=True)
model, opt, dl = acc.prepare(model, opt, dl)
losses = []
for epoch in range(3):
    for x, y in dl:
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss); opt.step(); opt.zero_grad(); losses.append(loss.item())
seen = acc.gather_for_metrics(torch.tensor([acc.process_index]))
acc.print("printed once, by the main process")
res = {"type": str(acc.distributed_type), "index": acc.process_index, "n": acc.num_processes,
       "seen": seen.tolist(), "params": PARAMS, "first": losses[0], "last": losses[-1]}
""".replace("PARAMS", PARAMS.format("acc.unwrap_model(model)")))
    assert r0["type"] == r1["type"] == "DistributedType.MULTI_CPU"
    assert (r0["index"], r1["index"]) == (0, 1) and r0["n"] == r1["n"] == 2
    assert r0["seen"] == r1["seen"] == [0, 1]  # both ranks' data in gathered metrics
    assert r0["params"] == r1["params"]
    assert r0["last"] < r0["first"] / 4
    assert cell.stream().count("printed once, by the main process") == 1


def test_hugging_face_trainer_in_dip(k, tmp_path):
    (r0, r1), _ = dip(k, f"""
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
torch.manual_seed(0)
cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=16)
model = BertForSequenceClassification(cfg)
ids = torch.randint(1, 64, (256, 8))
labels = (ids[:, 0] < 32).long()  # learnable: the first token decides
class DS(torch.utils.data.Dataset):
    def __len__(self): return len(ids)
    def __getitem__(self, i): return {{"input_ids": ids[i], "labels": labels[i]}}
args = TrainingArguments(output_dir={str(tmp_path)!r}, per_device_train_batch_size=16, max_steps=30,
                         learning_rate=5e-3, logging_steps=5, save_strategy="no", report_to=[],
                         disable_tqdm=True, seed=0)
trainer = Trainer(model=model, args=args, train_dataset=DS())
trainer.train()
logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
res = {{"world": args.world_size, "index": args.process_index, "params": PARAMS,
       "first": logged[0], "last": logged[-1]}}
""".replace("PARAMS", "[round(float(p.detach().sum()), 5) for p in model.parameters()]"))
    assert r0["world"] == r1["world"] == 2 and (r0["index"], r1["index"]) == (0, 1)
    assert r0["params"] == r1["params"]
    assert r0["last"] < r0["first"], (r0["first"], r0["last"])


def test_fsdp2_checkpoint_saved_in_one_cell_loads_in_a_later_one(k, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    (r0, r1), _ = dip(k, f"""
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict, StateDictOptions
def make():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    fully_shard(m[0]); fully_shard(m[2]); fully_shard(m)
    return m
fsdp = make()
opt = torch.optim.SGD(fsdp.parameters(), lr=0.05)
torch.manual_seed(dist.get_rank())
for _ in range(5):
    x = torch.randn(16, 8); loss = fsdp(x).pow(2).mean(); loss.backward(); opt.step(); opt.zero_grad()
full = get_model_state_dict(fsdp, options=StateDictOptions(full_state_dict=True))
trained = {{k: v.sum().item() for k, v in full.items()}}
dcp.save({{"model": get_model_state_dict(fsdp)}}, checkpoint_id={ckpt!r})
res = trained
""")
    assert r0 == r1  # the full state dict is the same, gathered on either rank
    (l0, l1), _ = dip(k, f"""
fresh = make()
state = {{"model": get_model_state_dict(fresh)}}
dcp.load(state, checkpoint_id={ckpt!r})
set_model_state_dict(fresh, state["model"])
full = get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True))
res = {{k: v.sum().item() for k, v in full.items()}}
""")
    assert l0 == l1 == r0  # the later cell's fresh model holds exactly the trained weights


def test_compile_and_dataloader_workers_in_warm_ranks(k):
    (r0, r1), _ = dip(k, """
import torch, ddip.worker
@torch.compile
def f(x):
    return torch.sin(x) * 2 + x
x = torch.linspace(0, 1, 64)
ok = torch.allclose(f(x), torch.sin(x) * 2 + x)
dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(100.0)), batch_size=10, num_workers=2)
total = sum(b[0].sum().item() for b in dl)
res = {"compiled": bool(ok), "total": total, "forked": os.environ.get("DDIP_SLOT") is not None}
""")
    assert r0 == r1 == {"compiled": True, "total": 4950.0, "forked": True}


def _lightning_script(path):
    path.write_text(LIGHTNING.replace("PARAMS", PARAMS.format("model")) +
                    "import json\nprint('RESULT', json.dumps(res), flush=True)\n")


def test_lightning_ddp_in_diprun(k, tmp_path):
    script = tmp_path / "train_lightning.py"
    _lightning_script(script)
    cell = k.run(f"%%diprun -n 2\n{script.read_text()}", timeout=240)
    assert cell.ok, [strip_ansi(str(o))[-2000:] for o in cell.outputs]
    found = re.findall(r"\[(\d)\] RESULT (\{.*\})", strip_ansi(cell.stream()))
    results = {int(r): json.loads(v) for r, v in found}
    assert sorted(results) == [0, 1]
    assert results[0]["world"] == results[1]["world"] == 2 and results[1]["rank"] == 1
    assert results[0]["params"] == results[1]["params"]
    assert results[0]["last"] < results[0]["first"] / 10


def test_accelerate_in_ddip_run(tmp_path):
    script = tmp_path / "acc.py"
    script.write_text("import json, torch\nfrom accelerate import Accelerator\nacc = Accelerator()\n"
                      "seen = acc.gather(torch.tensor([acc.process_index]))\n"
                      "print('RESULT', json.dumps([str(acc.distributed_type), acc.num_processes, seen.tolist()]))\n"
                      # Joins gloo's threads while Python is alive: one left to finish the gather
                      # as Python shuts down aborts the rank (terminate called without an active
                      # exception), as under torchrun.
                      "acc.end_training()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_CPU", "CUDA_VISIBLE_DEVICES")}
    proc = subprocess.run([DDIP, "run", "-n", "2", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Each rank's RESULT line; the two alike come as one, "[0,1] RESULT ..." (ddip run collapses repeats).
    found = sorted((r, v) for ranks, v in re.findall(r"\[([\d,]+)\] RESULT (.*)", proc.stdout)
                   for r in ranks.split(","))
    assert [json.loads(v) for _, v in found] == [["DistributedType.MULTI_CPU", 2, [0, 1]]] * 2
