"""ddip.ranch and friends end to end: the test process plays the notebook (rank 0 by default),
children are real ddip workers, collectives are real torch.distributed with gloo."""

import io
import os
import signal
import sys
import textwrap
import threading
import time
import traceback

import cloudpickle
import pytest

import ddip
from conftest import Tee, children_of, requires_gpu

# Functions here travel by value, as a notebook's do: children never import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rank_env():
    return {k: os.environ.get(k) for k in RANK_ENV} | {"pid": os.getpid()}


def test_every_rank_runs_fn_and_values_come_back_in_rank_order():
    res = ddip.ranch(3, rank_env)
    assert [r["RANK"] for r in res] == ["0", "1", "2"]
    assert [r["LOCAL_RANK"] for r in res] == ["0", "1", "2"]
    assert {r["WORLD_SIZE"] for r in res} == {"3"} and {r["LOCAL_WORLD_SIZE"] for r in res} == {"3"}
    assert len({r["MASTER_PORT"] for r in res}) == 1 and res[0]["MASTER_PORT"].isdigit()
    assert res[0]["pid"] == os.getpid()  # the notebook is rank 0
    assert len({r["pid"] for r in res}) == 3


def test_caller_rank_picks_the_notebooks_rank_and_gather_false_returns_its_value():
    res = ddip.ranch(3, rank_env, caller_rank=2)
    assert [r["RANK"] for r in res] == ["0", "1", "2"] and res[2]["pid"] == os.getpid()
    own = ddip.ranch(3, rank_env, caller_rank=1, gather=False)
    assert own["RANK"] == "1" and own["pid"] == os.getpid()


def test_caller_rank_none_runs_every_rank_in_a_child():
    res = ddip.ranch(2, rank_env, caller_rank=None)
    assert [r["RANK"] for r in res] == ["0", "1"]
    assert os.getpid() not in {r["pid"] for r in res}
    rank0 = ddip.ranch(2, rank_env, caller_rank=None, gather=False)
    assert rank0["RANK"] == "0" and rank0["pid"] != os.getpid()


def test_a_single_process_launch_runs_in_the_notebook_only():
    before = children_of(os.getpid())
    assert ddip.ranch(1, rank_env)[0]["pid"] == os.getpid()
    assert children_of(os.getpid()) == before


def scaled(x, *, factor=1, offset=0):
    return int(os.environ["RANK"]) * factor + x + offset


def test_positional_and_keyword_arguments_reach_fn():
    assert ddip.ranch(3, scaled, 5, factor=10, offset=1) == [6, 16, 26]


def poke_env():
    os.environ["RANCH_TEST_LEFTOVER"] = "1"
    os.environ["HOME"] = "/nowhere"
    return os.environ["RANK"]


def fail_on_rank(rank):
    if os.environ["RANK"] == str(rank):
        raise ValueError(f"rank {rank} is unhappy")
    return "fine"


def test_the_notebooks_environment_is_restored_exactly_also_on_error():
    before = dict(os.environ)
    os.environ.pop("RANK", None)
    before = dict(os.environ)
    assert ddip.ranch(2, poke_env) == ["0", "1"]
    assert dict(os.environ) == before
    with pytest.raises(ddip.RemoteError):
        ddip.ranch(2, fail_on_rank, 0)
    assert dict(os.environ) == before
    with pytest.raises(ddip.RemoteError):
        ddip.ranch(2, fail_on_rank, 1)
    assert dict(os.environ) == before


NOTEBOOK_CELL = textwrap.dedent("""
    import os

    class Point:
        def __init__(self, x, y):
            self.x, self.y = x, y
        def norm1(self):
            return abs(self.x) + abs(self.y)

    def combine(p, f, g=None):
        return type(p).__name__, f(p.norm1()) + int(os.environ["RANK"]), g(1) if g else None

    square = lambda v: v * v
""")


