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

import signal
import sys
import threading
import time
import traceback as _traceback
from typing import Callable

from ..errors import FailureKind, RankFailedError, RankFailure, root_cause_first
from ..kernel import debugger as _debugger
from ..kernel.displays import RankDisplays, notebook_env
from ..kernel.group import Group, free_port
from ..kernel.spec import RanksSpec
from ..labels import LabelledOutput
from ..messages import dumps
from ..repeats import Repeats
from ..rank import sources as _sources
from ..rank import torchdist
from ..rank.oneshot import TorchDDPCtx, call as _call, import_star, rank_main as _rank_main
from . import interrupts as _interrupts
from .interrupts import SigintGuard, drop_handler_frame
from .notebook_env import NotebookRankEnv
from .notebook_rank import NotebookRank
from .spec import LaunchSpec

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
# The notebook's traceback starts at the user's code: frames of these files before it are ours.
_OUR_FILES = frozenset({__file__, _interrupts.__file__})


# -- the public API -----------------------------------------------------------------------------


def ranch(nprocs: int | None, fn: Callable, *args, caller_rank: int | None = 0, gather: bool = True,
          ctx=None, need="", imports: str = "", gpus=None, warm: bool | None = None, hosts=None,
          launcher: str | None = None, python: str | None = None, bind: str | None = None,
          env: dict | None = None, collapse: bool = True, **kwargs):
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
    collapse: a line that several children print alike is shown once, "[ranks 1-7] text"
        (ddip.repeats); False shows each child's lines as they come.

    The notebook's process is left as it was found, also on error: its environment, the
    process groups fn created there (HF Trainer, Accelerator() and Lightning leave theirs),
    accelerate's and Lightning's process-wide state, the current CUDA device (docs/launch.md).

    Raises RankFailedError naming the first failing rank (the root cause), then the others."""
    return _ranch(nprocs, fn, args, kwargs, caller_rank=caller_rank, gather=gather, ctx=ctx,
                  need=need, imports=imports, gpus=gpus, caller_globals=sys._getframe(1).f_globals,
                  warm=warm, hosts=hosts, launcher=launcher, python=python, bind=bind, env=env,
                  collapse=collapse)


def torchddp_launch(nprocs: int, fn: Callable, *args, **kwargs):
    """ranch(nprocs, fn, *args, ctx=TorchDDPCtx(), gather=False, **kwargs): fn runs with
    torch.distributed initialized (gloo on CPU); returns the notebook's (rank 0's) value."""
    for reserved in ("ctx", "gather"):
        if reserved in kwargs:
            raise TypeError(f"torchddp_launch sets {reserved}= itself; call ranch() to choose it")
    opts = {k: kwargs.pop(k) for k in ("caller_rank", "need", "imports", "warm", "hosts", "launcher",
                                       "python", "bind", "env", "collapse") if k in kwargs}
    gpus = kwargs.pop("gpus", None)
    if opts.get("hosts") is not None:
        # Across hosts the GPUs belong to the host list (the launch refuses them: see _hosts_rule).
        opts["gpus"] = gpus
        gpus = None
    return _ranch(nprocs, fn, args, kwargs, ctx=TorchDDPCtx(gpus=gpus), gather=False,
                  caller_globals=sys._getframe(1).f_globals, **opts)


# -- ranch's arguments, checked: the launch's spec -------------------------------------------------


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


def _select_gpus(nprocs, ranks: RanksSpec, gpus, ctx):
    """One GPU per rank, from gpus= (checked by the launch spec) or the ctx's."""
    ctx_sel = getattr(ctx, "selected", None) if isinstance(ctx, TorchDDPCtx) else None
    sel = ranks.selected if gpus is not None else ctx_sel
    if gpus is not None and ctx_sel is not None and [s.entry for s in sel] != [s.entry for s in ctx_sel]:
        raise ValueError(f"gpus={gpus!r} and the ctx's gpus={ctx.gpus} differ; give the GPUs once")
    if sel is not None and len(sel) != nprocs:
        raise ValueError(f"{len(sel)} GPUs ({', '.join(s.entry for s in sel)}) for {nprocs} ranks: "
                         f"give one GPU per rank")
    return sel


