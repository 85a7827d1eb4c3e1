"""A persistent group of ranked worker processes, driven from the notebook.

Every request (a cell, an apply, a push, a pull) is a `_Request` object: it owns its sequence
number, its per-rank results and its mailbox. Whoever waits on the group pumps the runtime's
event stream and delivers each event into the mailbox of the request it belongs to (by the
rank's current request and the frame's sequence number); each request's own waiter then
processes its mailbox and calls its callbacks. So no caller can consume another's reply:
`status()`, a concurrent `run(ranks=[1])`, or a callback that raises never drop a result.
"""

from __future__ import annotations

import atexit
import collections
import importlib.util
import keyword
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from . import _core, gpus as _gpus
from . import hosts as _hosts
from . import template as _template
from . import heal as _heal
from .errors import HealError, HealReport, RankFailure, RemoteError, StartError
from .messages import dumps_framed, loads, loads_framed, picklable

# Event kinds from _core.Coordinator.next_event: (kind, slot, a, b, data, fds)
_OUTPUT, _FRAME, _EXITED, _DISCONNECTED, _FAILED, _UNRESPONSIVE, _RESPONSIVE, _TRUNCATED = range(8)
_LOST = 8  # a rank on another host, gone with its host's link or launcher (multi-host groups)
_STREAMS = {1: "stdout", 2: "stderr"}
# After Ctrl-C, a timeout or a failure interrupts the ranks, how long they get to report back.
INTERRUPT_GRACE_S = 5.0
# After one rank raised, how long the others get to finish before they are interrupted: in DDP
# code they are often waiting for the failed rank in a collective that would never return.
FAILURE_GRACE_S = 3.0
# After a heal tore the failed rank's process group down, how long its peers get to leave the
# collective by themselves (gloo: at once) before they are interrupted too.
HEAL_RELEASE_S = 1.0
# A death is final: the others are interrupted at once and the death is reported within this.
DEATH_REPORT_S = 0.8
# How long an idle rank's output is kept for the next cell (per rank); older output is dropped.
BACKGROUND_KEEP_BYTES = 64 * 1024
# The slice in which waiters pump events (they check for Ctrl-C between slices).
_SLICE_S = 0.05

_HEAL_WHAT = "ddip heal"  # the `what` of a heal's own requests (never healed themselves)

_open_groups: "weakref.WeakSet[Group]" = weakref.WeakSet()