def notebook_namespace():
    """Definitions made the way a notebook makes them: in a __main__ that children can't import."""
    ns = {"__name__": "__main__"}
    exec(compile(NOTEBOOK_CELL, "<notebook cell>", "exec"), ns)
    return ns


def test_notebook_functions_lambdas_and_classes_work_as_fn_and_arguments():
    nb = notebook_namespace()
    res = ddip.ranch(2, nb["combine"], nb["Point"](3, -4), nb["square"], g=lambda v: v + 100)
    assert res == [("Point", 49, 101), ("Point", 50, 101)]


def test_need_copies_notebook_globals_and_imports_run_first():
    nb = notebook_namespace()
    cell = textwrap.dedent("""
        import ddip
        offset = 1000
        def helper(v):
            return v * 3
        def from_main():
            # Looked up in the rank's __main__, where need= and imports= put things.
            import __main__
            return (__main__.offset + __main__.helper(2) + int(os.environ["RANK"]),
                    __main__.np.__name__, __main__.SEEN_IMPORTS)
        res = ddip.ranch(2, from_main, caller_rank=None, need="offset, helper",
                         imports="import numpy as np\\nSEEN_IMPORTS = 'yes'")
    """)
    exec(cell, nb)
    assert nb["res"] == [(1006, "numpy", "yes"), (1007, "numpy", "yes")]


def test_need_names_must_exist_and_bad_input_starts_nothing():
    before = children_of(os.getpid())
    with pytest.raises(ValueError, match="nprocs"):
        ddip.ranch(0, rank_env)
    with pytest.raises(ValueError, match="caller_rank"):
        ddip.ranch(2, rank_env, caller_rank=2)
    with pytest.raises(ValueError, match="caller_rank"):
        ddip.ranch(2, rank_env, caller_rank=-1)
    with pytest.raises(ValueError, match="'no_such_global'"):
        ddip.ranch(2, rank_env, need="rank_env no_such_global")
    with pytest.raises(TypeError, match="function"):
        ddip.ranch(2, 42)
    with pytest.raises(TypeError, match="context manager"):
        ddip.ranch(2, rank_env, ctx=object())
    with pytest.raises(ValueError, match="imports"):
        ddip.ranch(2, rank_env, imports="import (")
    with pytest.raises(TypeError, match="can't be sent"):
        ddip.ranch(2, scaled, threading.Lock())
    assert children_of(os.getpid()) == before


# Where the ranks run and with what, wrong in the same way for Group and for ranch (hosts in
# names that need no network: the host list's rules fail before any name is resolved).
SAME_BAD_INPUT = [
    dict(env={"A": 1}),
    dict(env=["A=1"]),
    dict(gpus="zero"),
    dict(gpus=[0]),  # with CUDA_VISIBLE_DEVICES='' in the notebook: on any machine, no GPU is visible
    dict(warm="yes"),
    dict(launcher="ssh"),
    dict(bind="127.0.0.1"),
    dict(hosts="localhost:1,here:x"),
    dict(hosts={"localhost": 1, "here": 0}),
    dict(hosts="localhost:1,here:1", gpus=[0]),
    dict(hosts="localhost:1,here:1", python=5),
    dict(hosts="localhost:1,here:1", launcher="telnet {host}"),
]


@pytest.mark.parametrize("bad", SAME_BAD_INPUT, ids=[repr(b) for b in SAME_BAD_INPUT])
def test_group_and_ranch_say_the_same_of_the_same_bad_launch(bad, monkeypatch):
    # One launch spec (ddip.kernel.spec.RanksSpec) checks both: the same words, nothing started,
    # the notebook's environment untouched.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    before, env_before = children_of(os.getpid()), dict(os.environ)
    with pytest.raises(ValueError) as group:
        ddip.Group(**bad, n=None if "hosts" in bad or "gpus" in bad else 2)
    with pytest.raises(ValueError) as launch:
        ddip.ranch(None if "hosts" in bad else 2, rank_env, **bad)
    assert str(group.value) == str(launch.value)
    assert str(group.value)  # a message, not an empty error
    assert children_of(os.getpid()) == before and dict(os.environ) == env_before


