"""Heal against restart: getting a working torch.distributed back after one rank raised in a DDP
step while the other waited for it in all_reduce, keeping (heal) or losing (restart) the ranks'
state. 2 CPU ranks, gloo, a small MLP wrapped in DDP.

    .venv/bin/python bench/bench_heal.py      (or `make bench` for every bench module)

Rows (medians over REPS rounds, interleaved):
- heal by itself: from the failing `run()` call until it returns (the heal starts once torch's
  flight recorder shows the other rank waiting for the failed one; before, after FAILURE_GRACE_S,
  3 s), and the heal alone (`RemoteError.heal.seconds`);
- `g.heal()` on request, for a group whose ranks are idle;
- restart: `g.restart()` plus re-running the set-up cell (model, data, DDP wrap): what a user of
  other tools does, and their state is gone.

A dead rank (SIGKILL, as the OOM killer does): `g.heal(copy_from=0)` replaces it, with rank 0's
model, optimizer and data copied, then the model is wrapped in DDP again — beside `g.restart()` +
re-running the set-up cell. Timed from the kill to a working group.

And the flight recorder's cost (torch's, on in every rank ddip starts so that a hang is named by
its collective): bench_run's DDP training loop in a group with it on (ddip's default,
TORCH_FR_BUFFER_SIZE=256) and off (0), interleaved, FR_REPS rounds.
"""

from __future__ import annotations

import os
import signal
import statistics
import time

import ddip

REPS = 3
FR_REPS = 5
SETUP = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X = torch.randn(512, 64); Y = torch.randn(512, 1)
"""
# The model kept apart from its DDP wrapper (which does not pickle): what a copy can carry.
REPLACE_SETUP = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
model = DDP(net)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
X = torch.randn(512, 64); Y = torch.randn(512, 1)
"""
STEP = "opt.zero_grad(); torch.nn.functional.mse_loss(model(X), Y).backward(); opt.step()"
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
        ("heal by itself, the failing call end to end", med(auto)),
        ("  of which the heal (free the stuck rank, rebuild the group)", med(auto_heal)),
        ("`g.heal()` on request (idle ranks)", med(on_request)),
        ("`g.restart()` + re-run the set-up cell (state lost)", med(restart)),
    ]
    out = ["## Heal vs restart (2 CPU ranks, gloo, DDP)", "",
           "| | seconds | vs restart |", "|---|---|---|"]
    for name, sec in rows:
        out.append(f"| {name} | {sec:.3f} | {sec / med(restart):.2f}x |")
    return "\n".join(out) + "\n\n" + replace_vs_restart() + "\n" + flight_recorder_cost()


def flight_recorder_cost() -> str:
    """steps/s and rank 0's CPU per step of the same DDP loop, flight recorder on and off."""
    import re

    from bench_run import TRAIN

    runs = {"on": [], "off": []}
    for rep in range(FR_REPS):
        for name in (("on", "off") if rep % 2 == 0 else ("off", "on")):
            env = {} if name == "on" else {"TORCH_FR_BUFFER_SIZE": "0"}
            with ddip.Group(n=2, backend="gloo", env=env) as g:
                out = g.run(TRAIN, timeout=600)[0].stdout
            m = re.search(r"STEPS_PER_S ([0-9.]+) CPU_MS_PER_STEP ([0-9.]+)", out)
            runs[name].append((float(m.group(1)), float(m.group(2))))
    med = statistics.median
    rate = {k: med(r for r, _ in v) for k, v in runs.items()}
    cpu = {k: med(c for _, c in v) for k, v in runs.items()}
    out = ["## The flight recorder's cost per training step (2 CPU ranks, gloo, DDP)", "",
           "| bench_run's DDP loop in a Group | recorder on (ddip's default) | off (`TORCH_FR_BUFFER_SIZE=0`) "
           "| on / off |", "|---|---|---|---|",
           f"| steps/s | {rate['on']:.1f} | {rate['off']:.1f} | {rate['on'] / rate['off']:.3f}x |",
           f"| rank 0's CPU time per step | {cpu['on']:.3f} ms | {cpu['off']:.3f} ms | "
           f"{cpu['on'] / cpu['off']:.3f}x |", "",
           f"Medians of {FR_REPS} runs each, interleaved; spread of steps/s: on "
           f"{min(r for r, _ in runs['on']):.1f}-{max(r for r, _ in runs['on']):.1f}, off "
           f"{min(r for r, _ in runs['off']):.1f}-{max(r for r, _ in runs['off']):.1f}."]
    return "\n".join(out) + "\n"


def _kill_rank_1(g):
    os.kill(g.pids[1], signal.SIGKILL)
    while next(r["state"] for r in g.status() if r["rank"] == 1) != "dead":
        time.sleep(0.001)


def replace_vs_restart() -> str:
    """From a SIGKILL of rank 1 to a group that trains again: replaced (rank 0's state copied) or
    restarted (set-up run again)."""
    replaced, restarted, heals = [], [], []
    with ddip.Group(n=2, backend="gloo") as g:
        g.run(REPLACE_SETUP)
        g.run(STEP)
        for _ in range(REPS):
            t = time.perf_counter()
            _kill_rank_1(g)
            report = g.heal(copy_from=0)
            g.run("model = DDP(net)\n" + STEP)
            replaced.append(time.perf_counter() - t)
            heals.append(report.seconds)
            t = time.perf_counter()
            _kill_rank_1(g)
            g.restart()
            g.run(REPLACE_SETUP + STEP)
            restarted.append(time.perf_counter() - t)
    med = statistics.median
    return "\n".join([
        "## A dead rank: replaced with a copy, or restart (2 CPU ranks, gloo, DDP)", "",
        "| from SIGKILL of rank 1 to a group that trains again | seconds | vs restart |", "|---|---|---|",
        f"| `g.heal(copy_from=0)` + wrap in DDP again (survivor's state kept, copied to the new rank) "
        f"| {med(replaced):.3f} | {med(replaced) / med(restarted):.2f}x |",
        f"|   of which the heal (new rank forked, state copied, group rebuilt) | {med(heals):.3f} | "
        f"{med(heals) / med(restarted):.2f}x |",
        f"| `g.restart()` + re-run the set-up cell (every rank's state lost) | {med(restarted):.3f} | 1.00x |",
        "", f"Medians of {REPS} rounds, interleaved."]) + "\n"


if __name__ == "__main__":
    print(main())