def _hosts_rule(nprocs, caller_rank, ctx):
    """ranch's own rules for a host list (the launch spec runs them before resolving its names):
    nprocs counts the notebook, which plays caller_rank on this machine."""

    def check(parsed):
        if isinstance(ctx, TorchDDPCtx) and ctx.gpus:
            raise ValueError("across hosts, GPUs are given in hosts= (each host's own ids: "
                             "hosts='localhost[0,1] node2[0,1]'), not in TorchDDPCtx(gpus=...)")
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

    return check


def _ranch(nprocs, fn, args, kwargs, collapse=True, **options):
    launch = _Launch(_spec(nprocs, fn, args, kwargs, **options), collapse)
    try:
        return launch.run()
    finally:
        launch.cleanup()


def _spec(nprocs, fn, args, kwargs, *, caller_rank=0, gather=True, ctx=None, need="", imports="",
          gpus=None, caller_globals=None, warm=None, hosts=None, launcher=None, python=None, bind=None,
          env=None) -> LaunchSpec:
    """ranch()'s arguments, checked, as the launch's spec."""
    # Everything is checked, and everything that travels is pickled, before anything starts.
    # Where the ranks run and with what: the launch spec's rules, Group's too (backend: ctx's).
    ranks = RanksSpec.checked(hosts=hosts, gpus=gpus, env=env, warm=warm, launcher=launcher, python=python,
                              bind=bind, check_hosts=_hosts_rule(nprocs, caller_rank, ctx))
    layout = ranks.layout
    if layout is not None:
        nprocs = layout.world_size
        if caller_rank is not None:
            layout.played_here = (caller_rank,)
    needed = _check(nprocs, fn, caller_rank, ctx, need, imports, caller_globals or {})
    selected = _select_gpus(nprocs, ranks, gpus, ctx) if layout is None else None
    spec = LaunchSpec(fn=fn, args=args, kwargs=kwargs, ctx=ctx, nprocs=nprocs, caller_rank=caller_rank,
                      gather=gather, needed=needed, imports=imports, selected=selected, layout=layout,
                      warm=ranks.warm, env=ranks.env)
    if spec.child_ranks:
        _check_picklable("fn, its arguments or ctx", (fn, args, kwargs, ctx))
        for name, value in needed.items():
            _check_picklable(f"need={name!r}", value)
    return spec


# -- the launch ---------------------------------------------------------------------------------