class RecordingCtx:
    """Enters and exits around fn in every rank; prints what it saw."""

    def __init__(self):
        self.log = []

    def __enter__(self):
        os.environ["RANCH_CTX"] = "entered"
        self.log.append("enter")
        return self

    def __exit__(self, etype, exc, tb):
        self.log.append(f"exit {etype.__name__ if etype else None}")
        print(f"ctx exit on rank {os.environ['RANK']}: {etype.__name__ if etype else None}")
        return False


def read_ctx_env():
    return os.environ.get("RANCH_CTX")


def test_ctx_is_entered_and_exited_in_every_rank_also_on_error(capsys):
    ctx = RecordingCtx()
    assert ddip.ranch(2, read_ctx_env, ctx=ctx) == ["entered", "entered"]
    assert ctx.log == ["enter", "exit None"]
    out = capsys.readouterr().out
    assert "[rank 1] ctx exit on rank 1: None" in out and "ctx exit on rank 0: None" in out

    ctx = RecordingCtx()
    with pytest.raises(ddip.RemoteError) as ei:
        ddip.ranch(2, fail_on_rank, 1, ctx=ctx)
    assert ei.value.failures[0].rank == 1 and ei.value.failures[0].ename == "ValueError"
    assert "[rank 1] ctx exit on rank 1: ValueError" in capsys.readouterr().out


def chatty():
    if os.environ["RANK"] == "1":
        print("ping", flush=True)
        print("oops", file=sys.stderr, flush=True)
        return None
    # The notebook: still running fn while rank 1's output arrives.
    return sys.stdout.seen.wait(30)


def test_childrens_output_streams_into_the_notebook_live_labelled_by_rank(monkeypatch):
    tee = Tee("[rank 1] ping\n")
    monkeypatch.setattr(sys, "stdout", tee)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    res = ddip.ranch(2, chatty)
    assert res == [True, None]
    assert "[rank 1] oops\n" in err.getvalue()


def die_on_rank_1_in_all_reduce(code):
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)  # everyone is connected
    if os.environ["RANK"] == "1":
        print("rank 1 going down", file=sys.stderr, flush=True)
        os._exit(code)
    dist.all_reduce(t)  # rank 0 (the notebook) waits here for the dead peer
    return "unreachable"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_child_dying_in_a_collective_never_hangs_the_notebook(nprocs):
    before = children_of(os.getpid())
    with pytest.raises(ddip.RemoteError) as ei:
        ddip.ranch(nprocs, die_on_rank_1_in_all_reduce, 3, ctx=ddip.TorchDDPCtx())
    first = ei.value.failures[0]
    assert first.rank == 1 and first.died and first.exit_code == 3
    assert "rank 1 going down" in first.stderr_tail
    assert "root cause on rank 1: RankDied: exit code 3" in str(ei.value)
    assert {f.rank for f in ei.value.failures} <= set(range(nprocs))
    assert children_of(os.getpid()) == before
    import torch.distributed as dist

    assert not dist.is_initialized()  # the notebook's process group was torn down


def raise_on_rank_1_while_the_notebook_waits():
    if os.environ["RANK"] == "1":
        raise KeyError("missing on rank 1")
    time.sleep(120)  # the notebook waits in Python (not in a collective) for rank 1


@pytest.mark.timeout(60)
def test_a_child_raising_interrupts_the_notebook_waiting_in_python():
    with pytest.raises(ddip.RemoteError) as ei:
        ddip.ranch(3, raise_on_rank_1_while_the_notebook_waits)
    failures = ei.value.failures
    assert failures[0].rank == 1 and failures[0].ename == "KeyError"
    assert any("missing on rank 1" in line for line in failures[0].traceback)
    stopped = {f.rank: f for f in failures[1:]}
    assert set(stopped) == {0, 2}
    assert all(f.ename == "Stopped" and "rank 1" in f.evalue for f in stopped.values())
    assert all(f.kind == "stopped" for f in stopped.values())


