"""Heal against restart: getting a working torch.distributed back after one rank raised in a DDP
step while the other waited for it in all_reduce, keeping (heal) or losing (restart) the ranks'
state. 2 CPU ranks, gloo, a small MLP wrapped in DDP.

    .venv/bin/python bench/bench_heal.py      (or `make bench` for every bench module)

Rows (medians over REPS rounds, interleaved):
- heal by itself: from the failing `run()` call until it returns (includes the 3 s grace the
  others get to finish, FAILURE_GRACE_S), and the heal alone (`RemoteError.heal.seconds`);
- `g.heal()` on request, for a group whose ranks are idle;
- restart: `g.restart()` plus re-running the set-up cell (model, data, DDP wrap): what a user of
  other tools does, and their state is gone.
"""

from __future__ import annotations

import statistics
import time

import ddip

REPS = 3
SETUP = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X = torch.randn(512, 64); Y = torch.randn(512, 1)
"""
FAILING_STEP = """
loss = torch.nn.functional.mse_loss(model(X), Y)
if dist.get_rank() == 1:
    raise ValueError("bad batch")
loss.backward()
"""


def main() -> str:
    auto, auto_heal, on_request, restart = [], [], [], []
    with ddip.Group(n=2, backend="gloo") as g:
        g.run(SETUP)
        for _ in range(REPS):
            t = time.perf_counter()
            try:
                g.run(FAILING_STEP)
                raise RuntimeError("the failing step did not fail")
            except ddip.RemoteError as exc:
                if exc.heal is None or not exc.heal.ok:
                    raise RuntimeError(f"no heal: {exc.heal}") from None
                auto.append(time.perf_counter() - t)
                auto_heal.append(exc.heal.seconds)
            g.run("model = DDP(model.module)")
            t = time.perf_counter()
            g.heal()
            on_request.append(time.perf_counter() - t)
            g.run("model = DDP(model.module)")
            t = time.perf_counter()
            g.restart()
            g.run(SETUP)
            restart.append(time.perf_counter() - t)
    med = statistics.median
    rows = [
        ("heal by itself, the failing call end to end (3 s grace included)", med(auto)),
        ("  of which the heal (free the stuck rank, rebuild the group)", med(auto_heal)),
        ("`g.heal()` on request (idle ranks)", med(on_request)),
        ("`g.restart()` + re-run the set-up cell (state lost)", med(restart)),
    ]
    out = ["## Heal vs restart (2 CPU ranks, gloo, DDP)", "",
           "| | seconds | vs restart |", "|---|---|---|"]
    for name, sec in rows:
        out.append(f"| {name} | {sec:.3f} | {sec / med(restart):.2f}x |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(main())
