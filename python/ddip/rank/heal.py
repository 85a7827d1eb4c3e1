"""Heal: a group whose collective was broken by one rank's exception gets a working
torch.distributed again, without losing any rank's namespace.

When one rank raises inside a training step, its peers wait for it in a collective that will
never complete. The kernel (group.py) then:

1. tears down the process groups of every rank of the request that is no longer running
   (`release`): with gloo, a peer blocked on a torn-down rank's connections fails at once, and
   is torn down in turn when it replies;
2. once every rank has replied, rebuilds the default process group on every rank with the same
   ranks and world size: rank 0 opens a fresh store on a port of its own host's choosing
   (`open_store`, so it is free where rank 0 runs, on any host), then every rank joins it
   (`rejoin`).

What held the old group (a DistributedDataParallel wrapper, subgroups, FSDP state) must be made
again by the user; the cell's error says so. A rank that died is replaced by a new one in its
slot (kernel/heal.py), which joins the rebuilt group; `copyable` says what of a survivor's
namespace can be copied into it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from datetime import timedelta

from . import torchdist

# The signal a heal sends a rank stuck in a collective: its process groups are aborted from a
# thread of its own, since its main thread may be blocked in C (gloo, NCCL) where no Python
# handler runs. faulthandler's C handler turns it into bytes on a pipe that thread reads. A
# real-time one, as the stack-dump signal (SIGRTMAX - 1) and the kernel-death one (SIGRTMAX).
ABORT_SIGNAL = signal.SIGRTMAX - 2

# How long rank 0's fresh store waits for the others to join it.
REJOIN_TIMEOUT_S = 60.0

_store = None  # rank 0: the store opened for the rebuild, until rejoin() uses it


def release() -> bool:
    """In a rank whose request ended while peers may still wait on it: tears down every process
    group, so that those peers' pending operations fail. Returns whether there was one."""
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    abort_here()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group may fail its own teardown; it is gone either way
            pass
    return True


def abort_here() -> bool:
    """In a rank stuck in a collective that will never complete: fails its pending operations
    (gloo: its connections are closed; NCCL: its communicators aborted), so that the main thread
    returns with an error. The process groups are gone afterwards; rejoin() makes a new one.
    Returns whether there was a default group to abort."""
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    had = dist.is_available() and dist.is_initialized()
    # A DDP model (or FSDP, or a subgroup) still holds the group: destroying or even aborting it
    # leaves gloo's connections open and the peers waiting. Closing them is what frees the peers.
    torchdist.shutdown_sockets()
    try:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    except Exception:  # none left, or an older torch: the closed connections did it
        pass
    return had


