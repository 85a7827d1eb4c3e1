"""A persistent group of ranked worker processes, driven from the notebook: the public API.

`Group` checks its configuration (everything before anything starts: bad input changes nothing),
builds each rank's environment with the launch plan, starts and stops the ranks, and offers the
requests (run, apply, push, pull), signals, stacks, status and heal. Underneath, each start is a
`Runtime` (ddip/kernel/runtime.py: the Coordinator, its event stream, the ranks' state and mailboxes);
each request is a `Request` with its wait policy (ddip/kernel/request.py); heal's kernel side is
ddip/kernel/heal.py; labelled output is ddip/labels.py.
"""

from __future__ import annotations

import atexit
import keyword
import os
import pickle
import signal
import sys
import time
import weakref
from typing import Callable, Iterable, Sequence

from .. import _core, gpus as _gpus
from ..errors import GroupClosedError, HealReport, RankFailedError
from ..hosts import allocation as _allocation
from ..hosts import keeper as _keeper
from ..hosts.placement import cpu_count, omp_threads
from ..labels import LabelledOutput
from .. import messages as _msg
from ..messages import picklable
from ..rank import command as rank_command
from . import debugger as _debugger
from . import heal as _heal
from .collectives import CollectivePicture, Stacks
from .panel_view import RankStatus
from .stragglers import LAST as _LAST, Stragglers, checked_last as _checked_last
from . import template as _template
from .request import (Callbacks, Pending, RankResult, sent_and_collected, positive_timeout as _positive_timeout,
                      raise_failures)
from .request import SLICE_S as _SLICE_S
from .runtime import BACKGROUND_KEEP_BYTES, Runtime  # noqa: F401
from .spec import RanksSpec, check_env, resolve_backend  # noqa: F401  (resolve_backend: the magics')

_open_groups: "weakref.WeakSet[Group]" = weakref.WeakSet()
# How long a host's agent holds its ranks' replies to a request for the rest of them, to send
# them as one frame (the runtime's default; tests lengthen it to count the frames).
REPLY_WINDOW_MS = _core.REPLY_WINDOW_MS


def free_port(host: str = "127.0.0.1") -> int:
    return _core.plan.free_port(host)


def gpu_count() -> int:
    """GPUs the notebook can see, counted without initializing CUDA in the notebook."""
    return len(_gpus.inventory()[0])


