"""Bad input gets a clear error saying what was wrong and what to do, and changes nothing:
no process started, nothing half-pushed, the group still works."""

import os
import socket
import threading

import pytest

import ddip
from conftest import children_of


def _plain(x):
    return x


def _state(g):
    return g.pids, [r["state"] for r in g.status()], sorted(g.run("sorted(k for k in globals() if not k.startswith('_'))")[0].value)


GROUP_ARGS = [
    (dict(n=0), ValueError, "n must be a positive number of processes, got 0"),
    (dict(n=-1), ValueError, "n must be a positive number of processes, got -1"),
    (dict(n=2.5), ValueError, "n must be a positive number of processes, got 2.5"),
    (dict(n=True), ValueError, "n must be a positive number of processes, got True"),
    (dict(), ValueError, "give n= (the number of CPU processes) or gpus="),
    (dict(n=2, gpus=[0]), ValueError, "give n= (CPU processes) or gpus= (one rank per GPU), not both"),
    (dict(gpus=[99]), ValueError, "GPU 99 is not visible"),
    (dict(gpus="zero"), ValueError, "'zero' is not a GPU"),
    (dict(gpus=[]), ValueError, "gpus is empty"),
    (dict(n=2, backend="mpi"), ValueError, "backend='mpi' is not one of 'gloo', 'nccl', 'auto' or None"),
    (dict(n=2, backend="nccl"), ValueError, "backend='nccl' needs GPUs"),
    (dict(n=2, timeout=-1), ValueError, "timeout must be a positive number of seconds"),
    (dict(n=2, timeout="10"), ValueError, "timeout must be a positive number of seconds"),
    (dict(n=2, env={"A": 1}), ValueError, "env must be a dict of strings to strings"),
    (dict(n=2, heartbeat_timeout=0), ValueError, "heartbeat_timeout must be a positive number"),
    (dict(n=2, rank_ids=[0, 0]), ValueError, "rank_ids must be distinct ranks"),
]


@pytest.mark.parametrize("kwargs, error, message", GROUP_ARGS, ids=[repr(a[0]) for a in GROUP_ARGS])
def test_bad_group_arguments_start_nothing(kwargs, error, message):
    before = children_of(os.getpid())
    with pytest.raises(error) as e:
        ddip.Group(**kwargs)
    assert message in str(e.value)
    assert children_of(os.getpid()) == before


CALLS = [
    ("push a lock", lambda g: g.push(ok=1, lock=threading.Lock()), TypeError, "can't push lock: it can't be pickled"),
    ("push a generator", lambda g: g.push(ok=1, gen=(i for i in range(3))), TypeError, "can't push gen"),
    ("push a socket", lambda g: g.push(ok=1, sock=socket.socket()), TypeError, "can't push sock"),
    ("push a bad name", lambda g: g.push({"1x": 1}), ValueError, "push needs variable names, got ['1x']"),
    ("push a keyword", lambda g: g.push({"class": 1}), ValueError, "push needs variable names"),
    ("push nothing", lambda g: g.push(), ValueError, "push needs something to push"),
    ("push a list", lambda g: g.push([1]), TypeError, "push takes a dict of names to values"),
    ("pull a missing name", lambda g: g.pull("missing_xyz"), ddip.RemoteError,
     "name 'missing_xyz' is not defined on rank 0"),
    ("pull no names", lambda g: g.pull([]), ValueError, "pull needs at least one variable name"),
    ("pull a non-name", lambda g: g.pull("a b"), ValueError, "pull needs variable names"),
    ("pull a number", lambda g: g.pull(3), TypeError, "pull needs a variable name or a list of names"),
    ("pull from a missing rank", lambda g: g.pull("x", rank=7), ValueError, "no rank 7 in this group (ranks: [0, 1])"),
    ("run a non-string", lambda g: g.run(123), TypeError, "code must be a string, got int"),
    ("run with a negative timeout", lambda g: g.run("1", timeout=-1), ValueError,
     "timeout must be a positive number of seconds (or None), got -1"),
    ("run on a missing rank", lambda g: g.run("1", ranks=[5]), ValueError, "no rank 5 in this group"),
    ("run on a rank twice", lambda g: g.run("1", ranks=[0, 0]), ValueError, "lists a rank twice"),
    ("run on no ranks", lambda g: g.run("1", ranks=[]), ValueError, "no ranks selected"),
    ("apply a non-callable", lambda g: g.apply(5), TypeError, "apply needs a callable, got int"),
    ("stacks with a negative timeout", lambda g: g.stacks(timeout=-1), ValueError, "timeout must be a positive"),
    ("result with a negative timeout", lambda g: g.apply_async(_plain, 1).result(timeout=-1), ValueError,
     "timeout must be a positive"),
    ("a bad signal", lambda g: g.kill(sig=999), ValueError, "999"),
]


@pytest.mark.parametrize("what, call, error, message", CALLS, ids=[c[0] for c in CALLS])
def test_bad_calls_change_nothing(what, call, error, message):
    with ddip.Group(n=2, backend=None) as g:
        g.push(x=1)
        before = _state(g)
        with pytest.raises(error) as e:
            call(g)
        assert message in str(e.value)
        if what == "result with a negative timeout":
            return  # the request itself was sent and is fine; the bad call was only the wait
        assert _state(g) == before  # same processes, all idle, nothing half-pushed