def listen_for_abort():
    """In a rank (worker.main): ABORT_SIGNAL runs abort_here() on a thread of its own."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # a signal nobody reads must never block the rank
    faulthandler.register(ABORT_SIGNAL, file=write_end, all_threads=False, chain=False)

    def wait():
        while True:
            try:
                os.read(read_end, 65536)  # what faulthandler wrote: only the wake-up matters
            except OSError:
                return
            try:
                # faulthandler writes its dump in many pieces, so one signal can wake this loop
                # more than once: only the wake-up that found a group to abort says so.
                if abort_here():
                    print("ddip: this rank's process groups were aborted to free it from a broken "
                          "collective (heal)", file=sys.stderr, flush=True)
            except Exception as exc:  # never kill the rank from here
                print(f"ddip: aborting this rank's process groups failed: {exc}", file=sys.stderr, flush=True)

    threading.Thread(target=wait, name="ddip-heal-abort", daemon=True).start()


def open_store(world: int, timeout: float = REJOIN_TIMEOUT_S) -> int:
    """Rank 0: a fresh TCPStore server on a free port of this host; returns the port."""
    from torch.distributed import TCPStore

    global _store
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    _store = TCPStore(addr, 0, world, True, timedelta(seconds=timeout), wait_for_workers=False)
    return _store.port


def rejoin(backend: str, port: int, timeout: float = REJOIN_TIMEOUT_S) -> dict:
    """Every rank: the default process group again, same rank and world size, on rank 0's fresh
    store at MASTER_ADDR:port. MASTER_PORT follows, so code that reads it later finds a live
    store. Returns what the rank joined."""
    global _store
    import torch.distributed as dist

    release()
    rank, world = torchdist.joined or (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=str(port))
    store, _store = _store, None
    torchdist.init(backend, rank, world, rendezvous_timeout=timeout, store=store)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend()}


# Names of a rank's namespace a copy never takes: IPython's own (its history, the shell) and what
# every rank has anyway.
_NOT_COPIED = frozenset(("In", "Out", "exit", "quit", "get_ipython"))


def copyable(names=None) -> tuple[list[str], dict[str, str], list[str]]:
    """In the rank a new one copies from (heal's copy_from): the variables of its namespace to
    copy, the others with why not, and which of those are this rank's identity. `names`: those only (when one does not exist: no
    variable, and each missing name with why "missing"); None: every variable but IPython's own
    and private ones (a leading underscore). Open files, DDP wrappers and what is this rank's own
    identity (_Identity: its rank, its GPU, its data shard) are left out; what does not pickle is
    found by export(). A module travels by its name: the new rank imports it (`import torch` need
    not be run again)."""
    import io

    from IPython import get_ipython

    ns = sys.modules["__main__"].__dict__
    if names is None:
        shell = get_ipython()
        hidden = shell.user_ns_hidden if shell is not None else {}
        names = [n for n in ns if not n.startswith("_") and n not in _NOT_COPIED
                 and not (n in hidden and hidden[n] is ns[n])]
    keep, skipped, identity = [], {}, []
    missing = [n for n in names if n not in ns]
    if missing:
        return [], {n: "missing" for n in missing}, []
    me = _Identity()
    for name in names:
        value = ns[name]
        whose = me.held_by(name, value)
        if whose is not None:
            skipped[name] = whose
            identity.append(name)
        elif isinstance(value, type(sys)) and not getattr(value, "__name__", "").startswith("__main__"):
            keep.append(name)  # by its name (_travelling)
        elif isinstance(value, type(sys)):
            skipped[name] = "a module made in the notebook's code: make it again on the new rank"
        elif isinstance(value, io.IOBase):
            skipped[name] = "an open file: open it again on the new rank"
        elif _holds_a_process_group(value):
            skipped[name] = "it holds the old process group: make it again on the new rank"
        else:
            keep.append(name)
    return keep, skipped, identity


class _Identity:
    """What makes a rank itself, in the rank copied from: its rank and local rank, its GPU. A
    copy must not hand them to another rank: rank 1 with rank 0's `rank` would train as rank 0,
    quietly (its data shard, its device, its `if rank == 0:` logging and checkpoints), where a
    NameError tells the user at once."""

    # Variable names that say "a rank number" or "a GPU index": rank, local_rank, global_rank,
    # my_rank, RANK, gpu, gpu_id, device_id, local_device, dev.
    _NAMED = ("rank", "gpu", "device")

    def __init__(self):
        self.rank = int(os.environ.get("RANK", "-1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.own = f"rank {self.rank}'s own"

    def held_by(self, name: str, value) -> str | None:
        """Why `value` is this rank's identity (the reason copyable() gives), or None."""
        try:
            return self._int(name, value) or self._gpu(value) or self._sampler(value)
        except Exception:  # an object whose attributes can't be read: not known to be anyone's
            return None

    def _int(self, name: str, value) -> str | None:
        low = name.lower()
        if not isinstance(value, int) or isinstance(value, bool) or value not in (self.rank, self.local_rank) \
                or not (any(word in low for word in self._NAMED) or low == "dev"):
            return None
        gpu = "gpu" in low or "device" in low or low == "dev"  # a device index: the local rank's
        local = value == self.local_rank and ("local" in low or gpu or value != self.rank)
        which, var = ("local rank", "LOCAL_RANK") if local else ("rank", "RANK")
        return (self.own + f" {which} ({value}): set it again on the new rank "
                f"(int(os.environ['{var}']))")

    def _gpu(self, value) -> str | None:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(value, torch.device) or value.type == "cpu" \
                or value.index not in (None, self.local_rank):
            return None
        return (self.own + f" GPU ({value}): set it again on the new rank "
                f"(its own is cuda:LOCAL_RANK)")

    def _sampler(self, value) -> str | None:
        """A sampler built with this rank (DistributedSampler's `rank`), or a loader drawing from one."""
        for holder, how in ((value, "a {kind} with rank={rank}"),
                            (getattr(value, "sampler", None), "a loader whose sampler is a {kind} with rank={rank}")):
            rank = getattr(holder, "rank", None) if hasattr(holder, "num_replicas") else None
            if isinstance(rank, int) and not isinstance(rank, bool) and rank == self.rank:
                return (self.own + " data shard ("
                        + how.format(kind=type(holder).__name__, rank=rank) + "): make it again on the new rank")
        return None


