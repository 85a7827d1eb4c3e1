"""Heal, kernel side: when a group's torch.distributed is healed, releasing the ranks a failure
left waiting in a collective, and rebuilding the default group on every rank (`Group.heal()`, or
by itself after a rank raised while its peers waited for it). Group.heal() also replaces a dead
rank: a new process in its slot (Coordinator.respawn; on another host, started there by that
host's agent from its own rank template) that joins the rebuilt group as it starts, optionally with a
copy of a survivor's variables (copy_from). The rank side is ddip/rank/heal.py."""

from __future__ import annotations

import pickle
import signal
import time

from .. import _core
from ..rank import heal as _heal
from . import request as _request
from ..messages import Apply
from ..errors import FailureKind, GroupClosedError, HealError, HealReport, RankDeadError, RankError

# After a heal tore the failed rank's process group down, how long its peers get to leave the
# collective by themselves (gloo: at once) before they are interrupted too.
HEAL_RELEASE_S = 1.0
WHAT = "ddip heal"  # the `what` of a heal's own requests (never healed themselves)


def _free_port(group) -> int:
    """A free port for a new rank 0's store: where it runs when that is this machine; on another
    host (which ddip can't look at) one drawn from the plan's range, as at a group's start."""
    if group.runtime.hosts[group.slot_of(0)] is None:
        return _core.plan.free_port(group._master_addr)
    return _core.plan.master_port(False, group._master_addr)


class Healing:
    """A heal under way for one failed request: the ranks released so far, and their requests."""

    def __init__(self, failed: list[int]):
        self.started = time.monotonic()
        self.failed = failed  # ranks whose exception left the others waiting
        self.stuck: list[int] = []  # ranks still running the request when the heal began
        self.released: set[int] = set()  # slots whose process group was torn down
        self.teardowns: list = []  # the release requests sent
        self.report: HealReport | None = None