def raise_on_rank_0_while_children_wait():
    import torch
    import torch.distributed as dist

    if os.environ["RANK"] == "0":
        raise RuntimeError("the notebook's rank failed")
    dist.all_reduce(torch.ones(1))  # waits for rank 0 forever (gloo's timeout is 30 min)


@pytest.mark.timeout(60)
def test_the_notebook_raising_stops_children_waiting_for_it():
    with pytest.raises(ddip.RemoteError) as ei:
        ddip.ranch(3, raise_on_rank_0_while_children_wait, ctx=ddip.TorchDDPCtx())
    first = ei.value.failures[0]
    assert first.rank == 0 and first.ename == "RuntimeError" and "notebook's rank failed" in first.evalue
    assert isinstance(ei.value.__cause__, RuntimeError)
    assert any("raise RuntimeError" in line for line in first.traceback)


def raise_on_rank_2_first():
    import torch
    import torch.distributed as dist

    if os.environ["RANK"] == "2":
        raise ZeroDivisionError("rank 2 divided by zero")
    dist.all_reduce(torch.ones(1))


@pytest.mark.timeout(60)
def test_root_cause_is_the_first_failure_and_collateral_failures_follow():
    # Rank 2 raises; its ctx then closes its connections, so ranks 0 and 1 fail in all_reduce.
    with pytest.raises(ddip.RemoteError) as ei:
        ddip.ranch(3, raise_on_rank_2_first, ctx=ddip.TorchDDPCtx())
    assert ei.value.failures[0].rank == 2 and ei.value.failures[0].ename == "ZeroDivisionError"
    assert str(ei.value).splitlines()[0].endswith("root cause on rank 2: ZeroDivisionError: rank 2 divided by zero")
    assert sorted(f.rank for f in ei.value.failures) == [0, 1, 2]


def sleep_in_children(path):
    if os.environ["RANK"] != "0":
        print("child sleeping", flush=True)
        time.sleep(120)
    return "notebook done"


@pytest.mark.timeout(60)
def test_ctrl_c_in_the_notebook_stops_the_children(monkeypatch):
    tee = Tee("[rank 2] child sleeping\n")
    monkeypatch.setattr(sys, "stdout", tee)
    main = threading.get_ident()

    def press_ctrl_c():
        if tee.seen.wait(30):
            signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=press_ctrl_c)
    t.start()
    before = children_of(os.getpid())
    try:
        with pytest.raises(KeyboardInterrupt):
            ddip.ranch(3, sleep_in_children, "x", collapse=False)  # each child's line, as the tee waits for it
    finally:
        t.join()
    assert children_of(os.getpid()) <= before


def sleep_everywhere():
    print("notebook sleeping" if os.environ["RANK"] == "0" else "child sleeping", flush=True)
    # Short sleeps, as a training loop's steps: a SIGINT that lands after the print but just before
    # time.sleep enters clock_nanosleep trips Python's flag without waking it (CPython checks the
    # flag before the call), so one long sleep would take it only when the sleep ends.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_ctrl_c_while_the_notebook_runs_fn_shows_only_the_users_interrupt(monkeypatch):
    # A real SIGINT while the notebook's own rank is inside fn (where ranch stands in for the
    # SIGINT handler): the KeyboardInterrupt the notebook shows carries nothing of ddip's.
    tee = Tee("notebook sleeping", "[rank 1] child sleeping\n", "[rank 2] child sleeping\n")
    monkeypatch.setattr(sys, "stdout", tee)
    main = threading.get_ident()

    def press_ctrl_c():
        if tee.seen.wait(30):
            signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=press_ctrl_c)
    t.start()
    before = children_of(os.getpid())
    try:
        with pytest.raises(KeyboardInterrupt) as ei:
            ddip.ranch(3, sleep_everywhere, collapse=False)  # each child's line, as the tee waits for it
    finally:
        t.join()
    assert children_of(os.getpid()) <= before
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # The whole chain as a notebook prints it, __context__ included: the interrupt, in fn, alone.
    shown = "".join(traceback.format_exception(ei.value))
    assert shown.rstrip().splitlines()[-1] == "KeyboardInterrupt", shown
    assert "in sleep_everywhere" in shown, shown
    assert "IndexError" not in shown and "During handling" not in shown, shown
    chain, exc = [], ei.value
    while exc is not None:
        chain.append(type(exc).__name__)
        exc = exc.__cause__ or exc.__context__
    assert chain == ["KeyboardInterrupt"], chain


