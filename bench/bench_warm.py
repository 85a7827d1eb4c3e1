"""Warm ranks (forked from the kernel's rank template) against cold ranks and the tools users
would pick instead, measured in the same run, side by side.

    .venv/bin/python bench/bench_warm.py      (or `make bench` for every bench module)

Group ready, N=2 and N=4, torch imported and gloo initialized in every rank:
- ddip warm: `Group(n=N, backend='gloo')`, ranks forked from a ready template (`ddip.prewarm()`);
- ddip cold: the same with `warm=False` (each rank starts Python and imports torch);
- ipyparallel: `Cluster(n=N)` + `start_and_connect_sync()` + `%px import torch` (as
  `view.execute("import torch", block=True)`); it has no torch.distributed set-up, so it does less;
- torch.multiprocessing.spawn: N fresh processes that `init_process_group('gloo')` and pass
  one barrier, timed until `spawn(join=True)` returns.
One-shot launches of 2 processes (`fn` returns at once; `fn` does one gloo all_reduce): ddip
`ranch(2, fn)` warm and cold (`warm=False`), `torch.multiprocessing.spawn`, accelerate's
`notebook_launcher` (it forks this process). Everything is timed from the call until it returns;
tools are interleaved, so load on the machine hits them alike.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import shutil
import time

import psutil

REPS = 3  # timed repetitions per row, after one untimed warm-up round
GROUP_TARGET_S = 0.3
SPAWN_RATIO_TARGET = 0.3

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bench_group  # noqa: E402
import bench_launch  # noqa: E402
from common import kill_leftovers  # noqa: E402


def _log(msg: str):
    print(f"[bench_warm] {msg}", file=sys.stderr, flush=True)


def spawn_barrier(index, port, world):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=index, world_size=world)
    dist.barrier()
    dist.destroy_process_group()


def _group(n: int, warm: bool, left) -> float:
    import ddip

    t0 = time.perf_counter()
    g = ddip.Group(n=n, backend="gloo", warm=warm)
    elapsed = time.perf_counter() - t0
    procs = [psutil.Process(pid) for pid in g.pids]
    if warm and not all(r.value for r in g.run("import ddip.template; ddip.template.forked")):
        raise RuntimeError("a 'warm' rank was not forked from the template: " + ddip.template.status())
    g.close()
    left.ddip += bench_group._reap(procs)
    return elapsed


def _ipp_torch(n: int, profile_dir: str, left) -> float:
    c = bench_group._IpyparallelCluster(n, profile_dir, left)
    with c:
        t0 = time.perf_counter()
        c.start()
        c.view.execute("import torch", block=True)
        return time.perf_counter() - t0


def _spawn_group(n: int) -> float:
    import torch.multiprocessing as mp

    from ddip.kernel.group import free_port

    t0 = time.perf_counter()
    mp.spawn(spawn_barrier, args=(free_port(), n), nprocs=n, join=True)
    return time.perf_counter() - t0


def _ranch(kind: str, warm: bool):
    import ddip

    if kind == "noop":
        ddip.ranch(2, bench_launch.noop, warm=warm)
    else:
        ddip.ranch(2, bench_launch.all_reduce_gloo, ctx=ddip.TorchDDPCtx(), warm=warm)


def _fmt(t: float) -> str:
    return f"{t:.3f} s"


def main() -> str:
    import cloudpickle
    import torch  # noqa: F401 - the notebook has it already; nobody pays for it in the timings

    import ddip
    import ddip.template

    cloudpickle.register_pickle_by_value(bench_launch)  # as a notebook's functions: by value
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    ddip.prewarm()
    state = ddip.template._handle.wait_ready(120_000)[0]
    if state != "ready":
        raise RuntimeError("the rank template did not become ready: " + ddip.template.status())
    left = bench_group._Leftovers()
    profile_dir = tempfile.mkdtemp(prefix="ddip-bench-warm-ipyparallel-")
    groups: dict[tuple, list[float]] = {}
    launches: dict[tuple, list[float]] = {}
    tools = [("ddip warm", lambda k: _ranch(k, True)), ("ddip cold", lambda k: _ranch(k, False)),
             ("torch.multiprocessing.spawn", bench_launch._spawn)]
    if bench_launch._accelerate_available():
        tools.append(("accelerate notebook_launcher", bench_launch._accelerate))
    me = psutil.Process()
    killed = 0
    try:
        for rep in range(REPS + 1):
            for n in (2, 4):
                row = {"ddip warm": _group(n, True, left), "ddip cold": _group(n, False, left),
                       "ipyparallel + %px import torch": _ipp_torch(n, profile_dir, left),
                       "torch.multiprocessing.spawn": _spawn_group(n)}
                if rep > 0:
                    for tool, t in row.items():
                        groups.setdefault((n, tool), []).append(t)
            for kind in ("noop", "all_reduce"):
                for name, call in tools:
                    before = {p.pid for p in me.children(recursive=True)}
                    t0 = time.perf_counter()
                    bench_launch._quiet(call, kind)
                    dt = time.perf_counter() - t0
                    killed += kill_leftovers(before)
                    if rep > 0:
                        launches.setdefault((kind, name), []).append(dt)
            _log(f"round {rep} of {REPS} done" + (" (warm-up)" if rep == 0 else ""))
    finally:
        shutil.rmtree(profile_dir, ignore_errors=True)

    gmed = {k: statistics.median(v) for k, v in groups.items()}
    lmed = {k: statistics.median(v) for k, v in launches.items()}
    gtools = ["ddip warm", "ddip cold", "ipyparallel + %px import torch", "torch.multiprocessing.spawn"]
    lines = ["| group ready, torch + gloo | " + " | ".join(gtools) + " |", "|---" * (len(gtools) + 1) + "|"]
    for n in (2, 4):
        lines.append(f"| N={n} | " + " | ".join(_fmt(gmed[(n, t)]) for t in gtools) + " |")
    names = [n for n, _ in tools]
    lines += ["", "| ranch(2, fn) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for kind, label in (("noop", "`fn` returns at once"), ("all_reduce", "`fn` does one gloo all_reduce")):
        lines.append(f"| {label} | " + " | ".join(_fmt(lmed[(kind, n)]) for n in names) + " |")

    warm2 = gmed[(2, "ddip warm")]
    warm_ar = lmed[("all_reduce", "ddip warm")]
    spawn_ar = lmed[("all_reduce", "torch.multiprocessing.spawn")]
    targets = [f"warm group of 2 ready with torch + gloo ≤ {GROUP_TARGET_S:g} s: "
               f"{'met' if warm2 <= GROUP_TARGET_S else 'NOT met'} ({_fmt(warm2)})",
               f"warm ranch(2, all_reduce) ≤ {SPAWN_RATIO_TARGET:g}x torch.multiprocessing.spawn: "
               f"{'met' if warm_ar <= SPAWN_RATIO_TARGET * spawn_ar else 'NOT met'} "
               f"({warm_ar / spawn_ar:.2f}x)"]
    if ("all_reduce", "accelerate notebook_launcher") in lmed:
        acc = lmed[("all_reduce", "accelerate notebook_launcher")]
        targets.append(f"warm ranch(2, all_reduce) no slower than notebook_launcher: "
                       f"{'met' if warm_ar <= acc else 'NOT met'} ({_fmt(warm_ar)} vs {_fmt(acc)})")
    notes = [
        f"Medians of {REPS} repetitions after one untimed warm-up round; tools interleaved.",
        "Warm rows: the template (torch preloaded) was ready before timing started; its own start "
        "(about one torch import) is paid once per kernel, in the background after `%load_ext ddip`.",
        "ipyparallel's row imports torch but sets up no process group (it has none); spawn's row "
        "includes its processes' exit after the barrier.",
        f"Processes left behind and killed by pid: ddip {len(left.ddip)}, ipyparallel "
        f"{len(left.ipyparallel)}, launches {killed}.",
    ]
    return ("\n".join(lines) + "\n\nTargets: " + "; ".join(targets) + ".\n\n"
            + "\n".join(f"- {n}" for n in notes) + "\n")


if __name__ == "__main__":
    print(main())
