"""Writes examples/quickstart.ipynb (the source of truth for its cells is here)."""

import nbformat

cells = [
    ("markdown", """# ddip quick start

Train a small PyTorch model with **DistributedDataParallel** on a group of 2 CPU processes, without
leaving the notebook. On a machine with GPUs, use `%makedip -g all` (or `-g 0,3`) instead of `-n 2`."""),
    ("code", "%load_ext ddip"),
    ("markdown", "Start a persistent group of 2 ranks. Each rank has `torch.distributed` initialized "
                 "(gloo on CPU, NCCL on GPUs) and torchrun's environment variables."),
    ("code", "%makedip -n 2 --backend gloo\n%makedip -i"),
    ("markdown", "`%%dip` runs a cell on every rank. By default you see rank 0's output; `--see all` shows every rank."),
    ("code", """%%dip --see all
import os, torch, torch.distributed as dist
print(f"rank {dist.get_rank()} of {dist.get_world_size()}, RANK={os.environ['RANK']}, pid={os.getpid()}")"""),
    ("markdown", "Synthetic data (two Gaussian blobs), a `DistributedSampler` so each rank trains on its own shard, and a DDP model."),
    ("code", """%%dip
import torch, torch.nn as nn
from torch.utils.data import TensorDataset, DataLoader, DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP

g = torch.Generator().manual_seed(0)               # same data on every rank
X = torch.cat([torch.randn(512, 2, generator=g) + 2, torch.randn(512, 2, generator=g) - 2])
y = torch.cat([torch.ones(512), torch.zeros(512)]).long()
data = TensorDataset(X, y)
sampler = DistributedSampler(data, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=64, sampler=sampler)

torch.manual_seed(0)                               # same initial weights on every rank
model = DDP(nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = nn.CrossEntropyLoss()
print(f"{len(sampler)} of {len(data)} samples on this rank")"""),
    ("code", """%%dip
for epoch in range(5):
    sampler.set_epoch(epoch)
    total = torch.zeros(2)
    for xb, yb in loader:
        opt.zero_grad()
        loss = loss_fn(model(xb), yb)
        loss.backward()                              # gradients are all-reduced by DDP
        opt.step()
        total += torch.tensor([loss.item() * len(xb), len(xb)])
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        print(f"epoch {epoch}: loss {total[0] / total[1]:.4f}")"""),
    ("markdown", "Accuracy over every rank's shard, all-reduced; the last expression shows up as `Out[rank:n]`."),
    ("code", """%%dip
with torch.no_grad():
    counts = torch.zeros(2)
    for xb, yb in DataLoader(data, batch_size=256, sampler=DistributedSampler(data, shuffle=False)):
        counts += torch.tensor([(model(xb).argmax(1) == yb).sum().item(), len(yb)])
dist.all_reduce(counts)
accuracy = (counts[0] / counts[1]).item()
f"accuracy {accuracy:.3f} on {int(counts[1])} samples\""""),
    ("markdown", "Bring a result back into the notebook, then stop the group."),
    ("code", "%dipull accuracy\nprint(f'accuracy in the notebook: {accuracy:.3f}')"),
    ("code", "%makedip -k"),
]

nb = nbformat.v4.new_notebook()
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
            for kind, src in cells]
nbformat.write(nb, "examples/quickstart.ipynb")