def _holds_a_process_group(value) -> bool:
    """A DDP (or FSDP) wrapper: built on the process group the heal replaced."""
    dist = sys.modules.get("torch.nn.parallel")
    ddp = getattr(dist, "DistributedDataParallel", None)
    return ddp is not None and isinstance(value, ddp) or type(value).__name__ in ("FullyShardedDataParallel",)


class MainFunction:
    """A function defined in a rank's notebook code (its __main__), travelling without the
    globals it refers to: the new rank rebuilds it on its own namespace (`adopt`), as if the cell
    that defined it had run there, so it sees the model the user wraps again, not a copy."""

    def __init__(self, fn):
        self.code, self.name, self.qualname = fn.__code__, fn.__name__, fn.__qualname__
        self.defaults, self.kwdefaults, self.attrs = fn.__defaults__, fn.__kwdefaults__, dict(fn.__dict__)
        self.closure = fn.__closure__

    def rebuild(self, ns: dict):
        import types

        fn = types.FunctionType(self.code, ns, self.name, self.defaults, self.closure)
        fn.__qualname__, fn.__kwdefaults__ = self.qualname, self.kwdefaults
        fn.__dict__.update(self.attrs)
        return fn


class ModuleName:
    """A module of the rank's namespace (`import torch`, `import numpy as np`), travelling as its
    name: the new rank imports it from its own environment."""

    def __init__(self, module):
        self.name = module.__name__

    def rebuild(self, ns: dict):
        import importlib

        return importlib.import_module(self.name)


def _travelling(value):
    import types

    if isinstance(value, types.FunctionType) and value.__module__ == "__main__":
        return MainFunction(value)
    if isinstance(value, types.ModuleType):
        return ModuleName(value)
    return value


def export(names: list[str]) -> tuple[tuple[bytes, list] | None, dict[str, str]]:
    """In the rank copied from: `names` pickled together (what refers to the same object, as an
    optimizer to its model's parameters, still does), as ddip sends values (a CUDA tensor as its
    bytes, rebuilt on the receiver's own GPU; functions of __main__ without their globals), large
    buffers left out of band so that they travel in shared memory. Returns ((pickle, buffers) or
    None, name -> why it can't be pickled: those are left out). The notebook passes the parcel on
    unopened: it never imports the user's classes nor touches a GPU."""
    from ..messages import dumps

    ns = sys.modules["__main__"].__dict__
    failed = {}
    while True:
        values = {n: _travelling(ns[n]) for n in names if n not in failed}
        buffers = []
        try:
            return (dumps(values, buffer_callback=buffers.append), buffers) if values else None, failed
        except Exception:  # which one: each alone
            for name, value in values.items():
                try:
                    dumps(value, buffer_callback=lambda b: None)
                except Exception as exc:
                    failed[name] = f"{type(ns[name]).__name__} can't be pickled ({type(exc).__name__}: {exc})"
            if not failed.keys() & values.keys():
                raise  # only together (cannot happen): say so rather than loop


def adopt(parcel: tuple[bytes, list]) -> tuple[list[str], dict[str, str]]:
    """In a new rank: the copied variables (export()'s parcel) into its namespace, functions
    rebuilt on it. Returns (the names taken, name -> why not: a module this rank can't import)."""
    from ..messages import loads

    ns = sys.modules["__main__"].__dict__
    data, buffers = parcel
    values = loads(data, buffers=buffers)
    taken, failed = [], {}
    for name, value in values.items():
        try:
            ns[name] = value.rebuild(ns) if isinstance(value, (MainFunction, ModuleName)) else value
        except ImportError as exc:  # a module this rank's environment lacks: left out, and said
            failed[name] = f"module {value.name} could not be imported on the new rank ({exc})"
            continue
        taken.append(name)
    return sorted(taken), failed
