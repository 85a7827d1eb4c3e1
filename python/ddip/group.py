"""A persistent group of ranked worker processes, driven from the notebook."""

from __future__ import annotations

import atexit
import importlib.util
import keyword
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from . import _core
from . import template as _template
from .errors import RankFailure, RemoteError, StartError
from .messages import dumps_framed, loads, loads_framed, picklable

# Event kinds from _core.Coordinator.next_event: (kind, slot, a, b, data, fds)
_OUTPUT, _FRAME, _EXITED, _DISCONNECTED, _FAILED = range(5)
_STREAMS = {1: "stdout", 2: "stderr"}
# After Ctrl-C, a timeout or a failure interrupts the ranks, how long they get to report back.
INTERRUPT_GRACE_S = 5.0
# After one rank fails, how long the others get to finish before they are interrupted: in DDP
# code they are often waiting for the failed rank in a collective that would never return.
FAILURE_GRACE_S = 3.0

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
    _parts: tuple = field(default_factory=lambda: ([], []), repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.error is None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def gpu_count() -> int:
    """NVIDIA GPUs on this machine, counted without initializing CUDA in the notebook."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        pass
    try:  # some sandboxes hide /proc/driver; nvidia-smi still knows
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def parse_gpus(gpus) -> list[int]:
    """'all', '0,3', 2, [3, 2] -> a list of GPU ids, checked against this machine."""
    available = gpu_count()
    if isinstance(gpus, str) and gpus.strip().lower() == "all":
        if available == 0:
            raise ValueError("gpus='all' but this machine has no NVIDIA GPU; "
                             "use n=2 (for example) to run 2 CPU processes instead")
        return list(range(available))
    if isinstance(gpus, int) and not isinstance(gpus, bool):
        ids = [gpus]
    elif isinstance(gpus, str):
        try:
            ids = [int(x) for x in gpus.replace(" ", "").split(",") if x != ""]
        except ValueError:
            raise ValueError(f"gpus={gpus!r} is not a GPU list; give 'all' or ids like '0,3' or [3, 2]") from None
    else:
        try:
            ids = [int(x) for x in gpus]
        except (TypeError, ValueError):
            raise ValueError(f"gpus={gpus!r} is not a GPU list; give 'all' or ids like '0,3' or [3, 2]") from None
    if not ids:
        raise ValueError("gpus is empty; give 'all' or ids like '0,3'")
    if len(set(ids)) != len(ids):
        raise ValueError(f"gpus={ids} lists a GPU twice; each rank needs its own GPU")
    bad = [i for i in ids if i < 0 or i >= available]
    if bad:
        have = f"GPUs 0-{available - 1}" if available else "no NVIDIA GPU"
        hint = "" if available else "; use n=2 (for example) for CPU processes"
        raise ValueError(f"GPU {', '.join(map(str, bad))} does not exist: this machine has {have}{hint}")
    return ids


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
                 warm: bool | None = None):
        # Everything is checked before anything starts: bad input changes nothing.
        if n is not None and gpus is not None:
            raise ValueError("give n= (CPU processes) or gpus= (one rank per GPU), not both")
        gpu_ids = parse_gpus(gpus) if gpus is not None else None
        if n is None and gpu_ids is None:
            raise ValueError("give n= (the number of CPU processes) or gpus= ('all' or a list of GPU ids)")
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"n must be a positive number of processes, got {n!r}")
        size = len(gpu_ids) if gpu_ids is not None else n
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.backend = resolve_backend(backend, gpu_ids)
        self.gpus = gpu_ids
        self.rank_ids = list(rank_ids) if rank_ids is not None else list(range(size))
        if len(self.rank_ids) != size:
            raise ValueError(f"rank_ids has {len(self.rank_ids)} entries for {size} processes")
        self.world_size = world_size if world_size is not None else size
        self.timeout = timeout
        if env is not None and not (isinstance(env, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise ValueError("env must be a dict of strings to strings, e.g. env={'OMP_NUM_THREADS': '1'}")
        self._env = dict(env or {})
        self._master_addr = master_addr
        self._fixed_port = master_port
        self._warm = warm  # None/True: fork ranks from the kernel's rank template; False: cold
        self._coord = None
        self._broken = None  # why the runtime stopped on its own, if it did
        self._background_output = LabelledOutput()  # output that arrives outside any request
        self._seq = 0
        self._state: list[str] = []
        self._exits: dict[int, RankFailure] = {}
        self._start()

    # -- life cycle ---------------------------------------------------------------------------

    def _worker_env(self, slot: int, port: int) -> list[str]:
        env = dict(os.environ)
        env.update(self._env)
        rank = self.rank_ids[slot]
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.world_size), "MASTER_ADDR": self._master_addr,
            "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1", "DDIP_SLOT": str(slot),
            "DDIP_SYS_PATH": os.pathsep.join(p for p in sys.path if p),
        })
        if self.gpus is not None:
            # Every rank sees the group's GPUs in the order given; rank i uses device i.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # ids mean what nvidia-smi shows
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: keep them off the GPUs
        if self.backend:
            env["DDIP_BACKEND"] = self.backend
        else:
            env.pop("DDIP_BACKEND", None)
        env.pop("DDIP_SOCKET", None)
        return [f"{k}={v}" for k, v in env.items()]

    def _start(self):
        self.master_port = self._fixed_port or free_port()
        size = len(self.rank_ids)
        specs = [([sys.executable, "-c", "import ddip.worker; ddip.worker.main()"], self._worker_env(slot, self.master_port), os.getcwd())
                 for slot in range(size)]
        tmpl = _template.choose(specs, self._warm, self.timeout)
        refusals = tmpl.refusals if tmpl is not None else 0
        self._coord = _core.Coordinator(specs, rank_template=tmpl)
        _template.after_start(tmpl, refusals)
        self._broken = None
        self._state = ["starting"] * size
        self._exits = {}
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
                kind, slot, a, b, data, _ = ev
                if kind == _FRAME and a == _core.HELLO:
                    self.info[slot] = loads(data)
                    self._state[slot] = "idle"
                    waiting.discard(slot)
                elif kind == _EXITED:
                    f = self._death(slot, a, b, data)
                    raise StartError(f"rank {f.rank} exited while starting ({f.evalue})"
                                     + (f"; last lines of its stderr:\n{f.stderr_tail}" if f.stderr_tail else ""))
                elif kind == _FAILED:
                    raise StartError(data.decode(errors="replace"))
                else:
                    self._background(ev)
        except BaseException:
            self._coord.close(0)
            self._coord = None
            raise
        _open_groups.add(self)

    def close(self, grace: float = 2.0):
        """Stops every rank (shutdown, then SIGTERM, then SIGKILL after `grace` s). Idempotent."""
        coord, self._coord = self._coord, None
        if coord is not None:
            coord.close(int(grace * 1000))
            self._state = ["closed"] * len(self._state)
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
        self._check_open()
        return list(self._coord.pids)

    def device(self, rank: int) -> str:
        slot = self._slot(rank)
        return f"cuda:{slot} (GPU {self.gpus[slot]})" if self.gpus is not None else "cpu"

    def status(self) -> list[dict]:
        """Per rank: pid, device, state (idle / busy / dead), resident memory, heartbeat age."""
        self._check_open()
        self._pump()
        rows = []
        for slot, pid in enumerate(self._coord.pids):
            rows.append({"rank": self.rank_ids[slot], "pid": pid, "device": self.device(self.rank_ids[slot]),
                         "state": self._state[slot], "rss_mb": _rss_mb(pid),
                         "heartbeat_ms": self._coord.heartbeat_age_ms(slot)})
        return rows

    # -- requests -----------------------------------------------------------------------------

    def run(self, code: str, ranks: Iterable[int] | None = None, *, on_output: Callable | None = None,
            on_display: Callable | None = None, timeout: float | None = None) -> list[RankResult]:
        """Runs `code` in each selected rank's __main__ through IPython; one RankResult per rank.

        on_output(rank, stream, text) is called live; on_display(rank, msg) for display() calls.
        Raises RemoteError (with every failing rank's traceback) if any rank raised."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a string, got {type(code).__name__}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout <= 0):
            raise ValueError(f"timeout must be a positive number of seconds (or None), got {timeout!r}")
        results = self._request({"op": "run", "code": code}, ranks, on_output, on_display, timeout)
        self._raise_failures(results, "code")
        return results

    def apply(self, fn: Callable, *args, ranks: Iterable[int] | None = None, **kwargs) -> list:
        """Calls fn(*args, **kwargs) on each rank; a list of return values in rank order.
        (`ranks=` is taken by apply itself; the rest goes to fn.)"""
        return self.apply_async(fn, *args, ranks=ranks, **kwargs).result()

    def apply_async(self, fn: Callable, *args, ranks: Iterable[int] | None = None, **kwargs) -> "Pending":
        """Starts fn(*args, **kwargs) on each rank and returns at once; Pending.result() waits.
        Until then the group is busy: one request at a time."""
        if not callable(fn):
            raise TypeError(f"apply needs a callable, got {type(fn).__name__}")
        seq, slots = self._send({"op": "apply", "fn": fn, "args": args, "kwargs": kwargs}, ranks)
        return Pending(self, seq, slots, f"{getattr(fn, '__name__', 'function')}()")

    def push(self, mapping: dict | None = None, /, ranks: Iterable[int] | None = None, **values):
        """Copies variables into each selected rank's namespace: push(x=1) or push({'x': 1})."""
        ns = dict(mapping or {})
        ns.update(values)
        bad = [k for k in ns if not (isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k))]
        if bad:
            raise ValueError(f"push needs variable names, got {bad!r}")
        try:
            results = self._request({"op": "push", "ns": ns}, ranks, None, None, None)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            culprits = [k for k, v in ns.items() if not picklable(v)]
            if not culprits:
                raise
            raise TypeError(f"can't push {', '.join(culprits)}: it can't be pickled "
                            f"({type(exc).__name__}: {exc})") from exc
        self._raise_failures(results, "push")

    def pull(self, names, rank: int = 0):
        """A variable's value from one rank (rank 0 by default); a list of names gives a list."""
        single = isinstance(names, str)
        if not single and not (isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)):
            raise TypeError(f"pull needs a variable name or a list of names, got {names!r}")
        name_list = [names] if single else list(names)
        results = self._request({"op": "pull", "names": name_list}, [rank], None, None, None)
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
        slots = [self._slot(r) for r in ranks]
        if not slots:
            raise ValueError("no ranks selected")
        if len(set(slots)) != len(slots):
            raise ValueError(f"ranks={list(ranks)} lists a rank twice")
        return slots

    def _death(self, slot, code, sig, tail) -> RankFailure:
        cause = f"killed by {_signal_name(sig)}" if sig else f"exit code {code}"
        f = RankFailure(rank=self.rank_ids[slot], ename="RankDied", evalue=cause,
                        stderr_tail=tail.decode(errors="replace"), exit_code=None if sig else code,
                        exit_signal=sig or None)
        self._state[slot] = "dead"
        self._exits[slot] = f
        return f

    def _background(self, ev):
        """Events outside any request: output shows up in the notebook, labelled."""
        kind, slot, a, b, data, fds = ev
        for fd in fds:  # a late reply's segments
            os.close(fd)
        if kind == _OUTPUT:
            self._background_output(self.rank_ids[slot], _STREAMS[a], data.decode(errors="replace"))
        elif kind == _EXITED:
            self._death(slot, a, b, data)
        elif kind == _FRAME and a == _core.DONE:
            self._state[slot] = "idle"  # a reply to a request we stopped waiting for
        elif kind == _FAILED:
            self._broken = data.decode(errors="replace")
            self.close(0)

    def _pump(self):
        while self._coord is not None:
            ev = self._coord.next_event(0)
            if ev is None:
                return
            self._background(ev)

    def _request(self, req, ranks, on_output, on_display, timeout) -> list[RankResult]:
        seq, slots = self._send(req, ranks)
        return self._collect(seq, slots, _Callbacks(on_output, on_display), timeout)

    def _send(self, req, ranks) -> tuple[int, list[int]]:
        self._check_open()
        slots = self._slots(ranks)
        self._pump()
        dead = [self._exits[s] for s in slots if s in self._exits]
        if dead:
            d = dead[0]
            raise RuntimeError(f"rank {d.rank} is dead ({d.evalue}); call restart() to start the group again")
        busy = [self.rank_ids[s] for s in slots if self._state[s] == "busy"]
        if busy:
            raise RuntimeError(f"rank(s) {', '.join(map(str, busy))} still busy with an earlier request "
                               f"(one that was interrupted but did not stop, or an apply_async not yet "
                               f"collected); wait, g.interrupt(), or g.restart() (%makedip -r)")
        coord = self._coord
        payload, segments = dumps_framed(req, lambda raw: (coord.put(raw),) * 2, coord.release)
        self._seq += 1
        seq = self._seq
        try:
            self._coord.send(slots, _core.REQUEST, seq, payload, segments)
        finally:
            for segment in segments:  # the frames hold their own references now
                self._coord.release(segment)
        for s in slots:
            self._state[s] = "busy"
        return seq, slots

    def _collect(self, seq, slots, callbacks: "_Callbacks", timeout) -> list[RankResult]:
        self._check_open()
        results = {s: RankResult(rank=self.rank_ids[s]) for s in slots}
        pending = set(slots)
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        why = None  # why the pending ranks were interrupted: "ctrl-c", "timeout" or "failure"
        interrupted_at = failed_at = None

        def interrupt(reason):
            nonlocal why, interrupted_at
            why, interrupted_at = reason, time.monotonic()
            for s in pending:
                self._coord.signal(s, signal.SIGINT)

        while pending:
            # Ctrl-C may land anywhere in here (in a callback too): the first one interrupts the
            # ranks and keeps collecting their replies; a second one stops waiting.
            try:
                now = time.monotonic()
                if interrupted_at is not None:
                    wake = interrupted_at + INTERRUPT_GRACE_S
                    if now >= wake:
                        break
                else:
                    if failed_at is None and len(pending) < len(slots) and any(
                            results[s].error for s in slots if s not in pending):
                        failed_at = now  # the others may be waiting for it in a collective
                    wake = now + 0.25
                    if deadline is not None:
                        if now >= deadline:
                            interrupt("timeout")
                            continue
                        wake = min(wake, deadline)
                    if failed_at is not None:
                        if now >= failed_at + FAILURE_GRACE_S:
                            interrupt("failure")
                            continue
                        wake = min(wake, failed_at + FAILURE_GRACE_S)
                ev = self._coord.next_event(max(0.0, wake - now) * 1000)
                if ev is not None:
                    self._handle(ev, seq, results, pending, callbacks)
            except KeyboardInterrupt:
                if why == "ctrl-c":
                    raise  # late replies are told apart by their sequence number and dropped
                interrupt("ctrl-c")
        for s in pending:  # late replies are dropped by sequence number; the state says busy
            results[s].error = RankFailure(
                rank=self.rank_ids[s], ename="StillRunning",
                evalue=f"did not stop within {INTERRUPT_GRACE_S:g} s of being interrupted (waiting in "
                       f"C code, or in a collective for a failed rank?); it stays busy until it "
                       f"finishes: g.restart() (%makedip -r) ends it")
        for r in results.values():
            r.stdout, r.stderr = "".join(r._parts[0]), "".join(r._parts[1])
        ranks = lambda ss: ", ".join(str(self.rank_ids[s]) for s in sorted(ss))  # noqa: E731
        stuck = f"; rank(s) {ranks(pending)} did not stop and are still busy" if pending else ""
        if why == "ctrl-c":
            raise KeyboardInterrupt(f"interrupted rank(s) {ranks(slots)}{stuck}")
        if why == "timeout":
            err = TimeoutError(f"the request did not finish within {timeout:g} s, so rank(s) "
                               f"{ranks(slots)} were interrupted"
                               + (stuck or f"; they stopped after {time.monotonic() - started:.1f} s"))
            err.results = [results[s] for s in slots]
            raise err
        return [results[s] for s in slots]

    def _handle(self, ev, seq, results, pending, cb: "_Callbacks"):
        kind, slot, a, b, data, fds = ev
        if kind == _OUTPUT and slot in pending:
            text = data.decode(errors="replace")
            r = results[slot]
            r._parts[a - 1].append(text)  # joined once at the end: += would be quadratic
            if cb.on_output is not None:
                cb.on_output(r.rank, _STREAMS[a], text)
        elif kind == _FRAME and a == _core.DONE and b == seq and slot in pending:
            pending.discard(slot)
            self._state[slot] = "idle"
            try:
                self._fill(results[slot], loads_framed(data, fds))
            except Exception as exc:
                results[slot].error = RankFailure(
                    rank=self.rank_ids[slot], ename="UnpicklingError",
                    evalue=f"its reply could not be unpickled in the notebook: {type(exc).__name__}: {exc} "
                           f"(is what it returned importable here?)")
            results[slot].finished_at = time.monotonic()
            if cb.on_done is not None:
                cb.on_done(results[slot])
        elif kind == _FRAME and a in (_core.DISPLAY, _core.MESSAGE) and b == seq and slot in pending:
            msg = loads(data)
            if a == _core.MESSAGE:
                if cb.on_message is not None:
                    cb.on_message(self.rank_ids[slot], msg)
            elif cb.on_display is not None:
                cb.on_display(self.rank_ids[slot], msg)
            else:
                results[slot].displays.append(msg)
        elif kind == _EXITED:
            f = self._death(slot, a, b, data)
            if slot in pending:
                pending.discard(slot)
                results[slot].error = f
                results[slot].finished_at = time.monotonic()
                if cb.on_done is not None:
                    cb.on_done(results[slot])
        elif kind == _FAILED:
            self._background(ev)
            self._check_open()
        else:
            self._background(ev)

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
    def _raise_failures(results: list[RankResult], what: str):
        failed = [r for r in results if r.error is not None]
        if failed:
            # Root cause first: a death, then exceptions in the order they came; interrupts we
            # caused, and ranks that never stopped, last.
            def rank_of(r):
                kind = 0 if r.error.died else 2 if r.error.ename == "KeyboardInterrupt" else \
                    3 if r.error.ename == "StillRunning" else 1
                return kind, r.finished_at if r.finished_at is not None else float("inf")
            failed.sort(key=rank_of)
            raise RemoteError([r.error for r in failed], results, what)