class ChildrenWaitForTheNotebook:
    """A ctx whose rendezvous, on the children, waits for a notebook that never comes."""

    def __enter__(self):
        if os.environ["RANK"] != "0":
            try:  # the notebook may interrupt as soon as the line is written
                print("child waiting", flush=True)
                time.sleep(120)
            except KeyboardInterrupt:
                print("child interrupted", flush=True)
                raise

    def __exit__(self, *exc):
        return False


def ctrl_c_before_the_children_enter():
    # The notebook: the user's Ctrl-C lands in fn once both children wait in their rendezvous.
    if sys.stdout.seen.wait(30):
        raise KeyboardInterrupt


@pytest.mark.timeout(60)
def test_ctrl_c_in_the_notebook_interrupts_children_that_never_entered_fn(monkeypatch):
    # Children still inside ctx.__enter__ are not yet "running" fn; the user's Ctrl-C must still
    # interrupt them at once (not kill them after a grace, nor wait for their rendezvous).
    tee = Tee("[rank 1] child waiting\n", "[rank 2] child waiting\n")
    monkeypatch.setattr(sys, "stdout", tee)
    before = children_of(os.getpid())
    with pytest.raises(KeyboardInterrupt):
        ddip.ranch(3, ctrl_c_before_the_children_enter, ctx=ChildrenWaitForTheNotebook(), collapse=False)
    assert "[rank 1] child interrupted\n" in tee.text and "[rank 2] child interrupted\n" in tee.text
    assert children_of(os.getpid()) <= before


def test_torch_ddp_ctx_initializes_gloo_and_tears_it_down():
    def info():
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return dist.get_backend(), dist.get_world_size(), t.item()

    assert ddip.ranch(3, info, ctx=ddip.TorchDDPCtx()) == [("gloo", 3, 3.0)] * 3
    assert ddip.torchddp_launch(2, info) == ("gloo", 2, 1.0)
    import torch.distributed as dist

    assert not dist.is_initialized()


class DiesBeforeItsGroup(ddip.TorchDDPCtx):
    """Rank 1 arrives at the rendezvous, then dies instead of building its process group: the
    notebook's init_process_group fails after its collective timeout."""

    def __enter__(self):
        if os.environ["RANK"] == "1":
            import torch.distributed as dist

            dist.init_process_group = lambda *a, **kw: os._exit(3)
        return super().__enter__()


def rank_times_ten():
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item() * 10


def test_a_launch_after_one_whose_process_group_failed_in_the_notebook_runs():
    # torch had named the notebook's failed group "0" and counted on: the next launch's notebook
    # built group "1" while its children built "0", each waiting for the other's keys (a hang of
    # the collective timeout, 30 min, in the full suite).
    with pytest.raises(ddip.RemoteError) as failed:
        ddip.ranch(2, rank_times_ten, ctx=DiesBeforeItsGroup(timeout=5))
    assert "rank 1" in str(failed.value) and "exit code 3" in str(failed.value)
    assert ddip.ranch(2, rank_times_ten, ctx=ddip.TorchDDPCtx(timeout=20)) == [10.0, 10.0]