class _Launch:
    """One ranch() call, run: the children's Group, the failures it hears of (the first one stops
    the rest), the notebook's rank, and the results.

    Children tell of their progress with ddip.worker.notify(): "entered" once ctx is entered,
    "failed" the moment fn (or ctx) raises, before ctx exits. Their replies and deaths come as
    on_done from the Group's Pending. All of it arrives in the collecting thread, as it happens."""

    def __init__(self, spec: LaunchSpec, collapse: bool = True):
        self.spec = spec
        self.group: Group | None = None
        self.out: LabelledOutput | None = None  # the children's output (and the notebook's), labelled
        self.collapse = collapse and len(spec.child_ranks) > 1
        self.repeats: Repeats | None = None  # the children's output on its way to `out`, repeats collapsed
        self.lock = threading.Lock()
        self.failed_at: dict[int, float] = {}  # rank -> when the launch heard it failed
        self.running: set[int] = set()  # child ranks past ctx.__enter__, not yet done or failed
        self.stopped: set[int] = set()  # child ranks we killed because another failed
        self.store = None  # the notebook's (rank 0's) TCPStore, when ranch opened it for TorchDDPCtx
        self.displays = RankDisplays()  # the children's display() calls, shown in the notebook
        self.caller = _CallerRank(self)  # the notebook's own rank (when it plays one)

    def run(self):
        spec = self.spec
        pending = own_env = None
        if spec.child_ranks:
            pending, own_env = self._start_children()
        if spec.caller_rank is None:
            return self._finish(self._collect(pending), None)
        collector = None
        if spec.child_ranks:
            collector = _Collector(self, pending)
            collector.start()
        own = self.caller.play(own_env, self.out if spec.child_ranks else LabelledOutput())
        # The user's Ctrl-C ended the notebook's rank (inside fn or around it): the children
        # stop now, not when they next need rank 0 (a rendezvous may wait minutes for it).
        ctrl_c = own[0] == "error" and isinstance(own[1], KeyboardInterrupt) and not self.caller.sigint.sent
        results = self._join(collector, stop=ctrl_c) if collector else []
        return self._finish(results, own)

    def _start_children(self):
        """The children's Group, its imports= and need= done, started on fn. Returns its Pending
        and the notebook's environment as its rank (None when it plays none)."""
        spec = self.spec
        self.group = self._children()
        self.out = LabelledOutput()
        if spec.imports.strip():
            try:
                self.group.run(spec.imports, on_output=self._output(), on_display=self._on_display)
            except RankFailedError as exc:
                raise RankFailedError(exc.failures, exc.results, "ranch's imports= code") from None
            finally:
                self._output_ended()
        if spec.needed:
            self.group.push(spec.needed)
        own_env = None
        if spec.caller_rank is not None:
            own_env = self.caller.env.for_rank(spec.caller_rank, self.group.master_port)
            if spec.caller_rank == 0 and isinstance(spec.ctx, TorchDDPCtx):
                # Listening before the children are told to connect: a child refused by a port
                # not listening yet sleeps 250-750 ms (torch's connect backoff) before it retries.
                self.store = _open_store(spec.ctx, own_env)
        pending = self.group.apply_async(_rank_main, spec.fn, spec.args, spec.kwargs, spec.ctx,
                                         _sources.take(spec.fn))
        pending.on_failure = False  # failure() below stops the right ranks at the right time
        return pending, own_env

    def _children(self) -> Group:
        spec = self.spec
        env = {**notebook_env(), **spec.env} or None
        if spec.layout is not None:
            # The children on every host, numbered as in the host list (the notebook's left out).
            return Group(hosts=spec.layout, backend=None, warm=spec.warm, env=env)
        if spec.selected is not None:
            gpus = [s.position if s.position is not None else s.entry for s in spec.selected]
            return Group(gpus=gpus, backend=None, world_size=spec.nprocs, rank_ids=spec.child_ranks,
                         warm=spec.warm, env=env)
        return Group(n=len(spec.child_ranks), backend=None, world_size=spec.nprocs, rank_ids=spec.child_ranks,
                     warm=spec.warm, env=env)

    # -- what the notebook's rank asks ------------------------------------------------------------

    def any_failed(self) -> bool:
        with self.lock:
            return bool(self.failed_at)

    def first_failed(self) -> int | None:
        """The rank other than the notebook's whose failure the launch heard of first, or None."""
        with self.lock:
            failed = sorted((t, r) for r, t in self.failed_at.items() if r != self.spec.caller_rank)
        return failed[0][1] if failed else None

    def abort_reason(self):
        """Why the notebook's rendezvous gives up: a child failed before it arrived (or None)."""
        with self.lock:
            failed = sorted(r for r in self.failed_at if r != self.spec.caller_rank)
        return f"rank {failed[0]} failed before it arrived" if failed else None

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
        if rank != self.spec.caller_rank:
            self.caller.sigint.interrupt()

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
        if self.repeats is not None:
            self.repeats.done(result.rank)
        if result.error is not None:
            self.failure(result.rank)
        else:
            with self.lock:
                self.running.discard(result.rank)

    def _on_display(self, rank: int, msg):
        # display() in a child, in the notebook when there is one (its display ids its own, as
        # in %%dip); in a script, only the text form, labelled like the child's other output.
        if notebook_env():
            if self.repeats is not None:
                self.repeats.flush()  # the text printed before the display comes first
            sys.stdout.flush()
            self.displays.show(rank, msg)
        elif not msg.get("clear") and not msg.get("update"):
            text = (msg.get("data") or {}).get("text/plain", "")
            if text:
                (self.repeats or self.out)(rank, "stdout", text if text.endswith("\n") else text + "\n")

    def _kill(self, ranks, sig=signal.SIGKILL):
        """Signals child ranks (their whole process groups) through the runtime, which knows
        whether each is still running; after the group closed this does nothing."""
        if self.group is not None and ranks:
            self.group.kill(ranks, sig)

    # -- collecting -------------------------------------------------------------------------------

    def _output(self):
        """The on_output of a request to the children: `out`, through a Repeats of its own."""
        if self.collapse:
            self.repeats = Repeats(self.out, self.spec.child_ranks)
        return self.repeats or self.out

    def _output_ended(self):
        if self.repeats is not None:
            self.repeats.close()
            self.repeats = None

    def _collect(self, pending):
        try:
            results = pending.results(on_output=self._output(), on_display=self._on_display,
                                      on_message=self._on_message, on_done=self._on_done)
        finally:
            self._output_ended()
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
                        rest = [r for r in self.spec.child_ranks if r not in self.stopped]
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
        children = self.spec.child_ranks
        self._kill(children, signal.SIGINT)
        collector.join(INTERRUPT_GRACE_S)
        with self.lock:
            self.stopped.update(children)
        self._kill(children)
        collector.join()

    def _finish(self, results, own):
        """Every rank's value in rank order (gather) or the caller's; or RankFailedError, the root
        cause first. own: the notebook's ("ok", value) or ("error", exc, traceback), or None."""
        spec = self.spec
        failures = [self._child_failure(r) for r in results if r.error is not None]
        if own is not None and own[0] == "error":
            failures.append(self._own_failure(own[1], own[2]))
        if failures:
            failures = root_cause_first(failures)
            root = failures[0]
            for f in failures[1:]:
                if f.kind is FailureKind.STOPPED:
                    f.evalue = f"{f.evalue} after rank {root.rank} failed"
            for f in failures:
                where = spec.remote_host(f.rank)
                if where is not None:  # a rank on another host is named with its host
                    f.evalue = f"{f.evalue} (on {where})" if f.evalue else f"(on {where})"
            err = RankFailedError(failures, results, "ranch")
            if root.rank == spec.caller_rank and own is not None and own[0] == "error":
                raise err from own[1]
            raise err
        values = {r.rank: r.value for r in results}
        if own is not None:
            values[spec.caller_rank] = own[1]
        if spec.gather:
            return [values[r] for r in range(spec.nprocs)]
        return values[spec.caller_rank if spec.caller_rank is not None else 0]

    def _child_failure(self, result) -> RankFailure:
        f = result.error
        if result.rank in self.stopped and f.died and f.exit_signal == signal.SIGKILL:
            # Killed by us because another rank failed: not a failure of its own.
            f = RankFailure(rank=result.rank, kind=FailureKind.STOPPED, evalue="stopped", stderr_tail=f.stderr_tail,
                            exit_signal=f.exit_signal)
        f.at = self.failed_at.get(result.rank, f.at)  # when this launch heard of it
        return f

    def _own_failure(self, exc, formatted) -> RankFailure:
        rank = self.spec.caller_rank
        if isinstance(exc, KeyboardInterrupt):
            if not self.caller.sigint.sent:
                raise exc  # the user's Ctrl-C: the children are already stopped
            return RankFailure(rank=rank, kind=FailureKind.STOPPED, evalue="interrupted")  # ours
        return RankFailure(rank=rank, ename=type(exc).__name__, evalue=str(exc),
                           traceback=[l.rstrip("\n") for l in formatted], exception=exc,
                           at=self.failed_at.get(rank))

    def cleanup(self):
        self.caller.left()
        if self.group is not None:
            self.group.close(0.5)
            self.group = None
        self.caller.restore()
        torchdist.release()
        self.store = None