def parse_gpus(gpus) -> list[str]:
    """'all', '0,3', 2, [3, 2], UUIDs -> the CUDA_VISIBLE_DEVICES entries for the ranks, in
    order, checked against what the notebook can see (see ddip.gpus)."""
    return [s.entry for s in _gpus.resolve(gpus)]


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
                 bind: str | None = None, slurm=None):
        # slurm=: nodes asked of Slurm first (the wait shown, Ctrl-C cancels), then ranks on them
        # as in any allocation; the group owns the job and ends it when it closes (or fails to start).
        self._allocation = slurm if isinstance(slurm, _allocation.SlurmAllocation) else None
        env_of_launchers = None
        try:
            if slurm is not None:
                _check_slurm_group(slurm, n, gpus, hosts, launcher, rank_ids, world_size, timeout, env)
            if self._allocation is None and slurm is not None:
                self._allocation = _allocation.SlurmAllocation.request(slurm)
            if self._allocation is not None:
                hosts, launcher = self._allocation.hosts(), "slurm"
                env_of_launchers = self._allocation.launcher_env()
            self._set_up(n, gpus, backend, timeout, env, world_size, rank_ids, master_addr, master_port,
                         heartbeat_timeout, warm, hosts, launcher, python, bind, env_of_launchers)
        except BaseException:
            if self._allocation is not None:
                self._allocation.close()  # nothing is left of a group that did not start
            raise

    def _set_up(self, n, gpus, backend, timeout, env, world_size, rank_ids, master_addr, master_port,
                heartbeat_timeout, warm, hosts, launcher, python, bind, env_of_launchers):
        # Everything is checked before anything starts: bad input changes nothing. Where the
        # ranks run and with what is the launch spec's to check (ranch's too); their count is ours.
        rank_ids = None if rank_ids is None else list(rank_ids)
        _check_counts(n, gpus, rank_ids)

        def counts_from_hosts(_parsed):
            if n is not None or rank_ids is not None or world_size is not None:
                raise ValueError("with hosts=, the ranks per host (and their GPUs) come from hosts: "
                                 "leave out n=, rank_ids= and world_size=")

        spec = RanksSpec.checked(hosts=hosts, gpus=gpus, env=env, warm=warm, backend=backend, launcher=launcher,
                                 python=python, bind=bind, launcher_env=env_of_launchers,
                                 check_hosts=counts_from_hosts)
        self._layout, self._env, gpu_ids = spec.layout, spec.env, spec.gpus
        if spec.layout is not None:
            # All of the host list's ranks, or (ranch) all but those the notebook plays itself.
            n, rank_ids, world_size = spec.layout.size, spec.layout.rank_ids, spec.layout.world_size
            master_addr = spec.layout.master_addr
        if n is None and gpu_ids is None:
            raise ValueError("give n= (the number of CPU processes) or gpus= ('all' or a list of GPU ids)")
        size = n if n is not None else (len(rank_ids) if rank_ids is not None else len(gpu_ids))
        _positive_timeout(timeout)
        if timeout is None:
            raise ValueError("timeout must be a positive number of seconds, got None")
        _positive_timeout(heartbeat_timeout, "heartbeat_timeout")
        self.backend = spec.backend
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
        self._warm = spec.warm  # None/True: fork ranks from the kernel's rank template; False: cold
        self._rt: Runtime | None = None  # the current start's runtime; None once closed
        self._generation = 0  # counts starts; a Pending belongs to one
        self._broken = None  # why the last runtime stopped on its own, if it did
        self.last_error: RankFailedError | None = None  # the last run/apply failure: debug()'s default
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
        specs = [(rank_command(layout.python if layout is not None and layout.remote(slot) else None),
                  self._worker_env(slot, self.master_port), os.getcwd()) for slot in range(size)]
        # Wait for a rank template still importing torch only where the ranks will use it: for
        # torch.distributed, when the notebook itself uses torch, or when warm=True asked for it.
        uses_torch = self._warm is True or self.backend is not None or "torch" in sys.modules
        # Ranks here fork from the kernel's rank template; ranks on another host from that host's own,
        # kept by its standing agent (docs/warm.md, "Other hosts").
        here = [spec for slot, spec in enumerate(specs) if layout is None or not layout.remote(slot)]
        tmpl = _template.choose(here, self._warm, self.timeout, wait=uses_torch) if here else None
        refusals = tmpl.refusals if tmpl is not None else 0
        remote = {}
        if layout is not None:
            launcher_env = [f"{k}={v}" for k, v in (layout.env or os.environ).items()]
            remote = dict(hosts=[(name, argv, launcher_env, slots) for name, argv, slots in layout.launchers()],
                          bind_address=layout.bind)
            if remote["hosts"]:
                remote.update(agent_keeper=_keeper.agent_keeper(),
                              remote_warm=_keeper.remote_warm(self._warm, uses_torch),
                              reply_window_ms=REPLY_WINDOW_MS)
        coord = _core.Coordinator(specs, heartbeat_timeout_ms=int(self.heartbeat_timeout * 1000),
                                  rank_template=tmpl, **remote)
        _template.after_start(tmpl, refusals)
        self._generation += 1
        self._broken = None
        self.last_error = None  # fresh ranks have raised nothing yet
        rt = Runtime(coord, self.rank_ids, None if layout is None else
                     [layout.host(s).name if layout.remote(s) else None for s in range(size)])
        rt.specs, rt.template = specs, tmpl
        try:
            rt.wait_ready(self.timeout)
        except BaseException:
            coord.close(0)
            raise
        finally:
            if remote.get("hosts"):
                # Each host's agent said why its ranks start cold, if they do, before their hellos.
                _template.after_start_on_hosts([h[0] for h in remote["hosts"]], coord.host_notes)
        self._rt = rt
        _open_groups.add(self)

    def close(self, grace: float = 2.0):
        """Stops every rank (shutdown, then SIGTERM, then SIGKILL after `grace` s), and ends the
        Slurm job slurm= asked for. Idempotent."""
        try:
            self._stop(grace)
        finally:
            alloc = getattr(self, "_allocation", None)
            if alloc is not None:
                alloc.close()

    @property
    def slurm_job(self) -> str | None:
        """The id of the Slurm job slurm= asked for (None without slurm=)."""
        return self._allocation.job if self._allocation is not None else None

    def _stop(self, grace: float):
        rt, self._rt = getattr(self, "_rt", None), None
        coord = rt.detach() if rt is not None else None
        if rt is not None and rt.broken:
            self._broken = rt.broken
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
        """Kills every rank and starts fresh ones with the same settings (and a new MASTER_PORT),
        in the same Slurm job if slurm= asked for one."""
        if self._allocation is not None and self._allocation.closed:
            raise GroupClosedError(f"its Slurm job {self._allocation.job} has ended (scancel, or its time "
                                   f"limit?); a new group asks Slurm again")
        self._stop(2.0)
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
        state = "closed" if self._rt is None else f"pids={self.pids}"
        where = f"gpus={self.gpus}" if self.gpus is not None else f"n={self.size}"
        return f"<ddip.Group {where} backend={self.backend} {state}>"

    # -- properties ---------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.rank_ids)

    @property
    def closed(self) -> bool:
        return self._rt is None

    @property
    def _coord(self):
        """The runtime's Coordinator (None once closed): for tests and tools that look inside."""
        rt = self._rt
        return rt.coord if rt is not None else None

    @property
    def info(self) -> list[dict]:
        """Each rank's hello: pid, host, Python, torch, ... ([] once closed)."""
        return self._rt.info if self._rt is not None else []

    @property
    def _state(self) -> list[str]:
        return self._rt.state

    @property
    def pids(self) -> list[int]:
        """Each rank's pid; a rank on another host has its pid there (None until it is up)."""
        rt = self._check_open()
        return [pid if pid >= 0 else rt.info[slot].get("pid") for slot, pid in enumerate(rt.coord.pids)]

    def on_this_host(self, rank: int) -> bool:
        """Whether the rank runs on this machine (not on another host of hosts=)."""
        return self._layout is None or not self._layout.remote(self.slot_of(rank))

    def device(self, rank: int) -> str:
        slot = self.slot_of(rank)
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
        heartbeat age, how long it has been busy with its current request, its GPU use and the
        last line it printed. A list of dicts; as a cell's value in JupyterLab, the live rank
        panel (kernel/panel_view.py), elsewhere a table."""
        rt = self._check_open()
        rt.pump(0)
        gpu_use = _gpus.usage(rt.coord.pids) if self.gpus is not None else {}
        rows = []
        now = time.monotonic()
        with rt.mu:
            for slot, pid in enumerate(rt.coord.pids):
                req = rt.running.get(slot)
                state = rt.state[slot]
                if slot in rt.unresponsive and state != "dead":
                    state = "unresponsive"
                local = pid >= 0  # a rank on another host: its pid there, from its hello
                if not local:
                    pid = rt.info[slot].get("pid")
                rows.append({"rank": self.rank_ids[slot], "pid": pid, "device": self.device(self.rank_ids[slot]),
                             "state": state, "rss_mb": _rss_mb(pid) if local else None,
                             "host": rt.info[slot].get("host"),
                             "heartbeat_ms": rt.coord.heartbeat_age_ms(slot),
                             "busy_s": (now - req.started) if req is not None else None,
                             "gpu": gpu_use.get(pid), "last_line": rt.last_line[slot]})
        return RankStatus(rows, self)

    # -- requests -----------------------------------------------------------------------------

    def run(self, code: str, ranks: Iterable[int] | None = None, *, on_output: Callable | None = None,
            on_display: Callable | None = None, timeout: float | None = None,
            values: bool = True, cell: tuple[str, int] | None = None) -> list[RankResult]:
        """Runs `code` in each selected rank's __main__ through IPython; one RankResult per rank.

        on_output(rank, stream, text) is called live; on_display(rank, msg) for display() calls.
        timeout: interrupt the ranks after that many seconds (TimeoutError; the stacks of ranks
        that did not stop are in its results). values=False brings back only the display form
        of the last expression (RankResult.format), never the object itself. cell=(file name,
        first line): compile `code` as that file, from that line on (a notebook cell's file, as
        JupyterLab's debugger names it: ddip.kernel.dap).
        Raises RankFailedError (with every failing rank's traceback) if any rank raised."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a string, got {type(code).__name__}")
        if timeout is not None:
            _positive_timeout(timeout)
        if not isinstance(values, bool):
            raise TypeError(f"values must be True or False, got {values!r}")
        if cell is not None and not (isinstance(cell, tuple) and len(cell) == 2 and isinstance(cell[0], str)
                                     and isinstance(cell[1], int) and cell[1] >= 1):
            raise TypeError(f"cell must be (file name, first line >= 1), got {cell!r}")
        req, results = sent_and_collected(self, lambda: self.send_request(_msg.Run(code, values, cell), ranks, "code"),
                                          Callbacks(on_output, on_display), timeout, interrupt=True)
        self._raise_failures(req, results, "code")
        return results

    def apply(self, fn: Callable, *args, ranks: Iterable[int] | None = None, **kwargs) -> list:
        """Calls fn(*args, **kwargs) on each rank; a list of return values in rank order.
        (`ranks=` is taken by apply itself; the rest goes to fn.)"""
        what = _applied(fn)
        req, results = sent_and_collected(self, lambda: self.send_request(_msg.Apply(fn, args, kwargs), ranks, what),
                                          Callbacks())
        self._raise_failures(req, results, what)
        return [r.value for r in results]

    def apply_async(self, fn: Callable, *args, ranks: Iterable[int] | None = None, **kwargs) -> "Pending":
        """Starts fn(*args, **kwargs) on each rank and returns at once; Pending.result() waits.
        Until then those ranks are busy: one request at a time per rank."""
        what = _applied(fn)
        req = self.send_request(_msg.Apply(fn, args, kwargs), ranks, what)
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
        def send():  # only the send pickles: a value that can't be pickled is named here
            try:
                return self.send_request(_msg.Push(ns), ranks, "push")
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                culprits = [k for k, v in ns.items() if not picklable(v)]
                if not culprits:
                    raise
                raise TypeError(f"can't push {', '.join(culprits)}: it can't be pickled "
                                f"({type(exc).__name__}: {exc}); nothing was pushed") from None

        _, results = sent_and_collected(self, send, Callbacks())
        raise_failures(results, "push")

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
        _, results = sent_and_collected(self, lambda: self.send_request(_msg.Pull(tuple(name_list)), [rank], "pull"),
                                        Callbacks())
        raise_failures(results, "pull")
        values = results[0].value
        return values[0] if single else values

    def interrupt(self, ranks: Iterable[int] | None = None):
        """KeyboardInterrupt in the code running on those ranks (all by default): one per
        request, sent again while a waiter (run, result()) waits for a rank that still runs it,
        in case it reached the rank before the request did."""
        rt = self._check_open()
        rt.interrupt(self._slots(ranks))

    def kill(self, ranks: Iterable[int] | None = None, sig: int = signal.SIGKILL):
        """Sends `sig` to those ranks and everything they started (their process groups).
        A no-op once the group is closed; safe from another thread while a call waits."""
        sig = signal.Signals(sig)  # ValueError for a number that is no signal
        coord = self._coord
        if coord is None:
            return
        for slot in self._slots(ranks):
            coord.signal(slot, sig, True)

    def stacks(self, ranks: Iterable[int] | None = None, timeout: float = 3.0) -> Stacks:
        """Every selected rank's Python stack (all threads), without stopping it: answered by
        the rank's runtime thread, so a rank busy in Python or stuck in C code answers too. A
        dict rank -> stack, whose `collectives` says which collective each rank of the group is
        in (collectives()) and `stragglers` who the others waited for (stragglers()); str() shows
        them, the straggler first where one rank holds the others up, then the stacks."""
        _positive_timeout(timeout)
        rt = self._check_open()
        slots = self._slots(ranks)
        snapshots = self._snapshots(rt, timeout)
        texts = rt.stacks(slots, timeout, _SLICE_S)
        return Stacks({self.rank_ids[s]: text for s, text in texts.items()}, CollectivePicture(snapshots),
                      Stragglers.of(snapshots))

    def collectives(self, timeout: float = 3.0) -> CollectivePicture:
        """Which collective each rank is in, by torch's flight recorder in every rank (on in
        every rank ddip starts): per rank the last completed and the pending collective, and
        `findings`: who has not entered the collective the others wait in, who disagrees."""
        _positive_timeout(timeout)
        return CollectivePicture(self._snapshots(self._check_open(), timeout))

    def stragglers(self, last: int = _LAST, timeout: float = 3.0) -> Stragglers:
        """Who the others waited for in the last `last` collectives: per collective, the rank
        that entered it last made every other member wait from its own entry on (the entry times
        of torch's flight recorder in every rank). `.held_s`: rank -> how long the others waited
        for it; `.share`: that as a share of their time; `.straggler`: the rank that holds them up,
        or None; str() says so; `.plot()` draws the wait over time (matplotlib)."""
        last = _checked_last(last)
        _positive_timeout(timeout)
        return Stragglers.of(self._snapshots(self._check_open(), timeout), last)

    def _snapshots(self, rt: Runtime, timeout: float) -> dict:
        """rank -> its flight recorder's snapshot (or why there is none), every rank asked at once."""
        slots = list(range(len(self.rank_ids)))
        answers = rt.collectives(slots, timeout, _SLICE_S)
        return {self.rank_ids[s]: a for s, a in answers.items()}

    def heal(self, copy_from: int | None = None, names: Sequence[str] | None = None) -> HealReport:
        """Rebuilds torch.distributed's default group on every rank, with the same ranks and world
        size (a fresh store and port), keeping every rank's namespace. Ranks still stuck in a
        collective broken by an earlier failure are released first (their peers' process groups
        are torn down). A dead rank is replaced: a new process in its slot (same rank, GPU and
        environment, forked from the warm rank template when the group's ranks were; on another
        host, by that host's agent from its own rank template), with an empty namespace, joins the
        rebuilt group. copy_from=R then copies survivor R's variables into it (every one that
        pickles, or `names`); the report says which were skipped. Raises HealError when it
        can't (refused before anything changed: bad input, a rank lost with its host's link, a
        group without torch.distributed)."""
        self._check_open()
        return self.healer().heal(copy_from, names)

    def _respawn(self, slot: int, port: int) -> int:
        """Heal's replacement of dead rank `slot`: a new process there, its MASTER_PORT `port`."""
        rt = self._check_open()
        return rt.respawn(slot, {"MASTER_PORT": str(port)}, lambda spec: _template.choose(
            [spec], self._warm, self.timeout, wait=True))

    def debug(self, rank: int | None = None):
        """pdb, post-mortem, in `rank` on the last exception its code raised (by default the
        root-cause rank of the last failed run/apply), with that rank's frames and locals as they
        were. Prompts are asked here ("[rank 1] ipdb> ": the notebook's input box, or the
        terminal) and pdb's output is shown labelled with the rank; `q` leaves, and the rank is
        as before. breakpoint() in code a rank runs prompts the same way."""
        if rank is None:
            rank = self._root_cause_rank()
        elif isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be a rank number, got {rank!r}")
        _, results = sent_and_collected(self, lambda: self.send_request(_msg.Debug(), [rank], f"debugger on rank {rank}"),
                                        Callbacks(on_output=LabelledOutput()))
        result = results[0]
        if result.error is not None:
            raise_failures([result], f"the debugger on rank {rank}")
        if result.value and result.value.get("nothing"):
            raise LookupError(f"{result.value['nothing']}; debug(rank=...) takes a rank whose code raised")

    def _root_cause_rank(self) -> int:
        return _debugger.root_cause_rank(self.last_error, "no run or apply of this group has failed since it "
                                         "started", "debug(rank={rank})")

    # -- internals ----------------------------------------------------------------------------

    def _raise_failures(self, req, results, what):
        """RemoteError for a request's failed ranks (request.raise_failures), kept as last_error
        (what %dip's debugger and heal look at)."""
        try:
            raise_failures(results, what, req.heal.report if req.heal else None, req.collectives)
        except RankFailedError as exc:
            self.last_error = exc
            raise

    def _check_open(self) -> Runtime:
        rt = self._rt
        if rt is None or rt.coord is None:
            raise GroupClosedError(self._broken or (rt.broken if rt is not None else None))
        return rt

    def slot_of(self, rank: int) -> int:
        """The slot (index into rank_ids) of `rank`."""
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
        slots = [self.slot_of(r) for r in ranks]
        if not slots:
            raise ValueError("no ranks selected")
        if len(set(slots)) != len(slots):
            raise ValueError(f"ranks={list(ranks)} lists a rank twice")
        return slots

    # -- for this group's requests and heal (ddip.kernel.request, ddip.kernel.heal) -----------------

    @property
    def runtime(self) -> Runtime | None:
        """The current start's Runtime; None once closed."""
        return self._rt

    @property
    def generation(self) -> int:
        """How many times this group has started: a Pending belongs to one start."""
        return self._generation

    def healer(self) -> "_heal.Healer":
        """What heals this group (made for each use, so it keeps no group alive)."""
        return _heal.Healer(self)

    def send_request(self, msg, ranks, what):
        """Sends `msg` (a request record of ddip.messages) to `ranks` as one Request (collect()
        waits for it)."""
        rt = self._check_open()
        return rt.send(self._slots(ranks), msg, what)


def _applied(fn) -> str:
    """What apply and apply_async call, as their errors name it."""
    if not callable(fn):
        raise TypeError(f"apply needs a callable, got {type(fn).__name__}")
    return f"{getattr(fn, '__name__', 'function')}()"


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


def _check_slurm_group(slurm, n, gpus, hosts, launcher, rank_ids, world_size, timeout, env):
    """What can be checked before Slurm is asked (the nodes and GPUs come with the job)."""
    if not isinstance(slurm, (str, _allocation.SlurmAllocation)):
        raise ValueError(f"slurm= takes salloc's options as a string, e.g. '-N 4 -t 2:00:00', got {slurm!r}")
    if isinstance(slurm, str):
        _allocation.split_options(slurm)
    if any(x is not None for x in (n, gpus, hosts, launcher, rank_ids, world_size)):
        raise ValueError("slurm= asks Slurm for the nodes and places the ranks itself (one per task of "
                         "--ntasks-per-node, else one per GPU of --gpus-per-node, else one per node): leave "
                         "out n=, gpus=, hosts=, launcher=, rank_ids= and world_size=")
    _positive_timeout(timeout)
    if timeout is None:
        raise ValueError("timeout must be a positive number of seconds, got None")
    check_env(env)


def _check_counts(n, gpus, rank_ids):
    if n is not None and gpus is not None:
        raise ValueError("give n= (CPU processes) or gpus= (one rank per GPU), not both")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n must be a positive number of processes, got {n!r}")
    if rank_ids is not None:
        if not rank_ids or len(set(rank_ids)) != len(rank_ids) or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in rank_ids):
            raise ValueError(f"rank_ids must be distinct ranks (integers >= 0), got {rank_ids!r}")