class ProbingCtx(ddip.TorchDDPCtx):
    """The child says whether rank 0's store already listened when it entered (before it connects
    itself); the notebook's rank enters only after that look (a FIFO's open waits for the other
    end), so a notebook that happens to be quick can't hide a store opened too late."""

    def __init__(self, fifo):
        super().__init__()
        self.fifo = fifo

    def __enter__(self):
        if os.environ["RANK"] == "0":
            with open(self.fifo) as f:
                f.read()
        else:
            import socket

            with socket.socket() as s:
                refused = s.connect_ex((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
            os.environ["STORE_LISTENED"] = "yes" if refused == 0 else "no"
            with open(self.fifo, "w") as f:
                f.write("looked")
        return super().__enter__()


def store_listened():
    return os.environ.get("STORE_LISTENED")


def test_the_notebooks_store_listens_before_its_children_connect(tmp_path):
    # A child refused by a port not listening yet sleeps torch's connect backoff (250-750 ms).
    fifo = str(tmp_path / "looked")
    os.mkfifo(fifo)
    assert ddip.ranch(2, store_listened, ctx=ProbingCtx(fifo)) == [None, "yes"]
    assert "STORE_LISTENED" not in os.environ


def test_torch_ddp_ctx_rejects_bad_settings():
    with pytest.raises(ValueError, match="backend"):
        ddip.TorchDDPCtx(backend="mpi")
    with pytest.raises(ValueError, match="nccl"):
        ddip.TorchDDPCtx(backend="nccl")
    with pytest.raises(ValueError, match="port"):
        ddip.TorchDDPCtx(port=0)
    if ddip.kernel.group.gpu_count() == 0:
        with pytest.raises(ValueError, match="GPU"):
            ddip.TorchDDPCtx(gpus=[0])


def gpu_placement():
    import torch

    idx = torch.cuda.current_device()
    return {"rank": int(os.environ["RANK"]), "pci": torch.cuda.get_device_properties(idx).pci_bus_id
            if hasattr(torch.cuda.get_device_properties(idx), "pci_bus_id") else None,
            "name": torch.cuda.get_device_name(idx), "uuid": str(torch.cuda.get_device_properties(idx).uuid)}


@requires_gpu
def test_gpu_ranks_land_on_the_listed_gpus_in_the_given_order():
    import subprocess

    n = ddip.kernel.group.gpu_count()
    gpus = list(reversed(range(min(n, 2))))  # [1, 0] where there are two
    uuids = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                           capture_output=True, text=True, check=True).stdout
    by_index = {int(i): u.strip() for i, u in (line.split(",") for line in uuids.strip().splitlines())}
    res = ddip.ranch(len(gpus), gpu_placement, ctx=ddip.TorchDDPCtx(gpus=gpus))
    for r in res:
        assert by_index[gpus[r["rank"]]].endswith(r["uuid"].replace("GPU-", "")) or \
            r["uuid"] in by_index[gpus[r["rank"]]]


def test_import_star_honours_all_and_binds_into_the_callers_globals():
    ns = {}
    names = ddip.import_star(["json", "os.path"], ns)
    assert "dumps" in ns and "JSONDecodeError" in ns and "join" in ns
    assert "_default_encoder" not in ns and "decoder" not in ns  # json.__all__ leaves them out
    assert set(names) == set(ns)

    def inside_a_function():
        ddip.import_star("textwrap")
        return dedent("  x")  # noqa: F821 - bound by import_star

    assert inside_a_function() == "x"
    assert "dedent" in globals()
    del globals()["dedent"]


def test_failing_imports_code_is_named_as_such():
    with pytest.raises(ddip.RemoteError, match=r"^ranch's imports= code failed on rank 1; root cause on rank 1: "
                                               r"ModuleNotFoundError"):
        ddip.ranch(2, rank_env, imports="import nonexistent_module_for_ddip_tests")