@dataclass
class RankResult:
    """What one rank did for one request."""

    rank: int
    value: object = None
    stdout: str = ""
    stderr: str = ""
    error: RankFailure | None = None
    format: tuple | None = None  # (MIME bundle, metadata) of the last expression, as IPython's Out
    displays: list = field(default_factory=list)  # display() calls, when no on_display was given
    execution_count: int | None = None
    finished_at: float | None = None  # time.monotonic() when its reply (or death) arrived
    stacks: str | None = None  # where it was, when it did not stop after an interrupt
    _parts: tuple = field(default_factory=lambda: ([], []), repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.error is None


def free_port(host: str = "127.0.0.1") -> int:
    return _core.plan.free_port(host)


def gpu_count() -> int:
    """GPUs the notebook can see, counted without initializing CUDA in the notebook."""
    return len(_gpus.inventory()[0])


def parse_gpus(gpus) -> list[str]:
    """'all', '0,3', 2, [3, 2], UUIDs -> the CUDA_VISIBLE_DEVICES entries for the ranks, in
    order, checked against what the notebook can see (see ddip.gpus)."""
    return [s.entry for s in _gpus.resolve(gpus)]


def resolve_backend(backend, gpus) -> str | None:
    if backend in (None, "none", "None", False):
        return None
    if backend == "auto":
        if importlib.util.find_spec("torch") is None:
            return None
        return "nccl" if gpus else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not one of 'gloo', 'nccl', 'auto' or None")
    if backend == "nccl" and not gpus:
        raise ValueError("backend='nccl' needs GPUs: pass gpus=[...], or use backend='gloo' for CPU ranks")
    if importlib.util.find_spec("torch") is None:
        raise ValueError(f"backend={backend!r} needs PyTorch, which is not installed here")
    return backend


def cpu_count() -> int:
    return _core.plan.cpu_count()


def omp_threads(local_ranks: int) -> int:
    """OMP_NUM_THREADS for ranks that did not choose: the launch plan's one rule (this host's
    cores divided among its ranks; see cpp/ddip/plan.hpp)."""
    return _core.plan.omp_threads(cpu_count(), local_ranks)


def _positive_timeout(timeout, what="timeout"):
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ValueError(f"{what} must be a positive number of seconds (or None), got {timeout!r}")


class _Request:
    """One request to some ranks: its results, and the events delivered for it."""

    def __init__(self, group: "Group", seq: int, slots: list[int], what: str):
        self.seq = seq
        self.slots = slots
        self.what = what
        self.results = {s: RankResult(rank=group.rank_ids[s]) for s in slots}
        self.pending = set(slots)  # ranks whose reply (or death) has not been processed
        self.mailbox: collections.deque = collections.deque()  # filled by whoever pumps
        self.started = time.monotonic()
        self.failed_at = None  # when the first rank raised
        self.died_at = None  # when the first rank died or stopped answering heartbeats
        self.interrupted_at = None
        self.why = None  # why its ranks were interrupted: "ctrl-c", "timeout", "failure", "death"
        self.cancelled = False
        self.callback_errors: list[str] = []
        self.heal: _Healing | None = None  # set once its failure's peers are being released


class _Healing:
    """A heal under way for one failed request: the ranks released so far, and their requests."""

    def __init__(self, failed: list[int]):
        self.started = time.monotonic()
        self.failed = failed  # ranks whose exception left the others waiting
        self.stuck: list[int] = []  # ranks still running the request when the heal began
        self.released: set[int] = set()  # slots whose process group was torn down
        self.teardowns: list[_Request] = []
        self.report: HealReport | None = None


@dataclass
class _Callbacks:
    on_output: Callable | None = None  # (rank, "stdout" | "stderr", text), live
    on_display: Callable | None = None  # (rank, msg): a display() in the rank
    on_message: Callable | None = None  # (rank, obj): ddip.worker.notify(obj) in the rank
    on_done: Callable | None = None  # (RankResult): a rank finished, failed or died


class Group:
    """N ranked worker processes (one per GPU, or N CPU processes), each with its own namespace.

    >>> with Group(n=2) as g:
    ...     [r.value for r in g.run("import os; int(os.environ['RANK']) * 10")]
    [0, 10]
    """

    def __init__(self, n: int | None = None, gpus=None, backend: str | None = "auto",
                 timeout: float = 60.0, env: dict | None = None, *,
                 world_size: int | None = None, rank_ids: Sequence[int] | None = None,
                 master_addr: str = "127.0.0.1", master_port: int | None = None,
                 heartbeat_timeout: float = 10.0, warm: bool | None = None,
                 hosts=None, launcher: str | None = None, python: str | None = None,
                 bind: str | None = None):
        # Everything is checked before anything starts: bad input changes nothing.
        # hosts= (see ddip.hosts): ranks on several hosts, reached by `launcher` (ssh, slurm or a
        # template) running `python` there, connecting back to this machine's address `bind`.
        self._layout = None
        if gpus is not None and (hosts is not None or _hosts.host_qualified(gpus)):
            # hosts='node1,node2' with gpus='0,1' (every host) or gpus='node1:0,1 node2:2,3'.
            hosts, gpus = _hosts.with_gpus(hosts, gpus), None
        if hosts is not None:
            if n is not None or rank_ids is not None or world_size is not None:
                raise ValueError("with hosts=, the ranks per host (and their GPUs) come from hosts: "
                                 "leave out n=, rank_ids= and world_size=")
            self._layout = _hosts.layout(hosts, launcher, python, bind)
            n = self._layout.size
            master_addr = self._layout.master_addr
            warm = False  # remote ranks can't fork from this kernel's template; keep all alike
        elif launcher is not None or python is not None or bind is not None:
            raise ValueError("launcher=, python= and bind= are for groups across hosts: give hosts= too")
        if n is not None and gpus is not None:
            raise ValueError("give n= (CPU processes) or gpus= (one rank per GPU), not both")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"n must be a positive number of processes, got {n!r}")
        if env is not None and not (isinstance(env, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise ValueError("env must be a dict of strings to strings, e.g. env={'OMP_NUM_THREADS': '1'}")
        self._env = dict(env or {})
        gpu_ids = None
        if gpus is not None:
            # The user's own CUDA_VISIBLE_DEVICES (in env=) is the list that positions refer to.
            visible_env = self._env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
            who = "the group's env=" if "CUDA_VISIBLE_DEVICES" in self._env else "the notebook"
            gpu_ids = [s.entry for s in _gpus.select(gpus, visible_env, _gpus.physical_gpus(), who)]
        if n is None and gpu_ids is None:
            raise ValueError("give n= (the number of CPU processes) or gpus= ('all' or a list of GPU ids)")
        if rank_ids is not None:
            rank_ids = list(rank_ids)
            if not rank_ids or len(set(rank_ids)) != len(rank_ids) or not all(
                    isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in rank_ids):
                raise ValueError(f"rank_ids must be distinct ranks (integers >= 0), got {rank_ids!r}")
        size = n if n is not None else (len(rank_ids) if rank_ids is not None else len(gpu_ids))
        _positive_timeout(timeout)
        if timeout is None:
            raise ValueError("timeout must be a positive number of seconds, got None")
        _positive_timeout(heartbeat_timeout, "heartbeat_timeout")
        self.backend = resolve_backend(backend, gpu_ids if self._layout is None else
                                       [g for h in self._layout.hosts for g in (h.gpus or [])])
        self.gpus = gpu_ids
        self.rank_ids = rank_ids if rank_ids is not None else list(range(size))
        if len(self.rank_ids) != size:
            raise ValueError(f"rank_ids has {len(self.rank_ids)} entries for {size} processes")
        self.world_size = world_size if world_size is not None else size
        if gpu_ids is not None and max(self.rank_ids) >= len(gpu_ids):
            raise ValueError(f"{len(gpu_ids)} GPUs for ranks {self.rank_ids}: rank r uses the r-th GPU")
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self._master_addr = master_addr
        self._fixed_port = master_port
        self._warm = warm  # None/True: fork ranks from the kernel's rank template; False: cold
        self._coord = None
        self._generation = 0  # counts starts; a Pending belongs to one
        self._broken = None  # why the runtime stopped on its own, if it did
        self._seq = 0
        self._mu = threading.RLock()  # guards the state below; never held while waiting
        self._pumping = False  # one thread at a time takes events from the runtime
        self._cv = threading.Condition(self._mu)
        self._start()

    # -- life cycle ---------------------------------------------------------------------------

    def _worker_env(self, slot: int, port: int) -> list[str]:
        """Rank `slot`'s environment: ddip's own variables and env= on top of the notebook's (on
        another host: of that host's own), then torchrun's by the launch plan."""
        layout = self._layout
        remote = layout is not None and layout.remote(slot)
        ours = {"DDIP_SLOT": str(slot), "DDIP_SYS_PATH": os.pathsep.join(p for p in sys.path if p)}
        if self.backend:
            ours["DDIP_BACKEND"] = self.backend
        if "DDIP_RENDEZVOUS_TIMEOUT" in os.environ:
            ours["DDIP_RENDEZVOUS_TIMEOUT"] = os.environ["DDIP_RENDEZVOUS_TIMEOUT"]
        base = {} if remote else {k: v for k, v in os.environ.items()
                                  if k not in ("DDIP_SOCKET", "DDIP_BACKEND")}
        base.update(self._env)
        base.update(ours)
        if layout is None:
            local_rank, per_host = self.rank_ids[slot], dict(local_world_size=self.world_size)
            # Every rank sees the group's GPUs in the order given (rank r uses device r); CPU
            # ranks are kept off the GPUs, unless env= says otherwise.
            cuda = ",".join(self.gpus) if self.gpus is not None else (
                None if "CUDA_VISIBLE_DEVICES" in self._env else "")
            cores = cpu_count()
        else:
            host = layout.host(slot)
            local_rank, per_host = layout.local_rank[slot], layout.launch_env(slot)
            base["DDIP_HOST"] = host.name
            cuda = self._env.get("CUDA_VISIBLE_DEVICES", ",".join(host.gpus))
            cores = 0 if remote else cpu_count()  # another host counts its own cores
        cpu_ranks = cuda == "" or (cuda is None and not base.get("CUDA_VISIBLE_DEVICES"))
        env = _core.plan.rank_environment(
            [f"{k}={v}" for k, v in base.items()], local_rank, world_size=self.world_size,
            master_addr=self._master_addr, master_port=port, cuda_visible_devices=cuda,
            cpu_ranks=cpu_ranks, cores=cores, **per_host)
        return env

    @property
    def omp_num_threads(self) -> tuple[str, str]:
        """(OMP_NUM_THREADS the ranks get, who chose it)."""
        if "OMP_NUM_THREADS" in self._env:
            return self._env["OMP_NUM_THREADS"], "env="
        if "OMP_NUM_THREADS" in os.environ:
            return os.environ["OMP_NUM_THREADS"], "the notebook's environment"
        return str(omp_threads(self.world_size)), f"ddip: {cpu_count()} cores / {self.world_size} ranks"

    def _start(self):
        layout = self._layout
        if layout is None:
            self.master_port = self._fixed_port or free_port()
        else:
            self.master_port = self._fixed_port or layout.master_port()
        size = len(self.rank_ids)
        specs = [([sys.executable if layout is None or not layout.remote(slot) else layout.python,
                   "-c", "import ddip.worker; ddip.worker.main()"],
                  self._worker_env(slot, self.master_port), os.getcwd()) for slot in range(size)]
        # Wait for a template still importing torch only where the ranks will use it: for
        # torch.distributed, when the notebook itself uses torch, or when warm=True asked for it.
        uses_torch = self._warm is True or self.backend is not None or "torch" in sys.modules
        tmpl = _template.choose(specs, self._warm, self.timeout, wait=uses_torch)
        refusals = tmpl.refusals if tmpl is not None else 0
        remote = {}
        if layout is not None:
            launcher_env = [f"{k}={v}" for k, v in os.environ.items()]
            remote = dict(hosts=[(name, argv, launcher_env, slots) for name, argv, slots in layout.launchers()],
                          bind_address=layout.bind)
        self._coord = _core.Coordinator(specs, heartbeat_timeout_ms=int(self.heartbeat_timeout * 1000),
                                        rank_template=tmpl, **remote)
        _template.after_start(tmpl, refusals)
        self._generation += 1
        self._broken = None
        self._state = ["starting"] * size
        self._exits: dict[int, RankFailure] = {}
        self._running: dict[int, _Request] = {}  # slot -> the request it is busy with
        self._unresponsive: dict[int, float] = {}  # slot -> seconds without a heartbeat
        self._background = {s: collections.deque() for s in range(size)}  # idle ranks' output
        self._background_bytes = [0] * size
        self._background_dropped = [0] * size
        self._stack_replies: dict[int, dict[int, str]] = {}  # seq -> slot -> text
        self.info: list[dict] = [{} for _ in range(size)]
        deadline = time.monotonic() + self.timeout
        try:
            waiting = set(range(size))
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    ranks = ", ".join(str(self.rank_ids[s]) for s in sorted(waiting))
                    raise StartError(f"rank(s) {ranks} did not become ready within {self.timeout:g} s; "
                                     f"pass timeout= to wait longer")
                ev = self._coord.next_event(min(left, 0.25) * 1000)
                if ev is None:
                    continue
                kind, slot, a, b, data, fds = ev
                if kind == _FRAME and a == _core.HELLO:
                    self.info[slot] = loads(data)
                    self._state[slot] = "idle"
                    waiting.discard(slot)
                elif kind == _EXITED:
                    f = self._death(slot, a, b, data)
                    raise StartError(f"rank {f.rank} exited while starting ({f.evalue})"
                                     + (f"; last lines of its stderr:\n{f.stderr_tail}" if f.stderr_tail else ""))
                elif kind == _LOST:
                    f = self._lost(slot, data)
                    raise StartError(f"rank {f.rank} could not start: {f.evalue}")
                elif kind == _FAILED:
                    raise StartError(data.decode(errors="replace"))
                else:
                    with self._mu:
                        self._dispatch(ev)
        except BaseException:
            coord, self._coord = self._coord, None
            coord.close(0)
            raise
        _open_groups.add(self)

    def close(self, grace: float = 2.0):
        """Stops every rank (shutdown, then SIGTERM, then SIGKILL after `grace` s). Idempotent."""
        with self._mu:
            coord, self._coord = self._coord, None
            if coord is not None:
                self._state = ["closed"] * len(self._state)
                for req in set(self._running.values()):
                    for s in list(req.pending):
                        req.mailbox.append(("closed", s))
                self._running = {}
                self._cv.notify_all()
        if coord is not None:
            try:
                stuck = coord.close(int(grace * 1000))
            except KeyboardInterrupt:
                # Ctrl-C while ranks stop means "now": SIGKILL them at once, so the coordinator's
                # destructor (which runs holding the GIL) only reaps, instead of sitting out the
                # rest of the grace period with the notebook frozen.
                try:
                    coord.close(0)
                finally:
                    _open_groups.discard(self)
                raise
            if stuck:
                # Uninterruptible sleep (a hung GPU driver or network filesystem): nothing can
                # end it; say so rather than hang the notebook waiting for it.
                sys.stderr.write(f"ddip: rank process(es) {', '.join(map(str, stuck))} did not exit even after "
                                 f"SIGKILL (stuck in the kernel: a GPU driver or network filesystem?); "
                                 f"they were left behind\n")
        _open_groups.discard(self)

    def restart(self):
        """Kills every rank and starts fresh ones with the same settings (and a new MASTER_PORT)."""
        self.close()
        self._start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close(0.5)
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self._coord is None else f"pids={self.pids}"
        where = f"gpus={self.gpus}" if self.gpus is not None else f"n={self.size}"
        return f"<ddip.Group {where} backend={self.backend} {state}>"

    # -- properties ---------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.rank_ids)

    @property
    def closed(self) -> bool:
        return self._coord is None

    @property
    def pids(self) -> list[int]:
        """Each rank's pid; a rank on another host has its pid there (None until it is up)."""
        self._check_open()
        return [pid if pid >= 0 else self.info[slot].get("pid") for slot, pid in enumerate(self._coord.pids)]

    def device(self, rank: int) -> str:
        slot = self._slot(rank)
        if self._layout is not None:
            gpus = self._layout.gpus(slot)
            where = self._layout.hosts[self._layout.slot_host[slot]].name
            lr = self._layout.local_rank[slot]
            return f"{where}: cuda:{lr} (GPU {gpus[lr]})" if gpus else f"{where}: cpu"
        if self.gpus is None:
            return "cpu"
        r = self.rank_ids[slot]
        return f"cuda:{r} (GPU {self.gpus[r]})"

    def status(self) -> list[dict]:
        """Per rank: pid, device, state (idle / busy / dead / unresponsive), resident memory,
        heartbeat age, how long it has been busy with its current request, and its GPU use."""
        self._check_open()
        self._pump(0)
        gpu_use = _gpus.usage(self._coord.pids) if self.gpus is not None else {}
        rows = []
        now = time.monotonic()
        with self._mu:
            for slot, pid in enumerate(self._coord.pids):
                req = self._running.get(slot)
                state = self._state[slot]
                if slot in self._unresponsive and state != "dead":
                    state = "unresponsive"
                local = pid >= 0  # a rank on another host: its pid there, from its hello
                if not local:
                    pid = self.info[slot].get("pid")
                rows.append({"rank": self.rank_ids[slot], "pid": pid, "device": self.device(self.rank_ids[slot]),
                             "state": state, "rss_mb": _rss_mb(pid) if local else None,
                             "host": self.info[slot].get("host"),
                             "heartbeat_ms": self._coord.heartbeat_age_ms(slot),
                             "busy_s": (now - req.started) if req is not None else None,
                             "gpu": gpu_use.get(pid)})
        return rows

    # -- requests -----------------------------------------------------------------------------

    def run(self, code: str, ranks: Iterable[int] | None = None, *, on_output: Callable | None = None,
            on_display: Callable | None = None, timeout: float | None = None,
            values: bool = True) -> list[RankResult]:
        """Runs `code` in each selected rank's __main__ through IPython; one RankResult per rank.

        on_output(rank, stream, text) is called live; on_display(rank, msg) for display() calls.
        timeout: interrupt the ranks after that many seconds (TimeoutError; the stacks of ranks
        that did not stop are in its results). values=False brings back only the display form
        of the last expression (RankResult.format), never the object itself.
        Raises RemoteError (with every failing rank's traceback) if any rank raised."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a string, got {type(code).__name__}")
        _positive_timeout(timeout)
        if not isinstance(values, bool):
            raise TypeError(f"values must be True or False, got {values!r}")
        req = self._send({"op": "run", "code": code, "values": values}, ranks, "code")
        results = self._collect(req, _Callbacks(on_output, on_display), timeout, interrupt=True)
        self._raise_failures(results, "code", req.heal.report if req.heal else None)
        return results

    def apply(self, fn: Callable, *args, ranks: Iterable[int] | None = None, **kwargs) -> list:
        """Calls fn(*args, **kwargs) on each rank; a list of return values in rank order.
        (`ranks=` is taken by apply itself; the rest goes to fn.)"""
        return self.apply_async(fn, *args, ranks=ranks, **kwargs).result()

    def apply_async(self, fn: Callable, *args, ranks: Iterable[int] | None = None, **kwargs) -> "Pending":
        """Starts fn(*args, **kwargs) on each rank and returns at once; Pending.result() waits.
        Until then those ranks are busy: one request at a time per rank."""
        if not callable(fn):
            raise TypeError(f"apply needs a callable, got {type(fn).__name__}")
        what = f"{getattr(fn, '__name__', 'function')}()"
        req = self._send({"op": "apply", "fn": fn, "args": args, "kwargs": kwargs}, ranks, what)
        return Pending(self, req)

    def push(self, mapping: dict | None = None, /, ranks: Iterable[int] | None = None, **values):
        """Copies variables into each selected rank's namespace: push(x=1) or push({'x': 1})."""
        if mapping is not None and not isinstance(mapping, dict):
            raise TypeError(f"push takes a dict of names to values (or name=value), got {type(mapping).__name__}")
        ns = dict(mapping or {})
        ns.update(values)
        if not ns:
            raise ValueError("push needs something to push: push(x=1) or push({'x': 1})")
        bad = [k for k in ns if not (isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k))]
        if bad:
            raise ValueError(f"push needs variable names, got {bad!r}")
        try:
            req = self._send({"op": "push", "ns": ns}, ranks, "push")
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            culprits = [k for k, v in ns.items() if not picklable(v)]
            if not culprits:
                raise
            raise TypeError(f"can't push {', '.join(culprits)}: it can't be pickled "
                            f"({type(exc).__name__}: {exc}); nothing was pushed") from None
        self._raise_failures(self._collect(req, _Callbacks(), None), "push")

    def pull(self, names, rank: int = 0):
        """A variable's value from one rank (rank 0 by default); a list of names gives a list."""
        single = isinstance(names, str)
        if not single and not (isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)):
            raise TypeError(f"pull needs a variable name or a list of names, got {names!r}")
        name_list = [names] if single else list(names)
        if not name_list:
            raise ValueError("pull needs at least one variable name")
        bad = [n for n in name_list if not n.isidentifier()]
        if bad:
            raise ValueError(f"pull needs variable names, got {bad!r}")
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be a rank number, got {rank!r}")
        req = self._send({"op": "pull", "names": name_list}, [rank], "pull")
        results = self._collect(req, _Callbacks(), None)
        self._raise_failures(results, "pull")
        values = results[0].value
        return values[0] if single else values

    def interrupt(self, ranks: Iterable[int] | None = None):
        """KeyboardInterrupt in the code running on those ranks (all by default)."""
        self._check_open()
        for slot in self._slots(ranks):
            self._coord.signal(slot, signal.SIGINT)

    def kill(self, ranks: Iterable[int] | None = None, sig: int = signal.SIGKILL):
        """Sends `sig` to those ranks and everything they started (their process groups).
        A no-op once the group is closed; safe from another thread while a call waits."""
        sig = signal.Signals(sig)  # ValueError for a number that is no signal
        coord = self._coord
        if coord is None:
            return
        for slot in self._slots(ranks):
            coord.signal(slot, sig, True)

    def stacks(self, ranks: Iterable[int] | None = None, timeout: float = 3.0) -> dict[int, str]:
        """Every selected rank's Python stack (all threads), without stopping it: answered by
        the rank's runtime thread, so a rank busy in Python or stuck in C code answers too."""
        _positive_timeout(timeout)
        self._check_open()
        slots = self._slots(ranks)
        return {self.rank_ids[s]: text for s, text in self._stacks(slots, timeout).items()}

    def _stacks(self, slots, timeout) -> dict[int, str]:
        with self._mu:
            self._seq += 1
            seq = self._seq
            self._stack_replies[seq] = {}
            coord = self._coord
        live = [s for s in slots if s not in self._exits]
        try:
            if live and coord is not None:
                coord.send(live, _core.STACK_REQUEST, seq, b"")
            deadline = time.monotonic() + timeout
            while True:
                with self._mu:
                    got = self._stack_replies.get(seq, {})
                    if all(s in got for s in live) or self._coord is None:
                        break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._pump(min(left, _SLICE_S))
        finally:
            with self._mu:
                got = self._stack_replies.pop(seq, {})
        out = {}
        for s in slots:
            if s in self._exits:
                out[s] = f"(rank {self.rank_ids[s]} is dead: {self._exits[s].evalue})"
            else:
                out[s] = got.get(s, f"(rank {self.rank_ids[s]} did not answer within {timeout:g} s)")
        return out

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self):
        if self._coord is None:
            why = f" after a runtime failure ({self._broken})" if self._broken else ""
            raise RuntimeError(f"this group is closed{why}; create a new one (or call restart())")

    def _slot(self, rank: int) -> int:
        try:
            return self.rank_ids.index(rank)
        except ValueError:
            raise ValueError(f"no rank {rank!r} in this group (ranks: {self.rank_ids})") from None

    def _slots(self, ranks) -> list[int]:
        if ranks is None:
            return list(range(self.size))
        if isinstance(ranks, int):
            ranks = [ranks]
        try:
            ranks = list(ranks)
        except TypeError:
            raise TypeError(f"ranks must be a rank or a list of ranks, got {ranks!r}") from None
        slots = [self._slot(r) for r in ranks]
        if not slots:
            raise ValueError("no ranks selected")
        if len(set(slots)) != len(slots):
            raise ValueError(f"ranks={list(ranks)} lists a rank twice")
        return slots

    def _lost(self, slot, why: bytes) -> RankFailure:
        """A rank on another host, gone with its host's link (or launcher): a death."""
        f = RankFailure(rank=self.rank_ids[slot], ename="RankDied", evalue=why.decode(errors="replace"))
        self._state[slot] = "dead"
        self._exits[slot] = f
        return f

    def _death(self, slot, code, sig, tail) -> RankFailure:
        if code < 0:
            cause = "exit status unknown (something else in the notebook's process reaped it)"
        else:
            cause = f"killed by {_signal_name(sig)}" if sig else f"exit code {code}"
        f = RankFailure(rank=self.rank_ids[slot], ename="RankDied", evalue=cause,
                        stderr_tail=tail.decode(errors="replace"), exit_code=None if sig else code,
                        exit_signal=sig or None)
        self._state[slot] = "dead"
        self._exits[slot] = f
        return f

    # Pumping: one thread at a time takes events from the runtime and delivers them; the others
    # wait on the condition. Callbacks never run here (they run in their request's waiter).

    def _pump(self, timeout: float):
        """Delivers the events that arrive within `timeout` seconds (at least those already
        there) into their requests' mailboxes. Returns early once something was delivered."""
        with self._mu:
            if self._pumping:
                # Another thread pumps; it wakes us when it delivers something.
                if timeout > 0:
                    self._cv.wait(timeout)
                return
            coord = self._coord
            if coord is None:
                return
            self._pumping = True
        ev = None
        try:
            ev = coord.next_event(timeout * 1000 if timeout > 0 else 0)
            while ev is not None:
                with self._mu:
                    self._dispatch(ev)
                ev = None
                ev = coord.next_event(0)
        finally:
            with self._mu:
                if ev is not None:  # taken, then Ctrl-C landed before it was delivered
                    self._dispatch(ev)
                self._pumping = False
                self._cv.notify_all()

    def _dispatch(self, ev):
        """Puts one event where it belongs. Called with self._mu held; never raises."""
        kind, slot, a, b, data, fds = ev
        req = self._running.get(slot) if slot >= 0 else None
        if kind == _OUTPUT:
            if req is not None:
                req.mailbox.append(("output", slot, a, data))
            else:
                self._keep_background(slot, a, data)
        elif kind == _FRAME and a == _core.STACKS:
            replies = self._stack_replies.get(b)
            if replies is not None:
                replies[slot] = data.decode(errors="replace")
        elif kind in (_FRAME, _TRUNCATED) and a in (_core.DONE, _core.DISPLAY, _core.MESSAGE):
            if req is None or req.seq != b:
                _close_fds(fds)  # a reply to a request its rank no longer runs (cannot happen)
                return
            if kind == _TRUNCATED:
                _close_fds(fds)
                if a != _core.DONE:
                    return  # a display whose buffers were lost; the reply says the rest
                req.mailbox.append(("truncated", slot))
            else:
                req.mailbox.append(("frame", slot, a, data, fds))
            if a == _core.DONE:
                del self._running[slot]
                if self._state[slot] == "busy":
                    self._state[slot] = "idle"
        elif kind == _FRAME:
            _close_fds(fds)
        elif kind in (_EXITED, _LOST):
            f = self._death(slot, a, b, data) if kind == _EXITED else self._lost(slot, data)
            self._unresponsive.pop(slot, None)
            if req is not None:
                del self._running[slot]
                req.mailbox.append(("died", slot, f))
        elif kind == _UNRESPONSIVE:
            self._unresponsive[slot] = a / 1000
            if req is not None:
                req.mailbox.append(("unresponsive", slot, a / 1000))
        elif kind == _RESPONSIVE:
            self._unresponsive.pop(slot, None)
        elif kind == _FAILED:
            self._broken = data.decode(errors="replace")
            for r in set(self._running.values()):
                for s in list(r.pending):
                    r.mailbox.append(("broken", s, self._broken))
            self._running = {}
        self._cv.notify_all()

    def _keep_background(self, slot, stream, data):
        q = self._background[slot]
        q.append((stream, data))
        self._background_bytes[slot] += len(data)
        while self._background_bytes[slot] > BACKGROUND_KEEP_BYTES and len(q) > 1:
            _, old = q.popleft()
            self._background_bytes[slot] -= len(old)
            self._background_dropped[slot] += len(old)

    def _show_background(self):
        """Output ranks wrote while no request ran (a thread they started, say): shown, labelled,
        before the next request's output; only the last BACKGROUND_KEEP_BYTES per rank are kept."""
        with self._mu:
            pending = []
            for slot, q in self._background.items():
                if q or self._background_dropped[slot]:
                    pending.append((slot, list(q), self._background_dropped[slot]))
                    q.clear()
                    self._background_bytes[slot] = 0
                    self._background_dropped[slot] = 0
        out = LabelledOutput()
        for slot, items, dropped in pending:
            rank = self.rank_ids[slot]
            if dropped:
                out(rank, "stderr", f"[ddip: {dropped} bytes of earlier output from rank {rank} "
                                    f"were dropped while no cell was running]\n")
            for stream, data in items:
                out(rank, _STREAMS[stream], data.decode(errors="replace"))

    def _send(self, req, ranks, what) -> _Request:
        self._check_open()
        slots = self._slots(ranks)
        self._pump(0)
        self._show_background()
        with self._mu:
            self._check_open()
            dead = [self._exits[s] for s in slots if s in self._exits]
            if dead:
                d = dead[0]
                raise RuntimeError(f"rank {d.rank} is dead ({d.evalue}); call restart() to start the group again")
            busy = [self.rank_ids[s] for s in slots if s in self._running]
            if busy:
                raise RuntimeError(f"rank(s) {', '.join(map(str, busy))} still busy with an earlier request "
                                   f"(one that was interrupted but did not stop, or an apply_async not yet "
                                   f"collected); wait, g.interrupt(), or g.restart() (%makedip -r)")
            coord = self._coord
            # Pickled before anything is sent: a value that can't be pickled changes nothing.
            payload, segments = dumps_framed(req, lambda raw: (coord.put(raw),) * 2, coord.release)
            self._seq += 1
            request = _Request(self, self._seq, slots, what)
            try:
                coord.send(slots, _core.REQUEST, request.seq, payload, segments)
            finally:
                for segment in segments:  # the frames hold their own references now
                    coord.release(segment)
            for s in slots:
                self._running[s] = request
                self._state[s] = "busy"
        return request

    def _collect(self, req: _Request, cb: _Callbacks, timeout, *, interrupt: bool = True,
                 stop_waiting_at: float | None = None, on_failure: bool = True) -> list[RankResult]:
        """Waits for every rank of `req`. timeout (with interrupt=True): interrupt the ranks
        then, and raise TimeoutError. stop_waiting_at: a deadline after which we stop waiting
        (TimeoutError) and leave the request running. on_failure: interrupt the other ranks
        when one fails (False: the caller handles failures itself, as ranch does)."""
        deadline = None if timeout is None else req.started + timeout

        def interrupt_pending(reason):
            req.why, req.interrupted_at = reason, time.monotonic()
            coord = self._coord
            if coord is not None:
                for s in req.pending:
                    coord.signal(s, signal.SIGINT)

        while True:
            # Ctrl-C may land anywhere in here (in a callback too): the first one interrupts the
            # ranks and keeps collecting their replies; a second one stops waiting.
            try:
                self._drain_mailbox(req, cb)
                if req.heal is not None:
                    self._heal_release(req)  # ranks that left the collective release their peers
                if not req.pending:
                    break
                now = time.monotonic()
                if req.interrupted_at is not None:
                    grace = DEATH_REPORT_S if req.why == "death" else INTERRUPT_GRACE_S
                    wake = req.interrupted_at + grace
                    if now >= wake:
                        break
                else:
                    wake = now + 0.25
                    if req.died_at is not None and on_failure:
                        interrupt_pending("death")  # final: the others can't finish without it
                        continue
                    if req.failed_at is not None and on_failure:
                        if req.heal is not None:
                            if now >= req.heal.started + HEAL_RELEASE_S:
                                interrupt_pending("failure")  # waits in Python: Ctrl-C's way out
                                continue
                            wake = min(wake, req.heal.started + HEAL_RELEASE_S)
                        elif now >= req.failed_at + FAILURE_GRACE_S:
                            if not self._heal_begin(req):
                                interrupt_pending("failure")
                            continue
                        else:
                            wake = min(wake, req.failed_at + FAILURE_GRACE_S)
                    if deadline is not None and interrupt:
                        if now >= deadline:
                            interrupt_pending("timeout")
                            continue
                        wake = min(wake, deadline)
                if stop_waiting_at is not None:
                    if now >= stop_waiting_at:
                        err = TimeoutError(
                            f"{req.what}: stopped waiting after {stop_waiting_at - now + (now - req.started):.1f} s; "
                            f"rank(s) {self._ranks(req.pending)} are still running it (result() again to "
                            f"wait more, cancel() to interrupt them)")
                        err.results = [req.results[s] for s in req.slots]
                        raise err
                    wake = min(wake, stop_waiting_at)
                if self._coord is None and not req.mailbox:
                    for s in list(req.pending):  # closed under us (another thread)
                        req.mailbox.append(("closed", s))
                    continue
                self._pump(max(0.0, min(wake - now, _SLICE_S)))
            except KeyboardInterrupt:
                if req.why == "ctrl-c":
                    raise  # the request stays registered: its late replies still free the ranks
                interrupt_pending("ctrl-c")
        stuck = set(req.pending)
        if stuck:
            stacks = self._stacks(sorted(stuck), 2.0) if self._coord is not None else {}
            for s in stuck:
                r = req.results[s]
                r.stacks = stacks.get(s)
                if s in self._unresponsive:
                    r.error = self._unresponsive_failure(s, self._unresponsive[s])
                else:
                    r.error = RankFailure(
                        rank=self.rank_ids[s], ename="StillRunning",
                        evalue=f"did not stop within {DEATH_REPORT_S if req.why == 'death' else INTERRUPT_GRACE_S:g} s "
                               f"of being interrupted (waiting in C code, or in a collective for a failed "
                               f"rank?); it stays busy until it finishes: g.restart() (%makedip -r) ends it",
                        traceback=(["where it was:"] + r.stacks.splitlines()) if r.stacks else [])
            req.pending.clear()
        for r in req.results.values():
            r.stdout, r.stderr = "".join(r._parts[0]), "".join(r._parts[1])
        for msg in req.callback_errors:
            sys.stderr.write(msg)
        if req.heal is not None:
            self._heal_finish(req, stuck)
        if req.why == "ctrl-c":
            still = f"; rank(s) {self._ranks(stuck)} did not stop and are still busy" if stuck else ""
            err = KeyboardInterrupt(f"interrupted rank(s) {self._ranks(req.slots)}{still}")
            err.results = [req.results[s] for s in req.slots]  # stuck ranks' .stacks: where they were
            raise err
        if req.why == "timeout":
            err = TimeoutError(f"the request did not finish within {timeout:g} s, so rank(s) "
                               f"{self._ranks(req.slots)} were interrupted"
                               + (f"; rank(s) {self._ranks(stuck)} did not stop and are still busy "
                                  f"(their stacks are in .results[i].stacks)" if stuck else
                                  f"; they stopped after {time.monotonic() - req.started:.1f} s"))
            err.results = [req.results[s] for s in req.slots]
            raise err
        return [req.results[s] for s in req.slots]

    # -- heal -----------------------------------------------------------------------------------

    def heal(self) -> HealReport:
        """Rebuilds torch.distributed's default group on every rank, with the same ranks and world
        size (a fresh store and port), keeping every rank's namespace. Ranks still stuck in a
        collective broken by an earlier failure are released first (their peers' process groups
        are torn down). A dead rank still needs restart(). Raises HealError when it can't."""
        self._check_open()
        self._check_healable()
        with self._mu:
            dead = [self._exits[s] for s in range(len(self.rank_ids)) if s in self._exits]
        if dead:
            raise RuntimeError(f"rank {dead[0].rank} is dead ({dead[0].evalue}); call restart() to start "
                               f"the group again")
        started = time.monotonic()
        slots = list(range(len(self.rank_ids)))
        heal = _Healing([])
        heal.stuck = [self.rank_ids[s] for s in slots if s in self._running]
        for s in slots:  # still stuck in a collective, maybe: freed from their side
            if s in self._running:
                self._coord.signal(s, _heal.ABORT_SIGNAL)
        interrupted = None
        while True:
            self._release_idle(heal, slots)  # freeing whoever waits on them, as they become idle
            busy = [s for s in slots if s in self._running]
            if not busy:
                break
            now = time.monotonic()
            if interrupted is None and now >= started + HEAL_RELEASE_S:
                interrupted = now
                for s in busy:
                    self._coord.signal(s, signal.SIGINT)
            elif interrupted is not None and now >= interrupted + INTERRUPT_GRACE_S:
                report = HealReport(False, now - started, self.world_size, reason=(
                    f"rank(s) {self._ranks(busy)} did not leave what they were running (a collective "
                    f"that tearing its peers' groups down did not end, or code in C)"))
                raise HealError(report)
            self._pump(_SLICE_S)
        port = self._rebuild(heal.teardowns)
        return HealReport(True, time.monotonic() - started, self.world_size, released=heal.stuck, port=port)

    def _check_healable(self):
        if not self.backend:
            raise RuntimeError("this group has no torch.distributed to heal (backend none); start it with a "
                               "backend (%makedip -n 2, or Group(n=2)) to have ddip set it up")
        if self.world_size != len(self.rank_ids):
            raise RuntimeError("this group's ranks are part of a larger world (ranch's children): "
                               "they can't rebuild it on their own")

    def _heal_begin(self, req: _Request) -> bool:
        """A rank of `req` raised and others still run it after FAILURE_GRACE_S: in DDP code,
        waiting for it in a collective. Starts releasing them, when ddip owns torch.distributed."""
        if req.what == _HEAL_WHAT or req.died_at is not None:
            return False
        try:
            self._check_healable()
        except RuntimeError:
            return False
        failed = [self.rank_ids[s] for s in req.slots if s not in req.pending
                  and req.results[s].error is not None and not req.results[s].error.died]
        req.heal = _Healing(failed)
        req.heal.stuck = sorted(self.rank_ids[s] for s in req.pending)
        self._heal_release(req)
        for s in req.pending:  # from their side too: NCCL's peers are freed only by their own abort
            self._coord.signal(s, _heal.ABORT_SIGNAL)
        return True

    def _heal_release(self, req: _Request):
        """Tears down the process groups of the request's ranks that no longer run it."""
        self._release_idle(req.heal, req.slots, req.pending)

    def _release_idle(self, heal: _Healing, slots, running=()):
        """Each idle, live rank of `slots` not released yet lets go of its process groups."""
        for s in slots:
            if s in running or s in heal.released or s in self._running or s in self._exits:
                continue
            heal.released.add(s)
            try:
                heal.teardowns.append(self._internal_send([self.rank_ids[s]], _heal.release))
            except RuntimeError:  # died meanwhile: the heal's end reports it
                pass

    def _heal_finish(self, req: _Request, stuck: set):
        """After every rank of a healing request replied (or was given up on): the rebuild."""
        heal = req.heal
        interrupted = "it was interrupted (Ctrl-C); g.heal() or %makedip --heal tries again"
        released = [r for r in heal.stuck if self._slot(r) not in stuck]
        port, reason = None, ""
        if stuck:
            reason = (f"rank(s) {self._ranks(stuck)} stayed in the collective after the failed rank's group "
                      f"was torn down" + (" (NCCL waits on the GPU)" if self.backend == "nccl" else ""))
        elif req.died_at is not None:
            reason = "a rank died"
        elif req.why == "ctrl-c":
            reason = interrupted
        else:
            try:
                port = self._rebuild(heal.teardowns)
            except KeyboardInterrupt:
                reason = interrupted
            except (HealError, RuntimeError, TimeoutError) as exc:
                reason = str(exc)
        heal.report = HealReport(not reason, time.monotonic() - heal.started, self.world_size, heal.failed,
                                 released, port, reason)

    def _rebuild(self, teardowns: list[_Request]) -> int:
        """Every rank joins a fresh default group on a store rank 0 opens; returns its port."""
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        for t in teardowns:
            try:
                self._collect(t, _Callbacks(), None, stop_waiting_at=deadline, on_failure=False)
            except TimeoutError:
                raise RuntimeError(f"rank {t.results[t.slots[0]].rank} did not tear its process group down "
                                   f"within {INTERRUPT_GRACE_S:g} s") from None
        port = self._internal_call([0], _heal.open_store, self.world_size)[0]
        self._internal_call(self.rank_ids, _heal.rejoin, self.backend, port)
        self.master_port = port
        return port

    def _internal_send(self, ranks, fn, *args) -> _Request:
        return self._send({"op": "apply", "fn": fn, "args": args, "kwargs": {}}, ranks, _HEAL_WHAT)

    def _internal_call(self, ranks, fn, *args) -> list:
        req = self._internal_send(ranks, fn, *args)
        results = self._collect(req, _Callbacks(), _heal.REJOIN_TIMEOUT_S + INTERRUPT_GRACE_S)
        failed = [r for r in results if r.error is not None]
        if failed:
            raise RuntimeError(f"{fn.__name__} failed on {failed[0].error.describe()}")
        return [r.value for r in results]

    def _ranks(self, slots) -> str:
        return ", ".join(str(self.rank_ids[s]) for s in sorted(slots))

    def _unresponsive_failure(self, slot, age) -> RankFailure:
        return RankFailure(rank=self.rank_ids[slot], ename="Unresponsive",
                           evalue=f"no heartbeat for {age:.1f} s (stopped, swapped out, or its host is "
                                  f"unreachable); %makedip -r / g.restart() replaces it")

    def _drain_mailbox(self, req: _Request, cb: _Callbacks):
        while True:
            with self._mu:
                if not req.mailbox:
                    return
                item = req.mailbox.popleft()
            self._handle(req, item, cb)

    def _call(self, req: _Request, cb: _Callbacks, name: str, *args):
        """A callback that raises is reported (once per callback) and switched off; the request
        goes on."""
        fn = getattr(cb, name)
        if fn is None:
            return
        try:
            fn(*args)
        except KeyboardInterrupt:
            raise
        except Exception:
            setattr(cb, name, None)
            req.callback_errors.append(f"ddip: the {name} callback raised, so it was switched off for "
                                       f"this request (which went on):\n{traceback.format_exc()}")

    def _handle(self, req: _Request, item, cb: _Callbacks):
        tag, slot = item[0], item[1]
        if slot not in req.pending:
            if tag == "frame":
                _close_fds(item[4])
            return
        r = req.results[slot]
        if tag == "output":
            text = item[3].decode(errors="replace")
            r._parts[item[2] - 1].append(text)  # joined once at the end: += would be quadratic
            self._call(req, cb, "on_output", r.rank, _STREAMS[item[2]], text)
            return
        if tag == "frame":
            _, _, kind, data, fds = item
            if kind == _core.DONE:
                try:
                    self._fill(r, loads_framed(data, fds))
                except Exception as exc:
                    r.error = RankFailure(
                        rank=r.rank, ename="UnpicklingError",
                        evalue=f"its reply could not be unpickled in the notebook: {type(exc).__name__}: {exc} "
                               f"(is what it returned importable here?)")
                self._finish(req, slot, cb)
            else:
                _close_fds(fds)
                try:
                    msg = loads(data)
                except Exception:
                    return
                if kind == _core.MESSAGE:
                    self._call(req, cb, "on_message", r.rank, msg)
                elif cb.on_display is not None:
                    self._call(req, cb, "on_display", r.rank, msg)
                else:
                    r.displays.append(msg)
            return
        if tag == "truncated":
            r.error = RankFailure(rank=r.rank, ename="OSError",
                                  evalue="out of file descriptors: the notebook could not receive this rank's "
                                         "reply buffers (raise `ulimit -n`, or close files and DataLoader "
                                         "workers in the notebook)")
            self._finish(req, slot, cb)
        elif tag == "died":
            r.error = item[2]
            req.died_at = req.died_at or time.monotonic()
            self._finish(req, slot, cb)
        elif tag == "unresponsive":
            r.error = self._unresponsive_failure(slot, item[2])
            req.died_at = req.died_at or time.monotonic()
            self._finish(req, slot, cb)
        elif tag == "broken":
            r.error = RankFailure(rank=r.rank, ename="RuntimeFailure", evalue=item[2])
            self._finish(req, slot, cb)
        elif tag == "closed":
            r.error = RankFailure(rank=r.rank, ename="Closed", evalue="the group was closed while it ran")
            self._finish(req, slot, cb)

    def _finish(self, req: _Request, slot: int, cb: _Callbacks):
        r = req.results[slot]
        req.pending.discard(slot)
        r.finished_at = time.monotonic()
        if r.error is not None and not r.error.died and r.error.ename not in ("Unresponsive", "Closed") \
                and req.failed_at is None:
            req.failed_at = r.finished_at  # the others may be waiting for it in a collective
        self._call(req, cb, "on_done", r)

    @staticmethod
    def _fill(result: RankResult, reply: dict):
        result.value = reply.get("value")
        result.format = reply.get("format")
        result.execution_count = reply.get("execution_count")
        err = reply.get("error")
        if err:
            result.error = RankFailure(rank=result.rank, ename=err["ename"], evalue=err["evalue"],
                                       traceback=err.get("traceback") or [], exception=err.get("exception"))

    @staticmethod
    def _raise_failures(results: list[RankResult], what: str, heal: HealReport | None = None):
        failed = [r for r in results if r.error is not None]
        if failed:
            # Root cause first: a death, then exceptions in the order they came; interrupts we
            # caused, and ranks that never stopped, last.
            def rank_of(r):
                e = r.error
                kind = 0 if (e.died or e.ename == "Unresponsive") else 2 if e.ename == "KeyboardInterrupt" else \
                    3 if e.ename == "StillRunning" else 1
                return kind, r.finished_at if r.finished_at is not None else float("inf")
            failed.sort(key=rank_of)
            raise RemoteError([r.error for r in failed], results, what, heal)


