"""`ddip run` against torchrun: launch overhead, and steps/s of a DDP training loop, measured in
the same run.

    .venv/bin/python bench/bench_run.py      (or `make bench` for every bench module)

Launch, 2 processes, each timed from the start of the command until it has exited:
- empty: a script that does nothing.
- all_reduce: a script written for torchrun: init_process_group("gloo") from env://, one
  all_reduce of a 4-float tensor (its sum checked), destroy_process_group; each rank prints how
  long its init_process_group took, so the spread shows whether a rank ever waits out torch's
  store-connect back-off (0.5-0.7 s; issue 32's "no slow mode any more").
One node: `python -m torch.distributed.run --nproc-per-node 2 --master-port PORT SCRIPT`
(torchrun, with a free port so that nothing else on the machine collides with its default) and
`ddip run` with the same command line (`ddip run --nproc-per-node 2 --master-port PORT SCRIPT`,
the installed native command), also with DDIP_RUN_HOOK=0; and, for scale, two plain
`python SCRIPT` processes started together by this process (with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set by hand): what any launcher must pay at least.
Two nodes: two launchers started together on this machine, one per "node", with torchrun's
static rendezvous on loopback: `LAUNCHER --nnodes 2 --node-rank K --master-addr 127.0.0.1
--master-port PORT --nproc-per-node 1 SCRIPT` for K = 0, 1, LAUNCHER being `ddip run` or
torchrun; timed from their start to the exit of both. OMP_NUM_THREADS=1 for both (with one rank
per node torchrun sets none). Every tool's order turns every round.

Training: the same 2-rank DDP loop (an MLP 256-512-512-10, batch 64 of synthetic data, SGD,
gloo) run 300 timed steps after 30 warm-up steps, between two barriers; rank 0 reports steps/s.
Run as a script, it ends with os._exit(0) after destroy_process_group(): torch 2.13's DDP keeps
gloo's threads alive past it, and one that drops a collective's tensors while Python shuts down
aborts the rank after its work (docs/run.md; torchrun's rank 0 did so in a `make bench` run).
Under `ddip run`, under torchrun, and in a `ddip.Group(n=2)` with `g.run(code)` (the group joins
gloo itself), each with its own default OMP_NUM_THREADS: 1 for 2 ranks on this machine for all
three (torchrun and `ddip run` set 1; a group divides the cores among its ranks); and on two
nodes of one rank each under both launchers, as above. The five run in turn, in an order that
turns every round; the ratios reported are the medians of the ratios within each round (runs
seconds apart, under the same load).

The tools run interleaved, so load on the machine hits them alike. Clean-up: after every launch,
each descendant of this process still there after a grace period is killed by pid (psutil
checks the pid still names the same process); the count is printed.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from common import GRACE_S, kill_leftovers

LAUNCH_REPS = 5  # timed launches per tool, after one untimed warm-up each
ALL_REDUCE_REPS = 5
TRAIN_REPS = 3  # odd, so the median of the per-round ratios is one round's
STEPS, WARMUP = 300, 30

DDIP = str(Path(sys.executable).with_name("ddip"))
PY = sys.executable

EMPTY = ""

ALL_REDUCE = """\
import time

import torch
import torch.distributed as dist

t0 = time.perf_counter()
dist.init_process_group("gloo")
init_s = time.perf_counter() - t0
t = torch.ones(4)
dist.all_reduce(t)
assert t.tolist() == [float(dist.get_world_size())] * 4, t
print(f"INIT_S {init_s:.4f}", flush=True)
dist.destroy_process_group()
"""

TRAIN = f"""\
import os
import sys
import time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

