"""One-shot launch overhead: ddip.ranch against torch.multiprocessing.spawn and accelerate's
notebook_launcher, measured in the same run.

    .venv/bin/python bench/bench_launch.py     (or `make bench` for every bench module)

Two functions on 2 processes, each timed from the call until it returns:
- noop: returns None.
- all_reduce: joins a gloo process group, does one all_reduce of a 4-float tensor, leaves it.

ddip: `ranch(2, fn)` — the calling process is rank 0, one ddip worker is rank 1, forked from
the rank template as by default (an untimed launch starts the template before anything is
timed, if no earlier module did; bench_warm.py times warm and cold launches side by side); for all_reduce with
`ctx=TorchDDPCtx()`. torch: `torch.multiprocessing.spawn(fn, nprocs=2)` (start
method spawn, as in a notebook). accelerate: `notebook_launcher(fn, num_processes=2)` (forks,
through torch's elastic agent). The tools run interleaved, so load on the machine hits them alike:
in each round and for each function, notebook_launcher, then ranch right after it (the notebook
that used accelerate's launcher once and then ranch: issue 23), then spawn. Before any of that,
ranch runs alone, as in a process that never called notebook_launcher, for the same medians.

Clean-up: after every launch, each descendant of this process still there after a grace period
is killed by pid (psutil checks the pid still names the same process); the count is printed.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import psutil

from common import kill_leftovers

REPS = 5  # timed launches per tool and function, after one untimed warm-up each


def _log(msg: str):
    print(f"[bench_launch] {msg}", file=sys.stderr, flush=True)


# -- the functions launched (module level: spawn needs to import them by name) --------------


def noop(*_):
    return None


def all_reduce_gloo(*_):
    """For ranch (TorchDDPCtx set up the process group)."""
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    return t[0].item()


def spawn_all_reduce(index, port):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=index, world_size=2)
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.destroy_process_group()


def elastic_all_reduce():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # env:// from the elastic agent
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.destroy_process_group()


# -- the tools --------------------------------------------------------------------------------


def _ranch(kind):
    import ddip

    if kind == "noop":
        ddip.ranch(2, noop)
    else:
        ddip.ranch(2, all_reduce_gloo, ctx=ddip.TorchDDPCtx())


def _spawn(kind):
    import torch.multiprocessing as mp

    from ddip.kernel.group import free_port

    if kind == "noop":
        mp.spawn(noop, nprocs=2, join=True)
    else:
        mp.spawn(spawn_all_reduce, args=(free_port(),), nprocs=2, join=True)


def _accelerate(kind):
    from accelerate import notebook_launcher

    from ddip.kernel.group import free_port

    fn = noop if kind == "noop" else elastic_all_reduce
    notebook_launcher(fn, num_processes=2, use_port=str(free_port()))


def _accelerate_available() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True




def _quiet(call, kind):
    # notebook_launcher and the elastic agent print a line per launch; keep the table readable.
    import contextlib
    import io

    sink = io.StringIO()
    with contextlib.redirect_stdout(sink):
        call(kind)


def main() -> str:
    import cloudpickle

    import torch  # noqa: F401 - the notebook has it already; nobody pays for it in the timings

    # As a notebook's functions: by value, the children need not import this module.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    acc = _accelerate_available()
    ranch = "ddip.ranch, right after notebook_launcher" if acc else "ddip.ranch"
    alone = "ddip.ranch, no notebook_launcher call yet"
    # Interleaved in this order: ranch's launch follows notebook_launcher's in the same process.
    tools = ([("accelerate notebook_launcher", _accelerate)] if acc else []) + [
        (ranch, _ranch), ("torch.multiprocessing.spawn", _spawn)]
    # multiprocessing's resource tracker lives as long as this process (spawn starts it once);
    # start it now so that it isn't taken for a process a launch left behind.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    # ddip's rank template too (as %load_ext ddip starts it in a kernel): started inside a timed
    # launch, it would be taken for a process left behind, killed, and restarted by every launch.
    import ddip

    ddip.ranch(2, noop)
    phases = ([[(alone, _ranch)]] if acc else []) + [tools]
    times = {(t, k): [] for phase in phases for t, _ in phase for k in ("noop", "all_reduce")}
    killed = {t: 0 for phase in phases for t, _ in phase}
    me = psutil.Process()
    for phase in phases:
        for rep in range(REPS + 1):
            for kind in ("noop", "all_reduce"):
                for name, call in phase:
                    before = {p.pid for p in me.children(recursive=True)}
                    t0 = time.perf_counter()
                    _quiet(call, kind)
                    dt = time.perf_counter() - t0
                    killed[name] += kill_leftovers(before)
                    if rep > 0:
                        times[(name, kind)].append(dt)
            _log(f"{', '.join(n for n, _ in phase)}: round {rep} of {REPS} done" + (" (warm-up)" if rep == 0 else ""))
    med = {key: statistics.median(v) for key, v in times.items()}
    # Columns: ranch as interleaved, ranch alone, then the others; ratios against interleaved ranch.
    others = [n for n, _ in tools if n != ranch]
    columns = [ranch] + ([alone] if acc else []) + others
    lines = ["| launch of 2 processes | " + " | ".join(columns) + " | "
             + " | ".join(f"{n} / ranch" for n in others) + " |",
             "|---" * (1 + len(columns) + len(others)) + "|"]
    for kind, label in (("noop", "`fn` returns at once"), ("all_reduce", "`fn` does one gloo all_reduce")):
        cells = [f"{med[(n, kind)]:.3f} s" for n in columns]
        ratios = [f"{med[(n, kind)] / med[(ranch, kind)]:.1f}x" for n in others]
        lines.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    spawn_ok = all(med[(ranch, k)] <= med[("torch.multiprocessing.spawn", k)] for k in ("noop", "all_reduce"))
    notes = [
        "",
        f"Medians of {REPS} launches each, after one untimed warm-up; tools interleaved"
        + (", ranch's launch right after notebook_launcher's (its other column: ranch alone, before any "
           "notebook_launcher call). " if acc else ". ")
        + "ranch runs rank 0 in the calling process (which has torch imported already, as a notebook "
        "would) and starts one worker; spawn starts two fresh interpreters that import torch; "
        "notebook_launcher forks two processes under torch's elastic agent, so its children have torch "
        "already (fork is why it must refuse a notebook that has touched CUDA); ranch's worker is forked "
        "from ddip's rank template, which has torch imported and has never started CUDA (see bench_warm "
        "for cold launches).",
        f"Target: ranch no slower than torch.multiprocessing.spawn: {'met' if spawn_ok else 'NOT met'}.",
    ]
    if acc:
        acc_ok = all(med[(ranch, k)] <= med[("accelerate notebook_launcher", k)] for k in ("noop", "all_reduce"))
        notes.append(f"Target (issue 23): ranch right after a notebook_launcher call no slower than "
                     f"notebook_launcher: {'met' if acc_ok else 'NOT met'}.")
    notes.append("Processes left behind and killed by pid: " + ", ".join(f"{n} {killed[n]}" for n in killed) + ".")
    if not acc:
        notes.append("accelerate is not installed: its column is left out.")
    return "\n".join(lines + notes) + "\n"


if __name__ == "__main__":
    print(main())