class Healer:
    """Heals one group: its requests call begin(), release() and finish() as a failure's peers are
    released (request.collect), and Group.heal() calls heal(). Made for each use, so it keeps
    no group alive."""

    RELEASE_S = HEAL_RELEASE_S

    def __init__(self, group):
        self.group = group

    def check_healable(self):
        """Raises HealError, changing nothing, for a group whose torch.distributed ddip can't rebuild."""
        group = self.group
        if not group.backend:
            raise HealError(HealReport(False, 0.0, group.world_size, reason=(
                "this group has no torch.distributed to heal (backend none)")),
                way_out="start it with a backend (%makedip -n 2, or Group(n=2)) to have ddip set one up")
        if group.world_size != len(group.rank_ids):
            raise HealError(HealReport(False, 0.0, group.world_size, reason=(
                "this group's ranks are part of a larger world (ranch's children)")),
                way_out="they can't rebuild it on their own; the launch that made the world can start it again")

    def healable(self) -> bool:
        try:
            self.check_healable()
        except HealError:
            return False
        return True

    def heal(self, copy_from=None, names=None) -> HealReport:
        """Group.heal(): releases ranks still stuck in a broken collective, replaces dead ranks
        (a new process in each one's slot), then rebuilds; copy_from: a survivor whose variables
        the new ranks get a copy of (every one that pickles, or `names`)."""
        group = self.group
        if group.backend or not group.runtime.exits:  # without torch.distributed: dead ranks replaced only
            self.check_healable()
        dead = self.check_replacing(copy_from, names)
        source_idle = copy_from is not None and group.slot_of(copy_from) not in group.runtime.running
        # What to copy, asked before anything changes when the source can answer (names= it lacks
        # are refused then); a source stuck in a collective is asked once it is released.
        plan = self.what_to_copy(copy_from, names) if source_idle else None
        started = time.monotonic()
        if group.backend:
            h = self.release_all(started)
            port, pids = self.rebuild(h.teardowns, dead)
            released = h.stuck
        else:
            port, pids, released = None, self.replace(dead, group.master_port), []
            self.joined(dead)
        report = HealReport(True, 0.0, group.world_size, released=released, port=port,
                            replaced={group.rank_ids[s]: self.pid(s, pid) for s, pid in pids.items()})
        if copy_from is not None:
            keep, skipped, identity = plan or self.what_to_copy(copy_from, names,
                                                                "the group was healed, but nothing was copied")
            self.copy_namespace(report, copy_from, keep, skipped, identity, [group.rank_ids[s] for s in dead])
        report.seconds = time.monotonic() - started
        return report

    def pid(self, slot: int, pid: int) -> int | None:
        """A new rank's pid: respawn's, or (on another host, where respawn can't know it) its hello's."""
        return pid if pid >= 0 else self.group.runtime.info[slot].get("pid")

    def what_to_copy(self, copy_from: int, names,
                     then: str = "nothing was changed") -> tuple[list[str], dict[str, str], list[str]]:
        """(the variables of `copy_from` that can be copied, the others -> why not, those of them
        that are its identity: its rank, GPU, data shard); NameError for names= it does not have."""
        keep, skipped, identity = self._internal_call([copy_from], _heal.copyable, names)[0]
        missing = [n for n, why in skipped.items() if why == "missing"]
        if missing:
            raise NameError(f"names={missing}: not defined on rank {copy_from}; {then}")
        return keep, skipped, identity

    def check_replacing(self, copy_from, names) -> list[int]:
        """The dead slots a heal replaces; raises, changing nothing, for bad copy_from / names or
        a dead rank this heal can't replace (one lost with its host's link: no agent there to
        start it)."""
        group = self.group
        rt = group.runtime
        with rt.mu:
            dead = [s for s in range(len(group.rank_ids)) if s in rt.exits]
            failures = [rt.exits[s] for s in dead]
        if names is not None:
            if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(
                    isinstance(n, str) and n.isidentifier() for n in names) or not names:
                raise TypeError(f"names must be a non-empty list of variable names, got {names!r}")
            if copy_from is None:
                raise ValueError("names= says what copy_from copies: give copy_from=RANK too")
        if copy_from is not None:
            if isinstance(copy_from, bool) or not isinstance(copy_from, int):
                raise TypeError(f"copy_from must be a rank number, got {copy_from!r}")
            source = group.slot_of(copy_from)  # ValueError naming the group's ranks
            living = [group.rank_ids[s] for s in range(len(group.rank_ids)) if s not in dead]
            if source in dead:
                raise ValueError(f"copy_from={copy_from}: rank {copy_from} is dead itself; copy from a "
                                 f"living rank ({', '.join(map(str, living))})")
            if not dead:
                raise ValueError(f"copy_from={copy_from}: no rank is dead, so there is no new rank to "
                                 f"copy into (copy_from goes with a heal that replaces a dead rank)")
        lost = [f for s, f in zip(dead, failures) if rt.hosts[s] is not None and f.kind is FailureKind.LOST]
        if lost:
            where = "; ".join(f"rank {f.rank} on host {rt.hosts[group.slot_of(f.rank)]} ({f.evalue})" for f in lost)
            raise HealError(HealReport(False, 0.0, group.world_size, reason=(
                f"{where}: that host's agent is gone with its link, so no rank can be started there "
                f"again (a rank that died while its host stayed connected is)")),
                way_out="%makedip -r (g.restart()) starts fresh ranks, with a new agent on that host"
            ) from RankDeadError(lost)
        return dead

    def release_all(self, started: float) -> Healing:
        """Every live rank lets go of its process groups; one still running what a failure broke
        is aborted, then interrupted. HealError when one does not return."""
        group = self.group
        rt = group.runtime
        slots = [s for s in range(len(group.rank_ids)) if s not in rt.exits]
        h = Healing([])
        h.stuck = [group.rank_ids[s] for s in slots if s in rt.running]
        rt.abort_collectives([s for s in slots if s in rt.running])  # stuck, maybe: freed from their side
        interrupted = None
        while True:
            self.release_idle(h, slots)  # freeing whoever waits on them, as they become idle
            busy = [s for s in slots if s in rt.running]
            if not busy:
                return h
            now = time.monotonic()
            if interrupted is None and now >= started + HEAL_RELEASE_S:
                interrupted = now
                rt.signal(busy, signal.SIGINT)
            elif interrupted is not None and now >= interrupted + _request.INTERRUPT_GRACE_S:
                report = HealReport(False, now - started, group.world_size, reason=(
                    f"rank(s) {_request.ranks_text(rt, busy)} did not leave what they were running, "
                    f"interrupted too: a collective that tearing its peers' groups down did not end, or "
                    f"code that does not return to Python (C code, a subprocess; %dipstack shows where)"))
                raise HealError(report)
            rt.pump(_request.SLICE_S)

    def begin(self, req) -> bool:
        """A rank of `req` raised and others still run it after FAILURE_GRACE_S: in DDP code,
        waiting for it in a collective. Starts releasing them, when ddip owns torch.distributed."""
        group = self.group
        if req.what == WHAT or req.died_at is not None:
            return False
        try:
            self.check_healable()
        except HealError:
            return False
        failed = [group.rank_ids[s] for s in req.slots if s not in req.pending
                  and req.results[s].error is not None and not req.results[s].error.died]
        req.heal = Healing(failed)
        req.heal.stuck = sorted(group.rank_ids[s] for s in req.pending)
        self.release(req)
        # From their side too: NCCL's peers are freed only by their own abort.
        group.runtime.abort_collectives(list(req.pending))
        return True

    def release(self, req):
        """Tears down the process groups of the request's ranks that no longer run it."""
        self.release_idle(req.heal, req.slots, req.pending)

    def release_idle(self, h: Healing, slots, running=()):
        """Each idle, live rank of `slots` not released yet lets go of its process groups."""
        group = self.group
        rt = group.runtime
        for s in slots:
            if s in running or s in h.released or s in rt.running or s in rt.exits:
                continue
            h.released.add(s)
            try:
                h.teardowns.append(self._internal_send([group.rank_ids[s]], _heal.release))
            except (RankError, GroupClosedError):  # died or stopped meanwhile: the heal's end reports it
                pass

    def finish(self, req, stuck: set):
        """After every rank of a healing request replied (or was given up on): the rebuild."""
        group = self.group
        h = req.heal
        interrupted = "it was interrupted (Ctrl-C); g.heal() or %makedip --heal tries again"
        released = [r for r in h.stuck if group.slot_of(r) not in stuck]
        port, reason = None, ""
        if stuck:
            reason = (f"rank(s) {_request.ranks_text(group.runtime, stuck)} did not return after the failed "
                      f"rank's group was torn down: still in a collective" +
                      (" (NCCL waits on the GPU)" if group.backend == "nccl" else "") +
                      ", or in code that does not return to Python (C code, a subprocess; %dipstack shows where)")
        elif req.died_at is not None:
            reason = "a rank died (g.heal() / %makedip --heal replaces it, keeping the other ranks' variables)"
        elif req.why == "ctrl-c":
            reason = interrupted
        else:
            try:
                port, _ = self.rebuild(h.teardowns)
            except KeyboardInterrupt:
                reason = interrupted
            except (HealError, RuntimeError, TimeoutError) as exc:
                reason = str(exc)
        h.report = HealReport(not reason, time.monotonic() - h.started, group.world_size, h.failed,
                              released, port, reason)

    def rebuild(self, teardowns: list, dead=()) -> tuple[int, dict[int, int]]:
        """Every rank joins a fresh default group on a store rank 0 opens; each dead slot gets a
        new process first, which joins it as it starts. Returns the port, and slot -> new pid."""
        group = self.group
        deadline = time.monotonic() + _request.INTERRUPT_GRACE_S
        for t in teardowns:
            try:
                _request.collect(group, t, _request.Callbacks(), None, stop_waiting_at=deadline, on_failure=False)
            except TimeoutError:
                raise RuntimeError(f"rank {t.results[t.slots[0]].rank} did not tear its process group down "
                                   f"within {_request.INTERRUPT_GRACE_S:g} s") from None
        survivors = [r for s, r in enumerate(group.rank_ids) if s not in dead]
        if group.slot_of(0) in dead:  # the new rank 0 opens the store itself, as at the start
            port = _free_port(group)
        else:
            port = self._internal_call([0], _heal.open_store, group.world_size)[0]
        pids = self.replace(dead, port)
        if survivors:  # every rank dead: the new ones build the group among themselves
            self._internal_call(survivors, _heal.rejoin, group.backend, port)
        group.master_port = port
        self.joined(dead)
        return port, pids

    def replace(self, dead, port: int) -> dict[int, int]:
        """A new process in each dead slot, told to join the group on `port`; slot -> its pid."""
        group = self.group
        pids = {}
        for s in dead:
            try:
                pids[s] = group._respawn(s, port)
            except (OSError, RuntimeError) as exc:
                raise HealError(HealReport(False, 0.0, group.world_size, reason=(
                    f"rank {group.rank_ids[s]} could not be started again: {exc}"))) from exc
        return pids

    def joined(self, dead):
        """Until the new ranks said hello (they do once their default group is built)."""
        group = self.group
        bad = group.runtime.wait_hello(dead, _heal.REJOIN_TIMEOUT_S, _request.SLICE_S)
        if bad:
            hosts = group.runtime.hosts
            raise RuntimeError("; ".join(
                f"the new rank {group.rank_ids[s]}" + (f" on host {hosts[s]}" if hosts[s] else "") +
                f" did not come up: {why}" for s, why in sorted(bad.items())))

    def copy_namespace(self, report: HealReport, copy_from: int, keep, skipped, identity, new_ranks: list[int]):
        """The new ranks get a copy of survivor `copy_from`'s variables `keep`: each pickled there,
        passed on from here unopened, through the data plane (large buffers in shared memory);
        what does not pickle joins `skipped`."""
        copied = []
        if keep:
            parcel, failed = self._internal_call([copy_from], _heal.export, keep)[0]
            skipped.update(failed)
            if parcel is not None:
                data, buffers = parcel  # out of band again: what came in shared memory leaves through it
                parcel = (data, [pickle.PickleBuffer(b) for b in buffers])
                copied, failed = self._internal_call(new_ranks, _heal.adopt, parcel)[0]
                skipped.update(failed)
        report.copied_from, report.copied, report.skipped = copy_from, copied, skipped
        report.identity = sorted(identity)

    def _internal_send(self, ranks, fn, *args):
        group = self.group
        return group.send_request(Apply(fn, args), ranks, WHAT)

    def _internal_call(self, ranks, fn, *args) -> list:
        group = self.group
        req = self._internal_send(ranks, fn, *args)
        results = _request.collect(group, req, _request.Callbacks(),
                                   _heal.REJOIN_TIMEOUT_S + _request.INTERRUPT_GRACE_S)
        failed = [r for r in results if r.error is not None]
        if failed:
            raise RuntimeError(f"{fn.__name__} failed on {failed[0].error.describe()}")
        return [r.value for r in results]