class _Collector(threading.Thread):
    """Collects the children's replies (printing their output live) while the notebook runs fn."""

    def __init__(self, launch: _Launch, pending):
        super().__init__(name="ddip-ranch-collector", daemon=True)
        self.launch, self.pending = launch, pending
        self.results = None
        self.error = None

    def run(self):
        try:
            self.results = self.launch._collect(self.pending)
        except BaseException as exc:
            self.error = exc
            self.launch._kill(self.launch.spec.child_ranks)
            self.launch.caller.sigint.interrupt()


class _CallerRank:
    """The notebook playing its rank of one launch: fn runs here in that rank's environment (the
    plan's, as its children get theirs), looking like a launched process, and is interrupted when
    another rank failed (the SIGINT guard). Right after fn the notebook's environment and
    interactive look come back (left()); what fn created in its process goes once the children
    are gone (restore())."""

    def __init__(self, launch: _Launch):
        self.launch, self.rank = launch, launch.spec.caller_rank
        self.env = NotebookRankEnv(launch.spec)  # restored exactly, whatever fn or ctx did to it
        self.sigint = SigintGuard(self.rank, failed=launch.any_failed, first_failed=launch.first_failed,
                                  delay_s=INTERRUPT_DELAY_S, notice_s=INTERRUPT_NOTICE_S)
        self.process = NotebookRank()  # what fn changes in the notebook's process, undone after

    def play(self, own_env: dict | None, out):
        """Runs fn as the notebook's rank, its text through `out`: ("ok", value) or ("error", exc,
        formatted traceback). own_env: the rank's environment, made before the children started."""
        self.env.enter(own_env or self.env.for_rank(self.rank, free_port()))
        self.process.as_launched()
        # breakpoint() in fn prompts as the children's do ("[rank 0] ipdb> "), not the kernel's
        # own hook (debugpy's, which stops only under JupyterLab's debugger, silently).
        hook, sys.breakpointhook = sys.breakpointhook, _debugger.notebook_breakpointhook(self.rank)
        try:
            # The notebook's own text goes through `out` too: its lines and its children's never mix.
            with out:
                return self._run()
        finally:
            sys.breakpointhook = hook
            self.left()

    def left(self):
        """After fn: the notebook's environment, then its interactive look, as they were."""
        self.env.restore()
        self.process.look_interactive()

    def restore(self):
        """The children are gone: what fn created in the notebook (process groups hosting the
        store they used, accelerate's state) can go too."""
        self.process.restore()

    def _run(self):
        launch, spec = self.launch, self.launch.spec
        ctx = spec.ctx

        def body(*a, **kw):
            with self.sigint:  # our interrupt (another rank failed) lands only in here
                return spec.fn(*a, **kw)

        def on_error():
            exc = sys.exc_info()[1]
            if isinstance(exc, KeyboardInterrupt) and self.sigint.sent:
                return  # ours: another rank failed first
            launch.failure(self.rank)

        if isinstance(ctx, TorchDDPCtx):
            ctx._abort = launch.abort_reason  # a child that fails ends the notebook's rendezvous
            ctx._store = launch.store
        try:
            return ("ok", _call(body, spec.args, spec.kwargs, ctx, on_error))
        except BaseException as exc:
            drop_handler_frame(exc)
            tb = exc.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename in _OUR_FILES:
                tb = tb.tb_next  # start at the user's code, not at ours
            return ("error", exc, _traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
        finally:
            if isinstance(ctx, TorchDDPCtx):
                ctx._abort = ctx._store = None


def _open_store(ctx: TorchDDPCtx, env: dict):
    """Rank 0's store server for ctx, listening on the port ctx will use, or None when it can't
    be opened (the notebook's ctx then tries itself, and fails as the rank's own error)."""
    try:
        return torchdist.serve(env.get("MASTER_ADDR", "127.0.0.1"), ctx.port or int(env["MASTER_PORT"]),
                               int(env["WORLD_SIZE"]), ctx.rendezvous_timeout)
    except Exception:
        return None


# -- in every rank ------------------------------------------------------------------------------