own_group = not dist.is_initialized()
if own_group:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(
    torch.nn.Linear(256, 512), torch.nn.ReLU(),
    torch.nn.Linear(512, 512), torch.nn.ReLU(),
    torch.nn.Linear(512, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = torch.nn.CrossEntropyLoss()
g = torch.Generator().manual_seed(dist.get_rank())
x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)

def step():
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()

for _ in range({WARMUP}):
    step()
dist.barrier()
t0, c0 = time.perf_counter(), time.process_time()
for _ in range({STEPS}):
    step()
cpu = time.process_time() - c0  # this rank's CPU time, all its threads (gloo's too)
dist.barrier()
rate = {STEPS} / (time.perf_counter() - t0)
if dist.get_rank() == 0:
    print(f"STEPS_PER_S {{rate:.3f}} CPU_MS_PER_STEP {{cpu * 1000 / {STEPS}:.4f}}", flush=True)
if own_group:
    dist.destroy_process_group()
    # torch 2.13's DDP model keeps the group's gloo threads past destroy_process_group(), and one
    # that drops a finished collective's tensors during Python's shutdown aborts the rank
    # (docs/run.md): this script ends without that shutdown, its result printed and flushed.
    sys.stderr.flush()
    os._exit(0)
"""


def _log(msg: str):
    print(f"[bench_run] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    from ddip.kernel.group import free_port

    return free_port()


def _env() -> dict:
    # Each launcher decides OMP_NUM_THREADS for its ranks (both pick 1 for 2 ranks); a value
    # inherited from here would override that for one and not the other.
    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


def _check(p: subprocess.CompletedProcess, what: str) -> str:
    if p.returncode != 0:
        raise RuntimeError(f"{what} exited with {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p.stdout


def ddip_run(script: str, env: dict | None = None) -> str:
    # torchrun's own command line, the launcher's name changed (ddip run takes it since issue 32).
    p = subprocess.run([DDIP, "run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
                        script], capture_output=True, text=True,
                       env=dict(_env(), **(env or {})), timeout=600)
    return _check(p, "ddip run")


def ddip_run_unhooked(script: str) -> str:
    """ddip run without its startup hook in the ranks (DDIP_RUN_HOOK=0): what the hook costs."""
    return ddip_run(script, {"DDIP_RUN_HOOK": "0"})


def torchrun(script: str) -> str:
    p = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(_free_port()), script],
                       capture_output=True, text=True, env=_env(), timeout=600)
    return _check(p, "torchrun")


def _two_nodes(launcher: list[str], what: str, script: str) -> str:
    """Two launchers, one per "node" (both on this machine, on loopback), started together with
    torchrun's static rendezvous: node 0 hosts the job at a free --master-port. Returns their
    stdout together once both have exited. OMP_NUM_THREADS=1 for both launchers: with
    --nproc-per-node 1 torchrun sets no limit, and two ranks with two threads each would share 2
    cores."""
    port = str(_free_port())
    procs = [subprocess.Popen(launcher + ["--nnodes", "2", "--node-rank", str(k), "--master-addr",
                                          "127.0.0.1", "--master-port", port, "--nproc-per-node",
                                          "1", script],
                              env=dict(_env(), OMP_NUM_THREADS="1"), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for k, (p, (out, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise RuntimeError(f"{what}, node {k}, exited with {p.returncode}:\n{out[-2000:]}\n"
                               f"{err[-2000:]}")
    return "".join(out for out, _ in outs)


def ddip_run_2nodes(script: str) -> str:
    return _two_nodes([DDIP, "run"], "ddip run --nnodes 2", script)


def torchrun_2nodes(script: str) -> str:
    return _two_nodes([PY, "-m", "torch.distributed.run"], "torchrun --nnodes 2", script)


def plain(script: str) -> str:
    port = str(_free_port())
    procs = []
    for r in range(2):
        env = dict(_env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([PY, script], env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"plain python exited with {p.returncode}:\n{err[-2000:]}")
        outs.append(out)
    return "".join(outs)


def _inits(out: str) -> list[float]:
    """Each rank's init_process_group time in seconds, from an all_reduce run's output."""
    found = [float(x) for x in re.findall(r"INIT_S ([0-9.]+)", out)]
    if len(found) != 2:
        raise RuntimeError(f"expected 2 ranks' INIT_S in the output, found {len(found)}:\n{out[-2000:]}")
    return found


def _rate(out: str) -> tuple[float, float]:
    """(steps/s, rank 0's CPU milliseconds per step) from a training run's output."""
    m = re.search(r"STEPS_PER_S ([0-9.]+) CPU_MS_PER_STEP ([0-9.]+)", out)
    if not m:
        raise RuntimeError(f"no STEPS_PER_S in the output:\n{out[-2000:]}")
    return float(m.group(1)), float(m.group(2))


def main() -> str:
    import ddip

    me = psutil.Process()
    killed = 0
    workdir = Path(tempfile.mkdtemp(prefix="ddip-bench-run-"))
    scripts = {}
    for name, body in (("empty", EMPTY), ("all_reduce", ALL_REDUCE), ("train", TRAIN)):
        scripts[name] = str(workdir / f"{name}.py")
        Path(scripts[name]).write_text(body)

    tools = [("ddip run", ddip_run), ("ddip run, no hook", ddip_run_unhooked), ("torchrun", torchrun),
             ("2x plain python", plain), ("ddip run, 2 nodes", ddip_run_2nodes),
             ("torchrun, 2 nodes", torchrun_2nodes)]
    times = {(t, k): [] for t, _ in tools for k in ("empty", "all_reduce")}
    inits = {t: [] for t, _ in tools}  # every rank's init_process_group seconds, all_reduce runs
    for kind, reps in (("empty", LAUNCH_REPS), ("all_reduce", ALL_REDUCE_REPS)):
        for rep in range(reps + 1):
            for name, call in tools[rep % len(tools):] + tools[:rep % len(tools)]:
                before = {p.pid for p in me.children(recursive=True)}
                t0 = time.perf_counter()
                out = call(scripts[kind])
                dt = time.perf_counter() - t0
                killed += kill_leftovers(before)
                if rep > 0:
                    times[(name, kind)].append(dt)
                    if kind == "all_reduce":
                        inits[name] += _inits(out)
            _log(f"{kind}: round {rep} of {reps} done" + (" (warm-up)" if rep == 0 else ""))

    train_tools = {"ddip run": ddip_run, "torchrun": torchrun, "ddip.Group": None,
                   "ddip run, 2 nodes": ddip_run_2nodes, "torchrun, 2 nodes": torchrun_2nodes}
    rates = {k: [] for k in train_tools}
    cpu = {k: [] for k in train_tools}
    before = {p.pid for p in me.children(recursive=True)}
    os.environ.pop("OMP_NUM_THREADS", None)  # the group's default: ddip divides the cores (1 each here)
    import ddip.template

    with ddip.Group(n=2) as g:  # forked from the rank template, as a notebook's %%dip group is
        g.run("pass")
        # The template lives as long as its "kernel" (this process), by design: not a leftover.
        template_pid = ddip.template._handle.status()[1] if ddip.template._handle is not None else None
        if template_pid:
            before.add(template_pid)
        for rep in range(TRAIN_REPS):
            # The order turns every round, so no tool always runs first (or right after another).
            order = list(train_tools)
            order = order[rep % len(order):] + order[:rep % len(order)]
            for name in order:
                if name == "ddip.Group":
                    out = g.run(TRAIN, timeout=600)[0].stdout
                else:
                    inner = {p.pid for p in me.children(recursive=True)}
                    out = train_tools[name](scripts["train"])
                    killed += kill_leftovers(inner)
                r, c = _rate(out)
                rates[name].append(r)
                cpu[name].append(c)
            _log(f"training: round {rep + 1} of {TRAIN_REPS} done: "
                 + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()) + " steps/s")
    killed += kill_leftovers(before)
    if template_pid and psutil.pid_exists(template_pid):
        t = psutil.Process(template_pid)
        t.kill()
        t.wait(GRACE_S)
    for f in workdir.iterdir():
        f.unlink()
    workdir.rmdir()

    med = {key: statistics.median(v) for key, v in times.items()}
    # Ratios within a round compare runs made seconds apart, under the same load: their median is
    # the less noisy figure on a shared machine; the medians of the rates are shown too.
    paired = {k: statistics.median(a / b for a, b in zip(rates[k], rates["torchrun"]))
              for k in ("ddip run", "ddip.Group")}
    paired2 = statistics.median(a / b for a, b in zip(rates["ddip run, 2 nodes"],
                                                      rates["torchrun, 2 nodes"]))
    rate = {k: statistics.median(v) for k, v in rates.items()}
    cpu_ms = {k: statistics.median(v) for k, v in cpu.items()}
    lines = [
        "| 2 processes, start to exit | ddip run | torchrun | 2x plain python | torchrun / ddip run "
        "| ddip run - plain | ddip run, `DDIP_RUN_HOOK=0` | the hook's cost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, label in (("empty", "empty script"), ("all_reduce", "gloo all_reduce script")):
        d, t, p = med[("ddip run", kind)], med[("torchrun", kind)], med[("2x plain python", kind)]
        u = med[("ddip run, no hook", kind)]
        lines.append(f"| {label} | {d:.3f} s | {t:.3f} s | {p:.3f} s | {t / d:.1f}x | "
                     f"{(d - p) * 1000:+.0f} ms | {u:.3f} s | {(d - u) * 1000:+.1f} ms |")
    lines += [
        "",
        "| DDP training loop, 2 ranks, gloo | ddip run | torchrun | ddip.Group | ddip run / torchrun "
        "| Group / torchrun |",
        "|---|---|---|---|---|---|",
        f"| steps/s ({STEPS} steps after {WARMUP} warm-up) | {rate['ddip run']:.1f} | "
        f"{rate['torchrun']:.1f} | {rate['ddip.Group']:.1f} | "
        f"{paired['ddip run']:.3f}x | {paired['ddip.Group']:.3f}x |",
        f"| rank 0's CPU time per step | {cpu_ms['ddip run']:.3f} ms | {cpu_ms['torchrun']:.3f} ms | "
        f"{cpu_ms['ddip.Group']:.3f} ms | {cpu_ms['ddip run'] / cpu_ms['torchrun']:.3f}x | "
        f"{cpu_ms['ddip.Group'] / cpu_ms['torchrun']:.3f}x |",
    ]
    lines += [
        "",
        "| 2 nodes of 1 rank each (two launchers on this machine, loopback), start to the exit of both "
        "| ddip run | torchrun | torchrun / ddip run |",
        "|---|---|---|---|",
    ]
    for kind, label in (("empty", "empty script"), ("all_reduce", "gloo all_reduce script")):
        d, t = med[("ddip run, 2 nodes", kind)], med[("torchrun, 2 nodes", kind)]
        lines.append(f"| {label} | {d:.3f} s | {t:.3f} s | {t / d:.1f}x |")
    lines.append(f"| DDP steps/s ({STEPS} steps after {WARMUP} warm-up) | "
                 f"{rate['ddip run, 2 nodes']:.1f} | {rate['torchrun, 2 nodes']:.1f} | "
                 f"ddip run / torchrun {paired2:.3f}x |")
    lines += [
        "",
        "| all_reduce launches: spread | launch, min-max | each rank's init_process_group, "
        "median | max | ranks over 0.4 s |",
        "|---|---|---|---|---|",
    ]
    for name in ("ddip run", "ddip run, no hook", "torchrun", "2x plain python", "ddip run, 2 nodes",
                 "torchrun, 2 nodes"):
        v, i = times[(name, "all_reduce")], inits[name]
        lines.append(f"| {name} | {min(v):.3f}-{max(v):.3f} s | {statistics.median(i):.3f} s | "
                     f"{max(i):.3f} s | {sum(x > 0.4 for x in i)} of {len(i)} |")
    best = {key: min(v) for key, v in times.items()}
    lines += [
        "",
        "Best of each (less sensitive to other load on the machine): " + "; ".join(
            f"{label} ddip run {best[('ddip run', k)]:.3f} s, torchrun {best[('torchrun', k)]:.3f} s, "
            f"plain {best[('2x plain python', k)]:.3f} s"
            for k, label in (("empty", "empty"), ("all_reduce", "all_reduce"))) + ".",
    ]
    empty_gap = med[("ddip run", "empty")] - med[("2x plain python", "empty")]
    empty_ratio = med[("torchrun", "empty")] / med[("ddip run", "empty")]
    train_ratio = paired["ddip run"]
    lines += [
        "",
        f"Medians: {LAUNCH_REPS} launches (empty), {ALL_REDUCE_REPS} (all_reduce), {TRAIN_REPS} "
        "training runs per tool, after an untimed warm-up launch; tools interleaved, their order "
        "turned every round. The ratios are medians of the ratios within each round. steps/s "
        "spread: " + "; ".join(f"{k} {min(v):.1f}-{max(v):.1f}" for k, v in rates.items()) + ".",
        "Targets: `ddip run -n 2` empty script within 50 ms of two plain python starts: "
        f"{'met' if empty_gap <= 0.050 else 'NOT met'} ({empty_gap * 1000:+.0f} ms); "
        f"at least 20x faster than torchrun: {'met' if empty_ratio >= 20 else 'NOT met'} "
        f"({empty_ratio:.1f}x); steps/s at least 0.98x torchrun's: "
        f"{'met' if train_ratio >= 0.98 else 'NOT met'} ({train_ratio:.3f}x).",
        "CPU time per step is what a rank itself spends (all its threads), which waiting for a core "
        "on a shared machine does not inflate: a launcher that added work per step would show there. "
        f"Medians of rates: ddip run {rate['ddip run'] / rate['torchrun']:.3f}x, ddip.Group "
        f"{rate['ddip.Group'] / rate['torchrun']:.3f}x torchrun's.",
        f"Processes left behind and killed by pid: {killed} (the kernel's rank template, which "
        "lives as long as its process by design, is not counted; it is stopped at the end).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(main())
