"""A one-shot launch's child rank (ddip.launch.oneshot is the notebook's side): what it runs
around the launched function (`rank_main`), `TorchDDPCtx`, which sets torch.distributed up
around it, and `import_star`, which fn may call.

Here, on a rank's side, because the children unpickle them: a function or class is sent by
reference to its module, so a child that ran ranch's function from ddip.launch would load the
notebook's launch machinery (Group, the hosts' placement) with it. The notebook's rank runs the
same `call` and `TorchDDPCtx`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

from .. import _core
from .. import gpus as _gpus
from . import sources as _sources
from . import torchdist

__all__ = ["TorchDDPCtx", "import_star", "call", "rank_main"]


def import_star(modules, ns: dict | None = None) -> list[str]:
    """`from mod import *` as a function (allowed inside functions), into `ns` — the caller's
    globals by default. Honours each module's __all__. Returns the names bound."""
    if isinstance(modules, str):
        modules = [modules]
    if ns is None:
        ns = sys._getframe(1).f_globals
    bound = []
    for name in modules:
        mod = importlib.import_module(name)
        names = getattr(mod, "__all__", None)
        if names is None:
            names = [n for n in vars(mod) if not n.startswith("_")]
        for n in names:
            ns[n] = getattr(mod, n)
            bound.append(n)
    return bound


class TorchDDPCtx:
    """Sets up torch.distributed in each rank around the launched function, and tears it down.

    backend: 'gloo' or 'nccl' (default: nccl with GPUs, gloo without).
    gpus: GPUs in any order, as positions in the notebook's visible list ([3, 2]: rank 0 on the
        notebook's cuda:3, rank 1 on its cuda:2), UUIDs, 'all', or None for CPU. ranch() gives
        each child rank its GPU in its environment before Python starts (CUDA_VISIBLE_DEVICES =
        the list, device LOCAL_RANK), so code that does model.to(rank) lands on the listed GPU.
        The notebook, as a rank, can't change its CUDA view: it uses its own device index, so
        there use torch.cuda.current_device() (or `ctx.device`) rather than the rank number.
    port: MASTER_PORT (default: the launch's free port). timeout: collective timeout in seconds
    (torch's default, 30 min). rendezvous_timeout: how long ranks wait for each other in
    init_process_group (60 s); a rank that never arrives is named."""

    def __init__(self, backend: str | None = None, gpus=None, port: int | None = None, *,
                 timeout: float | None = None, rendezvous_timeout: float = torchdist.RENDEZVOUS_TIMEOUT_S):
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend={backend!r} is not one of 'gloo', 'nccl' or None (automatic)")
        self.selected = _gpus.resolve(gpus) if gpus is not None else None
        self.gpus = [s.entry for s in self.selected] if self.selected is not None else None
        if backend == "nccl" and not self.gpus:
            raise ValueError("backend='nccl' needs GPUs: pass gpus=[...] (or use backend='gloo' on CPU)")
        if port is not None and not (isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536):
            raise ValueError(f"port must be a TCP port number, got {port!r}")
        for name, value in (("timeout", timeout), ("rendezvous_timeout", rendezvous_timeout)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.backend = backend or ("nccl" if self.gpus else "gloo")
        self.port = port
        self.timeout = timeout
        self.rendezvous_timeout = rendezvous_timeout
        self.device = None
        self._abort = None  # set by ranch in the notebook: why to give up the rendezvous
        self._store = None  # set by ranch in the notebook as rank 0: its store, opened before the children ran

    def __repr__(self):
        return f"TorchDDPCtx(backend={self.backend!r}, gpus={self.gpus}, port={self.port})"

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_abort"] = None  # the notebook's hook stays in the notebook
        state["_store"] = None  # ...and so does its store server
        return state

    def __enter__(self):
        import torch

        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if self.port is not None:
            os.environ["MASTER_PORT"] = str(self.port)
        elif "MASTER_PORT" not in os.environ:
            if world > 1:
                raise RuntimeError("MASTER_PORT is not set: run under ddip.ranch(), or pass port=")
            os.environ["MASTER_PORT"] = str(_core.plan.free_port("127.0.0.1"))
        self.device = self._select_device(torch, rank)
        torchdist.init(self.backend, rank, world, collective_timeout=self.timeout,
                       rendezvous_timeout=self.rendezvous_timeout, abort=self._abort, store=self._store)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:  # fn may have needed no collective: its peers may still be connecting
            torchdist.wait_for_peers(self._abort)
        torchdist.shutdown()
        return False

    def _select_device(self, torch, rank: int):
        if not self.gpus:
            return torch.device("cpu")
        if rank >= len(self.gpus):
            raise RuntimeError(f"rank {rank} has no GPU: only {len(self.gpus)} listed ({self.gpus})")
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if "DDIP_SLOT" in os.environ:
            # A ddip rank: its CUDA_VISIBLE_DEVICES lists the launch's GPUs; its own is LOCAL_RANK.
            index = local_rank
        else:
            # The notebook: its view can't change once CUDA started; use its own device index.
            index = self.selected[local_rank].position
            if index is None:
                raise RuntimeError(f"the notebook can't select GPU {self.gpus[local_rank]} by its index; "
                                   f"give the notebook's GPUs as positions (0, 1, ...) in gpus=")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)


def call(fn, args, kwargs, ctx, on_error, on_entered=None):
    """fn inside ctx; on_error() is called the moment fn (or ctx) raises, before ctx exits, so
    the launch hears of the failure before this rank's teardown makes its peers fail too.
    on_entered() is called once ctx is entered (a rendezvous in it is complete)."""
    reported = False
    try:
        with ctx if ctx is not None else contextlib.nullcontext():
            if on_entered is not None:
                on_entered()
            try:
                return fn(*args, **kwargs)
            except BaseException:
                reported = True
                on_error()
                raise
    except BaseException:
        if not reported:
            on_error()
        raise


def rank_main(fn, args, kwargs, ctx, sources=None):
    """What a child rank runs: fn in ctx, telling the launch at once when ctx is entered and
    when something raised (its reply, or its death, reaches the launch by itself). `sources`:
    the notebook's lines of fn's code (sources.take), for its debugger and tracebacks."""
    from ddip.rank.worker import notify

    _sources.give(fn, sources or {})
    return call(fn, args, kwargs, ctx, lambda: notify("failed"), lambda: notify("entered"))
