"""Heal, kernel side: when a group's torch.distributed is healed, releasing the ranks a failure
left waiting in a collective, and rebuilding the default group on every rank (`Group.heal()`, or
by itself after a rank raised while its peers waited for it). The rank side is ddip/rank/heal.py."""

from __future__ import annotations

import signal
import time

from ..rank import heal as _heal
from . import request as _request
from ..errors import GroupClosedError, HealError, HealReport, RankDeadError, RankError

# After a heal tore the failed rank's process group down, how long its peers get to leave the
# collective by themselves (gloo: at once) before they are interrupted too.
HEAL_RELEASE_S = 1.0
WHAT = "ddip heal"  # the `what` of a heal's own requests (never healed themselves)


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

    def heal(self) -> HealReport:
        """Group.heal(): releases ranks still stuck in a broken collective, then rebuilds."""
        group = self.group
        rt = group.runtime
        self.check_healable()
        with rt.mu:
            dead = [rt.exits[s] for s in range(len(group.rank_ids)) if s in rt.exits]
        if dead:  # heal rebuilds among living ranks only
            cause = RankDeadError(dead)
            reason = "; ".join(f"rank {f.rank} is dead ({f.evalue})" for f in cause.failures)
            raise HealError(HealReport(False, 0.0, group.world_size, reason=reason)) from cause
        started = time.monotonic()
        slots = list(range(len(group.rank_ids)))
        h = Healing([])
        h.stuck = [group.rank_ids[s] for s in slots if s in rt.running]
        rt.abort_collectives([s for s in slots if s in rt.running])  # stuck, maybe: freed from their side
        interrupted = None
        while True:
            self.release_idle(h, slots)  # freeing whoever waits on them, as they become idle
            busy = [s for s in slots if s in rt.running]
            if not busy:
                break
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
        port = self.rebuild(h.teardowns)
        return HealReport(True, time.monotonic() - started, group.world_size, released=h.stuck, port=port)

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
            reason = "a rank died"
        elif req.why == "ctrl-c":
            reason = interrupted
        else:
            try:
                port = self.rebuild(h.teardowns)
            except KeyboardInterrupt:
                reason = interrupted
            except (HealError, RuntimeError, TimeoutError) as exc:
                reason = str(exc)
        h.report = HealReport(not reason, time.monotonic() - h.started, group.world_size, h.failed,
                              released, port, reason)

    def rebuild(self, teardowns: list) -> int:
        """Every rank joins a fresh default group on a store rank 0 opens; returns its port."""
        group = self.group
        deadline = time.monotonic() + _request.INTERRUPT_GRACE_S
        for t in teardowns:
            try:
                _request.collect(group, t, _request.Callbacks(), None, stop_waiting_at=deadline, on_failure=False)
            except TimeoutError:
                raise RuntimeError(f"rank {t.results[t.slots[0]].rank} did not tear its process group down "
                                   f"within {_request.INTERRUPT_GRACE_S:g} s") from None
        port = self._internal_call([0], _heal.open_store, group.world_size)[0]
        self._internal_call(group.rank_ids, _heal.rejoin, group.backend, port)
        group.master_port = port
        return port

    def _internal_send(self, ranks, fn, *args):
        group = self.group
        return group.send_request({"op": "apply", "fn": fn, "args": args, "kwargs": {}}, ranks, WHAT)

    def _internal_call(self, ranks, fn, *args) -> list:
        group = self.group
        req = self._internal_send(ranks, fn, *args)
        results = _request.collect(group, req, _request.Callbacks(),
                                   _heal.REJOIN_TIMEOUT_S + _request.INTERRUPT_GRACE_S)
        failed = [r for r in results if r.error is not None]
        if failed:
            raise RuntimeError(f"{fn.__name__} failed on {failed[0].error.describe()}")
        return [r.value for r in results]
