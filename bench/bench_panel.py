"""What the live rank panel costs the ranks (issue 35): DDP steps/s of 2 gloo CPU ranks with the
panel's sampling running beside the loop and without it, rounds interleaved so that other load on
the machine hits both alike. The sampling is the panel's while a rank is busy (kernel/panel.py's
Sampler, every panel_view.EVERY_S): /proc and nvidia-smi read in the notebook, each rank's flight
recorder asked (answered on its runtime thread, as %dipstack's question is). No widget is drawn
here: drawing happens in the notebook, not in the ranks."""

from __future__ import annotations

import statistics
import threading

import ddip
from ddip.kernel.panel import Sampler
from ddip.kernel.panel_view import EVERY_S

REPS = 5
SECONDS = 4.0
SETUP = """
import time, torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X = torch.randn(512, 64); Y = torch.randn(512, 1)
"""
# Steps in SECONDS; every rank stops at the step count rank 0 reached (a collective decides), so
# no rank waits in an all_reduce the others left.
LOOP = f"""
steps, t0 = 0, time.perf_counter()
while True:
    opt.zero_grad(); torch.nn.functional.mse_loss(model(X), Y).backward(); opt.step(); steps += 1
    go = torch.tensor([float(time.perf_counter() - t0 < {SECONDS})])
    torch.distributed.all_reduce(go, op=torch.distributed.ReduceOp.MIN)
    if not go.item():
        break
steps / (time.perf_counter() - t0)
"""


def steps_per_s(g, panel: bool) -> tuple[float, int]:
    """(rank 0's steps/s, how many samples the panel took meanwhile)."""
    done, samples = threading.Event(), [0]

    def sample():
        sampler = Sampler(g)
        while not done.wait(EVERY_S):
            sampler.sample(ask=True)
            samples[0] += 1

    watcher = threading.Thread(target=sample, daemon=True) if panel else None
    if watcher:
        watcher.start()
    try:
        rate = g.run(LOOP, timeout=120)[0].value
    finally:
        done.set()
        if watcher:
            watcher.join()
    return rate, samples[0]


def main() -> str:
    runs = {"without the panel": [], "with the panel open": []}
    taken = []
    with ddip.Group(n=2, backend="gloo") as g:
        g.run(SETUP)
        steps_per_s(g, False)  # warm-up
        for rep in range(REPS):
            for name in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
                rate, samples = steps_per_s(g, name == "with the panel open")
                runs[name].append(rate)
                if samples:
                    taken.append(samples)
    base = statistics.median(runs["without the panel"])
    out = ["## The live rank panel's cost to the ranks (2 CPU ranks, gloo, DDP)", "",
           f"Median of {REPS} rounds of {SECONDS:g} s each, interleaved; the panel sampled every {EVERY_S:g} s "
           f"({statistics.median(taken) if taken else 0:.0f} samples a round).", "",
           "| | DDP steps/s (rank 0) | vs without | spread |", "|---|---|---|---|"]
    for name, rates in runs.items():
        med = statistics.median(rates)
        out.append(f"| {name} | {med:.1f} | {med / base:.3f}x | {min(rates):.1f}-{max(rates):.1f} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(main())