class LabelledOutput:
    """An on_output callback: ranks' output written to the notebook live, each line labelled
    with its rank (a line that arrives in pieces is labelled once)."""

    def __init__(self):
        self._at_line_start: dict[tuple[int, str], bool] = {}

    def __call__(self, rank, stream, text):
        key = (rank, stream)
        label = f"[rank {rank}] "
        parts = []
        start = self._at_line_start.get(key, True)
        for line in text.splitlines(keepends=True):
            parts.append((label if start else "") + line)
            start = line.endswith(("\n", "\r"))
        self._at_line_start[key] = start
        dest = sys.stdout if stream == "stdout" else sys.stderr
        dest.write("".join(parts))
        dest.flush()


@dataclass
class _Callbacks:
    on_output: Callable | None = None  # (rank, "stdout" | "stderr", text), live
    on_display: Callable | None = None  # (rank, msg): a display() in the rank
    on_message: Callable | None = None  # (rank, obj): ddip.worker.notify(obj) in the rank
    on_done: Callable | None = None  # (RankResult): a rank finished, failed or died


class Pending:
    """A request sent with apply_async; result() collects it (once)."""

    def __init__(self, group: Group, seq: int, slots: list[int], what: str):
        self._group, self._seq, self._slots, self._what = group, seq, slots, what
        self._coord = group._coord  # the ranks it was sent to
        self._results: list[RankResult] | None = None

    def results(self, on_output: Callable | None = None, on_display: Callable | None = None,
                timeout: float | None = None, *, on_message: Callable | None = None,
                on_done: Callable | None = None) -> list[RankResult]:
        """Waits for every rank; per-rank RankResults, errors included (nothing is raised).
        on_done(result) is called as each rank finishes (or dies), so a caller can act on the
        first failure; on_message(rank, obj) receives ddip.worker.notify(obj) from ranks."""
        if self._results is None:
            if self._group._coord is not self._coord:
                raise RuntimeError("the group was restarted or closed since this request was sent; "
                                   "its ranks are gone, and so is the request")
            cb = _Callbacks(on_output, on_display, on_message, on_done)
            self._results = self._group._collect(self._seq, self._slots, cb, timeout)
        return self._results

    def result(self, on_output: Callable | None = None, timeout: float | None = None) -> list:
        """Waits for every rank; their return values in rank order, or RemoteError."""
        results = self.results(on_output=on_output, timeout=timeout)
        Group._raise_failures(results, self._what)
        return [r.value for r in results]


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
