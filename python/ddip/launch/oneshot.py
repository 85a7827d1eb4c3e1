"""One-shot launches: `ranch()` runs a function on ranked processes, the notebook as one of them.

    import ddip
    def train(lr):
        import os
        return int(os.environ["RANK"]) * lr
    ddip.ranch(3, train, 0.1)          # [0.0, 0.1, 0.2]; the notebook ran rank 0

Children are fresh `ddip.worker` processes (never forks of the notebook) started by a `Group`
for this launch only and stopped before `ranch` returns. The first failure in any rank (an
exception or a death) stops the others at once, so a peer blocked in a collective gets its
connections closed and returns; the notebook is never left waiting.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import os
import signal
import sys
import threading
import time
import traceback as _traceback
from typing import Callable

from .. import _core, gpus as _gpus
from ..errors import FailureKind, RankFailure, RemoteError, root_cause_first
from ..hosts import placement as _hosts
from ..kernel.displays import RankDisplays, notebook_env
from ..kernel.group import Group, free_port
from ..labels import LabelledOutput
from ..messages import dumps
from ..rank import torchdist
from .notebook_rank import NotebookRank

__all__ = ["ranch", "torchddp_launch", "TorchDDPCtx", "import_star"]

# After the first failure, how long ranks that already finished get to send their reply
# (their traceback) before they are killed too.
STOP_GRACE_S = 10.0
# After Ctrl-C in the notebook, how long the child ranks get to show where they were.
INTERRUPT_GRACE_S = 3.0
# After another rank failed, how long the notebook's fn may take to end by itself before it is
# interrupted.
INTERRUPT_DELAY_S = 0.5
# ...and how long after that failure the notebook is told why its rank is still running, when our
# interrupt has not landed yet (fn is importing, or in a call that doesn't return to Python).
INTERRUPT_NOTICE_S = 10.0
# How often the notebook's stack is looked at while our interrupt waits for a safe point.
_POLL_FIRST_S, _POLL_MAX_S = 0.005, 0.05
# Frames of the import system: every import that runs a module's code runs it under
# importlib._bootstrap._find_and_load (CPython 3.3 to 3.13, frozen or not).
_IMPORT_SYSTEM = frozenset({"importlib._bootstrap", "importlib._bootstrap_external", "_frozen_importlib",
                            "_frozen_importlib_external"})


# -- the public API -----------------------------------------------------------------------------


def ranch(nprocs: int | None, fn: Callable, *args, caller_rank: int | None = 0, gather: bool = True,
          ctx=None, need="", imports: str = "", gpus=None, warm: bool | None = None, hosts=None,
          launcher: str | None = None, python: str | None = None, bind: str | None = None,
          env: dict | None = None, **kwargs):
    """Runs fn(*args, **kwargs) on `nprocs` ranked processes and returns the results.

    caller_rank: the rank the notebook itself plays (0 by default), or None for all children.
    gather: True returns every rank's value in rank order; False only the caller's (or rank 0's).
    ctx: a context manager entered in every rank around fn (picklable with cloudpickle),
        e.g. TorchDDPCtx().
    need: notebook globals copied into each child's __main__ ("model data" or "model, data").
    imports: code run in each child's __main__ first ("import numpy as np").
    gpus: one GPU per rank, in any order (see TorchDDPCtx); each child gets its GPU in its
        environment before Python starts. Taken from ctx when it is a TorchDDPCtx with gpus.
    warm: None/True forks the children from the kernel's rank template (ddip.prewarm());
        False starts them cold.
    hosts: ranks across hosts, as Group(hosts=...) takes them ("localhost:2,node2:2", a dict,
        GPU lists). The notebook plays caller_rank (0), so this machine comes first and its count
        includes the notebook; nprocs is then the list's total (or None). launcher=, python=,
        bind= as for Group (docs/multihost.md).
    env: variables for the child ranks (on every host), on top of the ones they inherit.

    The notebook's process is left as it was found, also on error: its environment, the
    process groups fn created there (HF Trainer, Accelerator() and Lightning leave theirs),
    accelerate's and Lightning's process-wide state, the current CUDA device (docs/launch.md).

    Raises RemoteError naming the first failing rank (the root cause), then the others."""
    return _ranch(nprocs, fn, args, kwargs, caller_rank=caller_rank, gather=gather, ctx=ctx,
                  need=need, imports=imports, gpus=gpus, caller_globals=sys._getframe(1).f_globals,
                  warm=warm, hosts=hosts, launcher=launcher, python=python, bind=bind, env=env)


def torchddp_launch(nprocs: int, fn: Callable, *args, **kwargs):
    """ranch(nprocs, fn, *args, ctx=TorchDDPCtx(), gather=False, **kwargs): fn runs with
    torch.distributed initialized (gloo on CPU); returns the notebook's (rank 0's) value."""
    for reserved in ("ctx", "gather"):
        if reserved in kwargs:
            raise TypeError(f"torchddp_launch sets {reserved}= itself; call ranch() to choose it")
    opts = {k: kwargs.pop(k) for k in ("caller_rank", "need", "imports", "warm", "hosts", "launcher",
                                       "python", "bind", "env") if k in kwargs}
    gpus = kwargs.pop("gpus", None)
    if opts.get("hosts") is not None:
        # Across hosts the GPUs belong to the host list (the launch refuses them: see _lay_out).
        opts["gpus"] = gpus
        gpus = None
    return _ranch(nprocs, fn, args, kwargs, ctx=TorchDDPCtx(gpus=gpus), gather=False,
                  caller_globals=sys._getframe(1).f_globals, **opts)


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
            os.environ["MASTER_PORT"] = str(free_port())
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


# -- the launch ---------------------------------------------------------------------------------


def _parse_need(need) -> list[str]:
    if need is None:
        return []
    if isinstance(need, str):
        names = need.replace(",", " ").split()
    else:
        try:
            names = list(need)
        except TypeError:
            raise TypeError(f"need must be names separated by spaces or commas, got {need!r}") from None
    bad = [n for n in names if not (isinstance(n, str) and n.isidentifier())]
    if bad:
        raise ValueError(f"need names variables; {bad!r} {'is' if len(bad) == 1 else 'are'} not a name")
    return list(dict.fromkeys(names))


def _check(nprocs, fn, caller_rank, ctx, need, imports, caller_globals):
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive number of processes, got {nprocs!r}")
    if not callable(fn):
        raise TypeError(f"ranch needs a function to run, got {type(fn).__name__} {fn!r}")
    if caller_rank is not None and (isinstance(caller_rank, bool) or not isinstance(caller_rank, int)
                                    or not 0 <= caller_rank < nprocs):
        raise ValueError(f"caller_rank must be None or a rank from 0 to {nprocs - 1}, got {caller_rank!r}")
    if ctx is not None and not (hasattr(ctx, "__enter__") and hasattr(ctx, "__exit__")):
        raise TypeError(f"ctx must be a context manager (with __enter__ and __exit__), got {ctx!r}")
    if not isinstance(imports, str):
        raise TypeError(f"imports must be code as a string, got {type(imports).__name__}")
    if imports.strip():
        try:
            compile(imports, "<ranch imports>", "exec")
        except SyntaxError as exc:
            raise ValueError(f"imports is not valid Python: {exc}") from None
    names = _parse_need(need)
    missing = [n for n in names if n not in caller_globals]
    if missing:
        raise ValueError(f"need names {', '.join(map(repr, missing))}, which the notebook has not defined")
    return {n: caller_globals[n] for n in names}


def _check_picklable(what, obj):
    """Fails early, before anything starts, on what can't reach the ranks. Large buffers are not
    copied here (the request sends them through shared memory)."""
    try:
        dumps(obj, buffer_callback=lambda buffer: False)
    except Exception as exc:
        raise TypeError(f"{what} can't be sent to the ranks (cloudpickle failed: "
                        f"{type(exc).__name__}: {exc})") from exc


def _select_gpus(nprocs, gpus, ctx):
    ctx_sel = getattr(ctx, "selected", None) if isinstance(ctx, TorchDDPCtx) else None
    sel = _gpus.resolve(gpus) if gpus is not None else ctx_sel
    if gpus is not None and ctx_sel is not None and [s.entry for s in sel] != [s.entry for s in ctx_sel]:
        raise ValueError(f"gpus={gpus!r} and the ctx's gpus={ctx.gpus} differ; give the GPUs once")
    if sel is not None and len(sel) != nprocs:
        raise ValueError(f"{len(sel)} GPUs ({', '.join(s.entry for s in sel)}) for {nprocs} ranks: "
                         f"give one GPU per rank")
    return sel


def _check_env(env):
    if env is not None and not (isinstance(env, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("env must be a dict of strings to strings, e.g. env={'GLOO_SOCKET_IFNAME': 'eth0'}")
    return dict(env or {})


def _lay_out(nprocs, caller_rank, hosts, launcher, python, bind, gpus, ctx):
    """hosts= as Group takes it, laid out with the notebook playing `caller_rank` on this machine.
    Returns (layout, nprocs)."""
    if gpus is not None and (hosts is not None or _hosts.host_qualified(gpus)):
        # As Group: hosts='node1,node2' with gpus='0,1' (every host), or gpus='node1:0,1 node2:2,3'.
        hosts = _hosts.with_gpus(hosts, gpus)
    if hosts is None:
        if launcher is not None or python is not None or bind is not None:
            raise ValueError("launcher=, python= and bind= are for launches across hosts: give hosts= too")
        return None, nprocs
    if isinstance(ctx, TorchDDPCtx) and ctx.gpus:
        raise ValueError("across hosts, GPUs are given in hosts= (each host's own ids: "
                         "hosts='localhost[0,1] node2[0,1]'), not in TorchDDPCtx(gpus=...)")
    # What the host list says is checked before the network is asked anything (laying it out
    # resolves the other hosts' names): a list in the wrong order gets the same answer whether
    # or not its names resolve from here.
    parsed = hosts.hosts if isinstance(hosts, _hosts.Layout) else _hosts.parse_hosts(hosts)
    if isinstance(ctx, TorchDDPCtx) and any(h.gpus for h in parsed):
        raise ValueError("TorchDDPCtx across hosts runs on CPU with gloo: with GPU lists in hosts=, set up "
                         "torch.distributed in fn yourself (each rank's GPU is device LOCAL_RANK)")
    slot_host = [h for h in parsed for _ in range(h.ranks)]
    total = len(slot_host)
    if nprocs is not None and nprocs != total:
        raise ValueError(f"nprocs={nprocs!r}, but hosts= lists {total} ranks "
                         f"({' '.join(f'{h.name}:{h.ranks}' for h in parsed)}); "
                         f"give nprocs={total} or None (the notebook's rank is one of them)")
    if caller_rank is not None:
        if isinstance(caller_rank, bool) or not isinstance(caller_rank, int) or not 0 <= caller_rank < total:
            raise ValueError(f"caller_rank must be None or a rank from 0 to {total - 1}, got {caller_rank!r}")
        host = slot_host[caller_rank]
        if not host.local:
            raise ValueError(f"the notebook is rank {caller_rank} (caller_rank) and runs on this machine, but "
                             f"hosts= puts rank {caller_rank} on {host.name}: list this machine first, its "
                             f"count including the notebook (hosts='localhost:1,{host.name}:...'), or pass "
                             f"caller_rank=None to run every rank as a child process")
    layout = _hosts.layout(hosts, launcher, python, bind)
    if caller_rank is not None:
        layout.played_here = (caller_rank,)
    return layout, total


def _ranch(nprocs, fn, args, kwargs, *, caller_rank=0, gather=True, ctx=None, need="", imports="",
           gpus=None, caller_globals=None, warm=None, hosts=None, launcher=None, python=None, bind=None,
           env=None):
    # Everything is checked, and everything that travels is pickled, before anything starts.
    child_env = _check_env(env)
    layout, nprocs = _lay_out(nprocs, caller_rank, hosts, launcher, python, bind, gpus, ctx)
    needed = _check(nprocs, fn, caller_rank, ctx, need, imports, caller_globals or {})
    selected = _select_gpus(nprocs, gpus, ctx) if layout is None else None
    child_ranks = [r for r in range(nprocs) if r != caller_rank]
    if child_ranks:
        _check_picklable("fn, its arguments or ctx", (fn, args, kwargs, ctx))
    if needed and child_ranks:
        for name, value in needed.items():
            _check_picklable(f"need={name!r}", value)
    launch = _Launch(nprocs, caller_rank, child_ranks, selected)
    launch.warm = warm
    launch.layout = layout
    launch.env = child_env
    try:
        return launch.run(fn, args, kwargs, ctx, needed, imports, gather)
    finally:
        launch.cleanup()


class _Launch:
    """One ranch() call: the children's Group, the failures it hears of, and the notebook's rank.

    Children tell of their progress with ddip.worker.notify(): "entered" once ctx is entered,
    "failed" the moment fn (or ctx) raises, before ctx exits. Their replies and deaths come as
    on_done from the Group's Pending. All of it arrives in the collecting thread, as it happens."""

    def __init__(self, nprocs, caller_rank, child_ranks, selected=None):
        self.nprocs = nprocs
        self.selected = selected  # one ddip.gpus.Selected per rank, or None for CPU
        self.caller_rank = caller_rank
        self.child_ranks = child_ranks
        self.group: Group | None = None
        self.out: LabelledOutput | None = None  # the children's output (and the notebook's), labelled
        self.lock = threading.Lock()
        self.failed_at: dict[int, float] = {}  # rank -> when the launch heard it failed
        self.running: set[int] = set()  # child ranks past ctx.__enter__, not yet done or failed
        self.stopped: set[int] = set()  # child ranks we killed because another failed
        self.main_in_fn = False
        self.interrupt_sent = False  # ddip interrupted (or decided not to start) the notebook's fn
        self.interrupt_seen = False  # ...and fn got it
        self.main_ident = None
        self._sigint_prev = None  # the SIGINT handler _on_sigint stands in for while fn runs
        self._own_sigints = collections.deque()  # our SIGINTs sent, not yet taken by _on_sigint
        self._in_flight = False  # one of ours is sent and not put off: none more until it is
        self._stopper: threading.Thread | None = None
        self.saved_env: dict[str, str] | None = None
        self.store = None  # the notebook's (rank 0's) TCPStore, when ranch opened it for TorchDDPCtx
        self.warm = None  # Group(warm=...) for the children
        self.layout = None  # ddip.hosts.Layout across hosts (without the notebook's rank), or None
        self.env = {}  # env= for the children
        self.displays = RankDisplays()  # the children's display() calls, shown in the notebook
        self.notebook = NotebookRank()  # what fn changes in the notebook's process, undone after

    # The notebook's environment is restored exactly, whatever fn or ctx did to it.
    def _rank_env(self, rank, port) -> dict:
        """The notebook's environment as rank `rank`: the variable set its children get (the launch
        plan's), on top of its own environment; OMP_NUM_THREADS is not its to change now."""
        base = [f"{k}={v}" for k, v in os.environ.items()]
        if self.layout is None:
            env = _core.plan.rank_environment(base, rank, world_size=self.nprocs, master_port=port,
                                              cpu_ranks=self.selected is None)
        else:
            # Its place on this host among the host list's ranks; MASTER_ADDR is the address the
            # other hosts reach this machine at (the plan's), as for every child.
            plan = self.layout.plan
            h = plan.slot_host[rank]
            host = plan.hosts[h]
            env = _core.plan.rank_environment(
                base + [f"DDIP_HOST={host.name}"], plan.local_rank[rank], world_size=self.nprocs,
                local_world_size=host.ranks, rank_offset=plan.first_rank[h], group_rank=h,
                group_world_size=len(plan.hosts), master_addr=plan.master_addr, master_port=port,
                cpu_ranks=not host.gpus)
        return dict(e.split("=", 1) for e in env)

    def _set_env(self, new: dict):
        self.saved_env = dict(os.environ)
        for k in [k for k in os.environ if k not in new]:
            del os.environ[k]
        os.environ.update(new)

    def _restore_env(self):
        saved, self.saved_env = self.saved_env, None
        if saved is None:
            return
        for k in [k for k in os.environ if k not in saved]:
            del os.environ[k]
        for k, v in saved.items():
            if os.environ.get(k) != v:
                os.environ[k] = v

    def run(self, fn, args, kwargs, ctx, needed, imports, gather):
        port = own_env = None
        if self.child_ranks:
            env = {**notebook_env(), **self.env} or None
            if self.layout is not None:
                # The children on every host, numbered as in the host list (the notebook's left out).
                self.group = Group(hosts=self.layout, backend=None, warm=self.warm, env=env)
            elif self.selected is not None:
                gpus = [s.position if s.position is not None else s.entry for s in self.selected]
                self.group = Group(gpus=gpus, backend=None, world_size=self.nprocs, rank_ids=self.child_ranks,
                                   warm=self.warm, env=env)
            else:
                self.group = Group(n=len(self.child_ranks), backend=None, world_size=self.nprocs,
                                   rank_ids=self.child_ranks, warm=self.warm, env=env)
            port = self.group.master_port
            out = self.out = LabelledOutput()
            if imports.strip():
                try:
                    self.group.run(imports, on_output=out, on_display=self._on_display)
                except RemoteError as exc:
                    raise RemoteError(exc.failures, exc.results, "ranch's imports= code") from None
            if needed:
                self.group.push(needed)
            if self.caller_rank is not None:
                own_env = self._rank_env(self.caller_rank, port)
                if self.caller_rank == 0 and isinstance(ctx, TorchDDPCtx):
                    # Listening before the children are told to connect: a child refused by a port
                    # not listening yet sleeps 250-750 ms (torch's connect backoff) before it retries.
                    self.store = _open_store(ctx, own_env)
            pending = self.group.apply_async(_rank_main, fn, args, kwargs, ctx)
            pending.on_failure = False  # failure() below stops the right ranks at the right time
        if self.caller_rank is None:
            results = self._collect(pending, out)
            own = None
        else:
            collector = None
            if self.child_ranks:
                collector = _Collector(self, pending, out)
                collector.start()
            self._set_env(own_env or self._rank_env(self.caller_rank, free_port()))
            self.notebook.as_launched()
            try:
                # The notebook's own text goes through `out` too: its lines and its children's never mix.
                with out if self.child_ranks else LabelledOutput():
                    own = self._run_caller(fn, args, kwargs, ctx)
            finally:
                self._restore_env()
                self.notebook.look_interactive()
            # The user's Ctrl-C ended the notebook's rank (inside fn or around it): the children
            # stop now, not when they next need rank 0 (a rendezvous may wait minutes for it).
            ctrl_c = own is not None and own[0] == "error" and isinstance(own[1], KeyboardInterrupt) \
                and not self.interrupt_sent
            results = self._join(collector, stop=ctrl_c) if collector else []
        return self._finish(results, own, gather)

    # -- the notebook's own rank ------------------------------------------------------------------

    def _run_caller(self, fn, args, kwargs, ctx):
        """Runs fn as the caller's rank: ("ok", value) or ("error", exc, formatted traceback)."""
        if threading.current_thread() is threading.main_thread():
            self.main_ident = threading.get_ident()

        def body(*a, **kw):
            # Our interrupt (another rank failed) is only ever delivered inside here, never
            # while ctx sets up or tears down, and never inside an import.
            self._guard_sigint()
            try:
                with self.lock:
                    late = bool(self.failed_at)  # a rank failed while ctx was entering: don't start
                    self.main_in_fn = not late
                    self.interrupt_sent |= late
                if late:
                    self.interrupt_seen = True
                    raise KeyboardInterrupt("another rank failed")
                return fn(*a, **kw)
            finally:
                try:
                    with self.lock:
                        self.main_in_fn = False
                finally:
                    self._unguard_sigint()

        def on_error():
            exc = sys.exc_info()[1]
            if isinstance(exc, KeyboardInterrupt) and self.interrupt_sent:
                return  # ours: another rank failed first
            self.failure(self.caller_rank)

        if isinstance(ctx, TorchDDPCtx):
            ctx._abort = self._abort_reason  # a child that fails ends the notebook's rendezvous
            ctx._store = self.store
        try:
            return ("ok", _call(body, args, kwargs, ctx, on_error))
        except BaseException as exc:
            _drop_sigint_handler_frame(exc)
            tb = exc.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
                tb = tb.tb_next  # start at the user's code, not at ours
            return ("error", exc, _traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
        finally:
            if isinstance(ctx, TorchDDPCtx):
                ctx._abort = ctx._store = None

    def _abort_reason(self):
        with self.lock:
            failed = sorted(r for r in self.failed_at if r != self.caller_rank)
        return f"rank {failed[0]} failed before it arrived" if failed else None

    def _interrupt_main(self):
        """Gives the notebook control back when its fn waits, in Python, for a rank that failed.
        (A wait inside gloo ends by itself: the failed rank's peers are killed, so their
        connections close.)"""
        with self.lock:
            if not self.main_in_fn or self._stopper is not None or self._sigint_prev is None:
                return
            self._stopper = threading.Thread(target=self._stop_main, name="ddip-ranch-stopper", daemon=True)
        self._stopper.start()

    def _stop_main(self):
        """Sends our SIGINT to the notebook's fn, after a moment's delay that lets fn end by itself,
        and again each time the handler put it off (fn was importing), until it lands or fn ends."""
        started = time.monotonic()
        time.sleep(INTERRUPT_DELAY_S)
        poll, told = _POLL_FIRST_S, False
        while True:
            with self.lock:
                if not self.main_in_fn or self.interrupt_seen or self._sigint_prev is None:
                    return
                frame = sys._current_frames().get(self.main_ident)
                importing = _inside_import(frame)
                if importing is None and not self._in_flight:
                    self.interrupt_sent = self._in_flight = True
                    self._own_sigints.append(True)
                    signal.pthread_kill(self.main_ident, signal.SIGINT)
                unreached = self._in_flight
            if not told and time.monotonic() - started >= INTERRUPT_NOTICE_S and (importing or unreached):
                told = True
                self._tell_still_running(importing, frame)
            del frame
            time.sleep(poll)
            poll = min(poll * 2, _POLL_MAX_S)

    def _on_sigint(self, signum, frame):
        """SIGINT while fn runs in the notebook: the user's goes on as always; ours raises
        KeyboardInterrupt only where unwinding is safe, else _stop_main sends it again later."""
        # Only this handler takes from the deque (other threads append), so a look is enough; the
        # user's KeyboardInterrupt must not be raised inside an except block, or its traceback
        # carries that exception as its context.
        if not self._own_sigints:
            return self._sigint_prev(signum, frame)  # the user's Ctrl-C: as always
        self._own_sigints.popleft()
        if not self.main_in_fn:
            return  # fn has ended: ctx's teardown is never interrupted
        if _inside_import(frame) is not None:
            self._in_flight = False  # half-initialized modules would break the kernel until a restart
            return
        self.interrupt_seen = True
        raise KeyboardInterrupt("another rank failed")

    def _guard_sigint(self):
        # Only where SIGINT means KeyboardInterrupt, as in a kernel running a cell.
        if self.main_ident is not None and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._sigint_prev = signal.signal(signal.SIGINT, self._on_sigint)

    def _unguard_sigint(self):
        if self._sigint_prev is None:
            return
        try:
            # Ours, sent just as fn ended, is taken here by our handler, not in ctx's teardown.
            deadline = time.monotonic() + 1.0
            while self._own_sigints and time.monotonic() < deadline:
                time.sleep(0.001)
        finally:
            # Also undoes a handler fn left behind (Lightning ignores SIGINT after an interrupt).
            signal.signal(signal.SIGINT, self._sigint_prev)
            self._sigint_prev = None

    def _tell_still_running(self, importing, frame):
        with self.lock:
            failed = sorted((t, r) for r, t in self.failed_at.items() if r != self.caller_rank)
        first = f"rank {failed[0][1]}" if failed else "another rank"
        if importing:
            why = (f"it is inside `import {importing}`, which an interrupt would leave half-initialized; "
                   f"it is interrupted once the import completes")
        else:
            where = f" ({frame.f_code.co_name} at {frame.f_code.co_filename}:{frame.f_lineno})" \
                if frame else ""
            why = f"it is in a call that does not return to Python{where}; it is interrupted once it returns"
        print(f"ddip: {first} failed, but the notebook's rank {self.caller_rank} is still running fn: {why}",
              file=sys.stderr, flush=True)

    # -- failures -------------------------------------------------------------------------------

    def failure(self, rank: int):
        """A rank raised or died: stop every child still running fn, at once."""
        with self.lock:
            if rank in self.failed_at:
                return  # heard already ("failed", then its reply or death)
            self.failed_at[rank] = time.monotonic()
            self.running.discard(rank)
            if rank in self.stopped:
                return  # one we killed (or that failed by itself just as we did)
            # Only ranks past ctx.__enter__: killing one in the middle of a rendezvous (gloo
            # connecting its full mesh) would leave its peers waiting for it until the timeout.
            victims, self.running = self.running, set()
            self.stopped |= victims
        self._kill(victims)
        if rank != self.caller_rank:
            self._interrupt_main()

    def _on_message(self, rank: int, what):
        if what == "failed":
            self.failure(rank)
        elif what == "entered":
            # Past ctx.__enter__, fn starts; if another rank failed already, stop it now.
            with self.lock:
                late = bool(self.failed_at)
                (self.stopped if late else self.running).add(rank)
            if late:
                self._kill([rank])

    def _on_done(self, result):
        if result.error is not None:
            self.failure(result.rank)
        else:
            with self.lock:
                self.running.discard(result.rank)

    def _on_display(self, rank: int, msg):
        # display() in a child, in the notebook when there is one (its display ids its own, as
        # in %%dip); in a script, only the text form, labelled like the child's other output.
        if notebook_env():
            sys.stdout.flush()
            self.displays.show(rank, msg)
        elif not msg.get("clear") and not msg.get("update"):
            text = (msg.get("data") or {}).get("text/plain", "")
            if text:
                self.out(rank, "stdout", text if text.endswith("\n") else text + "\n")

    def _kill(self, ranks, sig=signal.SIGKILL):
        """Signals child ranks (their whole process groups) through the runtime, which knows
        whether each is still running; after the group closed this does nothing."""
        if self.group is not None and ranks:
            self.group.kill(ranks, sig)

    # -- collecting -------------------------------------------------------------------------------

    def _collect(self, pending, out):
        results = pending.results(on_output=out, on_display=self._on_display, on_message=self._on_message,
                                  on_done=self._on_done)
        if any(not r.ok for r in results) or self.failed_at:
            # Ranks that raised may still hold connections their peers wait on.
            self.group.close(0)
        return results

    def _join(self, collector: "_Collector", stop: bool = False):
        try:
            while not stop and collector.is_alive():
                collector.join(0.1)
                with self.lock:
                    started = min(self.failed_at.values(), default=None)
                if started is not None and time.monotonic() - started > STOP_GRACE_S:
                    # Failed ranks that never replied (stuck in ctx.__exit__, say): kill them too.
                    with self.lock:
                        rest = [r for r in self.child_ranks if r not in self.stopped]
                        self.stopped.update(r for r in rest if r not in self.failed_at)
                    self._kill(rest)
                    collector.join()
        except KeyboardInterrupt:
            self._interrupt_children(collector)
            raise
        if stop:
            self._interrupt_children(collector)
        if collector.error is not None:
            raise collector.error
        return collector.results

    def _interrupt_children(self, collector: "_Collector"):
        """Ctrl-C while the children are still busy: interrupt them (their tracebacks show where
        they were), then kill what is left after the grace."""
        self._kill(self.child_ranks, signal.SIGINT)
        collector.join(INTERRUPT_GRACE_S)
        with self.lock:
            self.stopped.update(self.child_ranks)
        self._kill(self.child_ranks)
        collector.join()

    def _finish(self, results, own, gather):
        failures = []
        for r in results:
            f = r.error
            if f is None:
                continue
            if r.rank in self.stopped and f.died and f.exit_signal == signal.SIGKILL:
                # Killed by us because another rank failed: not a failure of its own.
                f = RankFailure(rank=r.rank, kind=FailureKind.STOPPED, evalue="stopped", stderr_tail=f.stderr_tail,
                                exit_signal=f.exit_signal)
            f.at = self.failed_at.get(r.rank, f.at)  # when this launch heard of it
            failures.append(f)
        if own is not None and own[0] == "error":
            exc = own[1]
            ours = isinstance(exc, KeyboardInterrupt) and self.interrupt_sent
            if isinstance(exc, KeyboardInterrupt) and not ours:
                raise exc  # the user's Ctrl-C: the children are already stopped
            if ours:
                failures.append(RankFailure(rank=self.caller_rank, kind=FailureKind.STOPPED, evalue="interrupted"))
            else:
                failures.append(RankFailure(rank=self.caller_rank, ename=type(exc).__name__, evalue=str(exc),
                                            traceback=[l.rstrip("\n") for l in own[2]], exception=exc,
                                            at=self.failed_at.get(self.caller_rank)))
        if failures:
            failures = root_cause_first(failures)
            root = failures[0]
            for f in failures[1:]:
                if f.kind is FailureKind.STOPPED:
                    f.evalue = f"{f.evalue} after rank {root.rank} failed"
            for f in failures:
                where = self._remote_host(f.rank)
                if where is not None:  # a rank on another host is named with its host
                    f.evalue = f"{f.evalue} (on {where})" if f.evalue else f"(on {where})"
            err = RemoteError(failures, results, "ranch")
            if root.rank == self.caller_rank and own is not None and own[0] == "error":
                raise err from own[1]
            raise err
        values = {r.rank: r.value for r in results}
        if own is not None:
            values[self.caller_rank] = own[1]
        if gather:
            return [values[r] for r in range(self.nprocs)]
        return values[self.caller_rank if self.caller_rank is not None else 0]

    def _remote_host(self, rank: int) -> str | None:
        """The host a rank runs on, when that is not this machine."""
        if self.layout is None:
            return None
        host = self.layout.hosts[self.layout.plan.slot_host[rank]]
        return None if host.local else host.name

    def cleanup(self):
        self._restore_env()
        self.notebook.look_interactive()
        if self.group is not None:
            self.group.close(0.5)
            self.group = None
        # The children are gone: what fn created in the notebook (process groups hosting the
        # store they used, accelerate's state) can go too.
        self.notebook.restore()
        torchdist.release()
        self.store = None


class _Collector(threading.Thread):
    """Collects the children's replies (printing their output live) while the notebook runs fn."""

    def __init__(self, launch: _Launch, pending, out):
        super().__init__(name="ddip-ranch-collector", daemon=True)
        self.launch, self.pending, self.out = launch, pending, out
        self.results = None
        self.error = None

    def run(self):
        try:
            self.results = self.launch._collect(self.pending, self.out)
        except BaseException as exc:
            self.error = exc
            self.launch._kill(self.launch.child_ranks)
            self.launch._interrupt_main()


def _inside_import(frame) -> str | None:
    """The outermost module whose import is running on the stack that `frame` tops, or None.

    The import system's own frames on the stack are the sign: they are there for every import,
    in every CPython from 3.9 to 3.13, and need no private structure (the module locks' layout
    changed in 3.12, and a lock is not even taken for every import)."""
    name, inner = None, None
    while frame is not None:
        if frame.f_globals.get("__name__") in _IMPORT_SYSTEM:
            if name is None:
                name = "?"
            if inner is not None and inner.f_code.co_name == "<module>" \
                    and inner.f_globals.get("__name__") not in _IMPORT_SYSTEM:
                name = inner.f_globals.get("__name__", "?")
        inner, frame = frame, frame.f_back
    return name


def _drop_sigint_handler_frame(exc):
    # The user's Ctrl-C ends where fn was, as it did before _on_sigint stood in for the handler.
    tb, last = exc.__traceback__, None
    while tb is not None and tb.tb_next is not None:
        last, tb = tb, tb.tb_next
    if last is not None and tb.tb_frame.f_code is _Launch._on_sigint.__code__:
        last.tb_next = None


def _open_store(ctx: TorchDDPCtx, env: dict):
    """Rank 0's store server for ctx, listening on the port ctx will use, or None when it can't
    be opened (the notebook's ctx then tries itself, and fails as the rank's own error)."""
    try:
        return torchdist.serve(env.get("MASTER_ADDR", "127.0.0.1"), ctx.port or int(env["MASTER_PORT"]),
                               int(env["WORLD_SIZE"]), ctx.rendezvous_timeout)
    except Exception:
        return None


# -- in every rank ------------------------------------------------------------------------------


def _call(fn, args, kwargs, ctx, on_error, on_entered=None):
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


def _rank_main(fn, args, kwargs, ctx):
    """What a child rank runs: fn in ctx, telling the launch at once when ctx is entered and
    when something raised (its reply, or its death, reaches the launch by itself)."""
    from ddip.rank.worker import notify

    return _call(fn, args, kwargs, ctx, lambda: notify("failed"), lambda: notify("entered"))