def _close_fds(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class LabelledOutput:
    """An on_output callback: ranks' output written live, each line labelled with its rank.

    Writers share the streams, so a line is never continued by another writer: text that comes
    while another's line is unfinished starts a new line. A line redrawn with '\r' (a text
    progress bar) is labelled again after each '\r' and stays in place; two writers redrawing
    take turns on one line, padded so that nothing of the other's line shows. Used as a context
    manager (ranch), this process's own sys.stdout/sys.stderr (the notebook's rank) go through it
    too, unlabelled."""

    def __init__(self, label: str = "[rank {}] "):
        self._label = label
        self._lock = threading.RLock()
        self._lines: dict[str, dict] = {}  # stream -> its open line (_new_line)
        self._writers: dict = {}  # writer -> its state (_writer)
        self._replaced: dict = {}  # stream name -> the stream __enter__ replaced

    def __call__(self, rank, stream, text):
        self.write((rank, stream), self._label.format(rank), stream, text)

    def write(self, writer, label: str, stream: str, text: str, dest=None) -> None:
        """Writes `writer`'s text to sys.<stream> (or `dest`), labelled with `label`."""
        if not text:
            return
        with self._lock:
            line = self._lines.setdefault(stream, self._new_line())
            out: list[str] = []
            i = 0
            while i < len(text):
                ends = [j for j in (text.find("\r", i), text.find("\n", i)) if j >= 0]
                j = min(ends) if ends else len(text)
                end = text[j:j + 2] if text.startswith("\r\n", j) else text[j:j + 1]
                if j > i:
                    self._body(line, writer, label, text[i:j], end == "\r", out)
                if end:
                    self._end(line, writer, label, end, out)
                i = j + len(end)
            if dest is None:
                dest = self._replaced.get(stream) or getattr(sys, stream)
            if out:
                dest.write("".join(out))
                dest.flush()

    @staticmethod
    def _new_line() -> dict:
        # redraw: the line began after its writer's '\r' (a bar); at_cr: the cursor is back at its start
        return {"owner": None, "at_cr": False, "redraw": False, "col": 0, "span": 0}

    def _body(self, line, writer, label, body, then_cr, out):
        me = self._writer(writer)
        redraw = me["after_cr"] or then_cr  # a line that comes or goes with '\r': a bar
        owner = line["owner"]
        if owner not in (None, writer):
            if redraw and (line["at_cr"] or line["redraw"]):
                if not line["at_cr"]:
                    out.append("\r")  # two bars take turns on one line
                line["at_cr"] = True
                self._writer(owner)["displaced"] = True
            else:
                out.append("\n")  # another's unfinished line: ours starts below it
                line.update(self._new_line())
        start = line["owner"] != writer or line["at_cr"]  # a line of ours starts (or is redrawn)
        if start:
            out.append(label)
            line.update(owner=writer, at_cr=False, col=len(label), redraw=redraw)
            me["drawn"] = ""
        out.append(body)
        line["col"] += len(body)
        if start and line["span"] > line["col"]:  # blank what is left of a longer line drawn there
            out.append(" " * (line["span"] - line["col"]) + "\r" + label + body)
        line["span"] = max(line["span"], line["col"])
        me.update(after_cr=False, mid=True, displaced=False, drawn=me["drawn"] + body)

    def _end(self, line, writer, label, end, out):
        me = self._writer(writer)
        mine = line["owner"] == writer
        if mine and not line["at_cr"]:
            out.append(" " * (line["span"] - line["col"]))  # covers a longer line drawn there
        if end == "\r":
            if mine and not line["at_cr"]:
                out.append("\r")
                line.update(at_cr=True, col=0)
            me["after_cr"] = True
            return
        if mine or me["displaced"] or not me["mid"]:
            pad = 0
            if not mine and line["owner"] is not None:
                if me["displaced"] and line["redraw"]:
                    # Another's bar redraws over ours: our last state takes the line back, and its
                    # bar comes back below with its next redraw (or its end), never left half-way.
                    out.append("\r")
                    pad = line["span"] - len(label + me["drawn"])
                    self._writer(line["owner"])["displaced"] = True
                else:
                    out.append("\n")  # below the line another writer has open
            if not mine:  # our last draw (overwritten by another's), or an empty line of ours
                out.append(label + (me["drawn"] if me["displaced"] else "") + " " * max(0, pad))
            out.append("\n")
            line.update(self._new_line())
        # else: our line was ended already, by another's text below it
        me.update(after_cr=False, mid=False, displaced=False, drawn="")

    def _writer(self, writer) -> dict:
        # after_cr: its last text was '\r'; mid: its line is unfinished (shown, or displaced by
        # another's redraw, its last draw `drawn`)
        return self._writers.setdefault(writer, {"after_cr": False, "mid": False, "displaced": False,
                                                 "drawn": ""})

    class _Own:
        """This process's own stream while a LabelledOutput is entered: its text goes through it."""

        def __init__(self, out: "LabelledOutput", name: str, stream):
            self._out, self._name, self._stream = out, name, stream

        def write(self, text):
            if not isinstance(text, str):
                return self._stream.write(text)
            self._out.write("own", "", self._name, text, self._stream)
            return len(text)

        def writelines(self, lines):
            for text in lines:
                self.write(text)

        def flush(self):
            self._stream.flush()

        def __getattr__(self, name):
            return getattr(self._stream, name)

    def __enter__(self):
        for name in ("stdout", "stderr"):
            self._replaced[name] = getattr(sys, name)
            setattr(sys, name, LabelledOutput._Own(self, name, self._replaced[name]))
        return self

    def __exit__(self, *exc):
        for name, stream in self._replaced.items():
            current = getattr(sys, name)
            if isinstance(current, LabelledOutput._Own) and current._out is self:
                setattr(sys, name, stream)  # unless the user's code replaced it meanwhile
        self._replaced = {}


class Pending:
    """A request sent with apply_async. results()/result() wait for it; with timeout= they stop
    waiting (TimeoutError) and leave it running, so they can be called again; cancel()
    interrupts it. It holds no runtime resources: a closed group's sockets are not pinned."""

    def __init__(self, group: Group, req: _Request):
        self._group_ref = weakref.ref(group)
        self._generation = group._generation
        self._req = req
        self._what = req.what
        self._cb = _Callbacks()
        self._results: list[RankResult] | None = None
        self._on_failure = True  # interrupt the other ranks when one fails (ranch does its own)
        self._heal: HealReport | None = None

    @property
    def done(self) -> bool:
        """Whether every rank has replied (or died); does not wait."""
        if self._results is not None:
            return True
        group = self._live_group()
        group._pump(0)
        group._drain_mailbox(self._req, self._cb)
        return not self._req.pending

    def _live_group(self) -> Group:
        group = self._group_ref()
        if group is None or group._generation != self._generation or group._coord is None:
            raise RuntimeError("the group was restarted or closed since this request was sent; "
                               "its ranks are gone, and so is the request")
        return group

    def results(self, on_output: Callable | None = None, on_display: Callable | None = None,
                timeout: float | None = None, *, on_message: Callable | None = None,
                on_done: Callable | None = None) -> list[RankResult]:
        """Waits for every rank; per-rank RankResults, errors included (nothing is raised).
        on_done(result) is called as each rank finishes (or dies), so a caller can act on the
        first failure; on_message(rank, obj) receives ddip.worker.notify(obj) from ranks.
        timeout: stop waiting after that many seconds (TimeoutError); the request goes on."""
        _positive_timeout(timeout)
        if self._results is None:
            group = self._live_group()
            self._cb = _Callbacks(on_output, on_display, on_message, on_done)
            stop = None if timeout is None else time.monotonic() + timeout
            self._results = group._collect(self._req, self._cb, None, stop_waiting_at=stop,
                                           on_failure=self._on_failure)
            self._heal = self._req.heal.report if self._req.heal else None
            self._req = None  # nothing of the runtime is kept once collected
        return self._results

    def result(self, on_output: Callable | None = None, timeout: float | None = None) -> list:
        """Waits for every rank; their return values in rank order, or RemoteError.
        timeout: stop waiting after that many seconds (TimeoutError); the request goes on."""
        results = self.results(on_output=on_output, timeout=timeout)
        Group._raise_failures(results, self._what, self._heal)
        return [r.value for r in results]

    def cancel(self):
        """Interrupts the request's ranks (KeyboardInterrupt in their code); result() then
        reports how each one ended."""
        if self._results is not None:
            return
        group = self._live_group()
        for s in list(self._req.pending):
            group._coord.signal(s, signal.SIGINT)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:  # real-time signals have no name
        return f"signal {sig}"


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@atexit.register
def _close_all():
    for g in list(_open_groups):
        try:
            g.close(0.5)
        except Exception:
            pass