def test_calls_on_a_closed_group_say_so():
    g = ddip.Group(n=1, backend=None)
    g.close()
    for call in (lambda: g.run("1"), lambda: g.push(x=1), lambda: g.pull("x"), lambda: g.stacks(),
                 lambda: g.apply(_plain, 1), lambda: g.status(), lambda: g.interrupt()):
        with pytest.raises(RuntimeError, match="this group is closed; create a new one"):
            call()
    g.kill()  # a no-op once closed, by design (safe from another thread)


def test_calls_on_a_group_with_a_dead_rank_say_restart():
    with ddip.Group(n=2, backend=None) as g:
        g.kill([1])
        # Whether the death reached the notebook before this call (refused: RankDeadError) or
        # while it ran (RemoteError) is the kernel's scheduling: both name the dead rank.
        with pytest.raises((ddip.RemoteError, ddip.RankDeadError), match="rank 1"):
            g.run("import time; time.sleep(5)")
        for call in (lambda: g.run("1"), lambda: g.push(x=1), lambda: g.apply(_plain, 1)):
            with pytest.raises(RuntimeError, match=r"rank 1 is dead \(killed by SIGKILL\); call heal\(\) to replace it "
                                                 r".* or call restart\(\)"):
                call()
        assert g.run("1", ranks=[0])[0].value == 1  # the live rank still works
        g.restart()
        assert [r.value for r in g.run("2")] == [2, 2]


RANCH = [
    ("zero ranks", lambda: ddip.ranch(0, _plain, 1), ValueError, "nprocs must be a positive number"),
    ("not callable", lambda: ddip.ranch(2, 5), TypeError, "ranch needs a function to run"),
    ("unpicklable fn", lambda: (lambda lk: ddip.ranch(2, lambda: lk))(threading.Lock()), TypeError,
     "fn, its arguments or ctx can't be sent to the ranks"),
    ("imports not a string", lambda: ddip.ranch(2, _plain, 1, imports=5), TypeError,
     "imports must be code as a string, got int"),
    ("imports not Python", lambda: ddip.ranch(2, _plain, 1, imports="import ("), ValueError,
     "imports is not valid Python"),
    ("caller_rank out of range", lambda: ddip.ranch(2, _plain, 1, caller_rank=5), ValueError,
     "caller_rank must be None or a rank from 0 to 1"),
    ("need of a missing name", lambda: ddip.ranch(2, _plain, 1, need="nope_xyz"), ValueError,
     "need names 'nope_xyz', which the notebook has not defined"),
    ("ctx not a context manager", lambda: ddip.ranch(2, _plain, 1, ctx=5), TypeError,
     "ctx must be a context manager"),
    ("GPUs on a machine without them", lambda: ddip.ranch(2, _plain, 1, gpus=[0, 1]), ValueError,
     "is not visible"),
    ("a negative rendezvous timeout", lambda: ddip.TorchDDPCtx(rendezvous_timeout=-1), ValueError,
     "rendezvous_timeout must be a positive number of seconds"),
]


@pytest.mark.parametrize("what, call, error, message", RANCH, ids=[r[0] for r in RANCH])
def test_bad_ranch_calls_start_nothing(what, call, error, message, monkeypatch):
    if what.startswith("GPUs") and ddip.kernel.group.gpu_count() > 0:
        pytest.skip("this machine has GPUs")
    before = children_of(os.getpid())
    env_before = dict(os.environ)
    with pytest.raises(error) as e:
        call()
    assert message in str(e.value)
    assert children_of(os.getpid()) == before
    assert dict(os.environ) == env_before


NO_GPU_HERE = "sees no GPU: its CUDA_VISIBLE_DEVICES='0,1' names GPUs, but this machine has no NVIDIA GPU"
NAMED_GPUS = [
    ("Group, the env given", lambda: ddip.Group(gpus=[1], env={"CUDA_VISIBLE_DEVICES": "0,1"}), None,
     "GPU 1 is not visible: the group's env= " + NO_GPU_HERE),
    ("Group, the notebook's env", lambda: ddip.Group(gpus="all"), "0,1", "'all' GPUs, but the notebook " + NO_GPU_HERE),
    ("ranch", lambda: ddip.ranch(2, _plain, 1, gpus=[0, 1]), "0,1", "GPU 0 is not visible: the notebook " + NO_GPU_HERE),
    ("ranch, TorchDDPCtx", lambda: ddip.ranch(2, _plain, 1, ctx=ddip.TorchDDPCtx(gpus=[0, 1])), "0,1",
     "GPU 0 is not visible: the notebook " + NO_GPU_HERE),
]


@pytest.mark.skipif(bool(ddip.gpus.physical_gpus()), reason="needs a machine without NVIDIA GPUs")
@pytest.mark.parametrize("what, call, notebook_env, message", NAMED_GPUS, ids=[c[0] for c in NAMED_GPUS])
def test_gpus_named_by_cuda_visible_devices_on_a_machine_without_any_start_nothing(what, call, notebook_env,
                                                                                    message, monkeypatch):
    # CUDA_VISIBLE_DEVICES hides GPUs, it can't add them: the ranks would crash in torch (a
    # group) or run on CPU unasked (ranch). The error names what is visible and how to run on
    # CPU, before anything starts or changes.
    if notebook_env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", notebook_env)
    before = children_of(os.getpid())
    env_before = dict(os.environ)
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value)
    assert "to run CPU processes instead, use n=2 (for example) for a group, or leave out gpus= in ranch" in str(e.value)
    assert children_of(os.getpid()) == before
    assert dict(os.environ) == env_before
