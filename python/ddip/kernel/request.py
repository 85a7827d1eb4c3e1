"""A request to some ranks (a cell, an apply, a push, a pull) and its wait policy.

Every request is a `Request` object: it owns its sequence number, its per-rank results and its
mailbox, which the runtime (ddip/kernel/runtime.py) fills. Its waiter, `collect()`, processes the
mailbox, calls the callbacks, and decides what a failure, a death, a timeout or Ctrl-C does to
the others. So no caller can consume another's reply: `status()`, a concurrent
`run(ranks=[1])`, or a callback that raises never drop a result. `Pending` is a thin view of a
request sent with `apply_async`.
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Callable

from ..errors import (FailureKind, GroupClosedError, HealReport, RankFailure, RemoteError, root_cause_first,
                      unresponsive_cause)
from ..messages import Done, loads, loads_framed
from .. import _core
from .collectives import CollectivePicture
from . import debugger as _debugger

# What frees a rank that did not stop when interrupted, each way named.
WAYS_ON = ("%makedip --heal (g.heal()) frees ranks stuck in a broken collective, keeping every rank's "
           "variables; %makedip -r (g.restart()) ends what they run")
# After Ctrl-C, a timeout or a failure interrupts the ranks, how long they get to report back.
INTERRUPT_GRACE_S = 5.0
# After one rank raised, how long the others get to finish before they are interrupted: in DDP
# code they are often waiting for the failed rank in a collective that would never return.
FAILURE_GRACE_S = 3.0
# A death is final: the others are interrupted at once and the death is reported within this.
DEATH_REPORT_S = 0.8
# Ranks interrupted and still running are sent SIGINT again this often: a SIGINT that reached a
# rank before its request did is lost (the rank was idle), and a rank takes one per request.
RESIGNAL_S = 0.5
# How many of a dead rank's last stderr lines its failure shows (as the runtime keeps: RankOutput).
STDERR_TAIL_LINES = 20
# The slice in which waiters pump events (they check for Ctrl-C between slices).
SLICE_S = 0.05
# How long the collective picture taken as ranks are interrupted (or one died) waits for their
# answers: each rank's runtime thread answers at once unless C code holds the GIL.
LOOK_S = 0.5
# After an interrupt, how much more of each rank's output is shown (bytes); the rest is kept in its
# result but not shown: a rank that flooded the notebook has a backlog in the runtime's queue
# (up to its cap, 16 MiB), and showing it all would hold the stop button's answer for a minute.
SHOWN_AFTER_INTERRUPT = 64 << 10
# Debuggers that hold ranks stopped outside a prompt (JupyterLab's: ddip.kernel.dap), each with
# paused_s(): the seconds ranks spent stopped there, which are the user's and which a request's
# timeout does not count; and let_go(ranks), told before those ranks are interrupted.
DEBUGGERS: list = []


def _paused_s() -> float:
    return sum(d.paused_s() for d in DEBUGGERS) if DEBUGGERS else 0.0


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
    # (stdout pieces, stderr pieces) while it runs: joined once at the end; None until it prints
    _parts: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.error is None


class Request:
    """One request to some ranks: its results, and the events delivered for it."""

    def __init__(self, rank_ids: list[int], seq: int, slots: list[int], what: str):
        self.seq = seq
        self.slots = slots
        self.what = what
        self.results = {s: RankResult(rank_ids[s]) for s in slots}
        self.pending = set(slots)  # ranks whose reply (or death) has not been processed
        self.mailbox: collections.deque = collections.deque()  # filled by whoever pumps
        self.started = time.monotonic()
        self.failed_at = None  # when the first rank raised
        self.died_at = None  # when the first rank died or stopped answering heartbeats
        self.interrupted_at = None
        self.why = None  # why its ranks were interrupted: "ctrl-c", "timeout", "failure", "death"
        self.callback_errors: list[str] = []
        self.heal = None  # a heal.Healing, once its failure's peers are being released
        self.collectives = None  # a CollectivePicture, when ranks did not stop when interrupted
        self.prompts = _debugger.Prompts()  # ranks' debuggers waiting at a prompt
        self.last_reply: SharedReply | None = None  # the last reply without buffers, for the next alike
        self.shown_after_interrupt: dict[int, int] = {}  # slot -> bytes of output shown since
        self.unshown: dict[int, int] = {}  # slot -> bytes kept but not shown (SHOWN_AFTER_INTERRUPT)
        # Ranks interrupted (by the waiter, or g.interrupt()): while they still run it, their
        # waiter sends SIGINT again at resignal_at, then every RESIGNAL_S (see there).
        self.resignal: set[int] = set()
        self.resignal_at = float("inf")


class SharedReply:
    """One reply that several ranks sent byte for byte alike (every rank's None after `pass`),
    which their host's agent gathered into one, or local ranks sent one after another: unpickled
    once for all of them. Each rank gets that one object where nothing in it can change in place
    (a None, a number, a string, and no display form); else a copy of its own, unpickled again,
    so that no two ranks' results are one mutable object."""

    __slots__ = ("data", "_reply")
    _ATOMS = (type(None), bool, int, float, complex, str, bytes)

    def __init__(self, data: bytes):
        self.data = data
        self._reply = None

    def take(self):
        if self._reply is not None:
            return self._reply
        reply = loads_framed(self.data, ())
        if reply.error is None and reply.format is None and type(reply.value) in self._ATOMS:
            self._reply = reply
        return reply


@dataclass
class Callbacks:
    on_output: Callable | None = None  # (rank, "stdout" | "stderr", text), live
    on_display: Callable | None = None  # (rank, msg): a display() in the rank
    on_message: Callable | None = None  # (rank, obj): ddip.worker.notify(obj) in the rank
    on_done: Callable | None = None  # (RankResult): a rank finished, failed or died


def collect(group, req: Request, cb: Callbacks, timeout, *, interrupt: bool = True,
            stop_waiting_at: float | None = None, on_failure: bool = True,
            ctrl_c: bool = False) -> list[RankResult]:
    """Waits for every rank of `req`. timeout (with interrupt=True): interrupt the ranks then,
    and raise TimeoutError. stop_waiting_at: a deadline after which we stop waiting
    (TimeoutError) and leave the request running. on_failure: interrupt the other ranks when one
    fails (False: the caller handles failures itself, as ranch does). ctrl_c: a Ctrl-C came before
    the wait began (sent_and_collected): interrupt the ranks first, as the wait does for one."""
    waiting = _Waiting(group, req, cb, timeout if interrupt else None, stop_waiting_at, on_failure)
    try:
        waiting.until_done(ctrl_c)
    finally:
        waiting.forget_look()
    stuck = waiting.settle_stuck()
    for r in req.results.values():
        if r._parts is not None:
            out, err = r._parts
            r.stdout, r.stderr = "".join(out), "".join(err)
    for msg in req.callback_errors:
        sys.stderr.write(msg)
    if req.unshown:
        sys.stderr.write(unshown_note(group.runtime, req))
    if req.heal is not None:
        waiting.healer.finish(req, stuck)
    _raise_if_interrupted(group.runtime, req, stuck, timeout)
    return [req.results[s] for s in req.slots]


def sent_and_collected(group, send: Callable | Request, cb: Callbacks, timeout=None,
                       **kw) -> tuple[Request, list[RankResult]]:
    """send() -> the Request it sent, then collect() for it (send: a Request already sent, as a
    Pending's, is collected alone). A Ctrl-C (the stop button) between the two, or before
    collect()'s wait has begun, would leave the ranks running the request with no one to
    interrupt them (the next request: RankBusyError); it interrupts them as one during the wait
    does. The send and the wait are in this one `try`: a signal's KeyboardInterrupt is raised at
    the next function call, loop turn or return from C code, which is inside it; one that came
    after the frames left and before send() returned finds the request where Runtime.send
    recorded it for this thread."""
    req = send if isinstance(send, Request) else None
    sent_here = getattr(group.runtime, "sent_here", None)  # None: a closed group, which send() names
    if sent_here is not None:
        sent_here.request = None
    try:
        if req is None:
            req = send()
        return req, collect(group, req, cb, timeout, **kw)
    except KeyboardInterrupt:
        sent = getattr(sent_here, "request", None)
        req = req or (sent() if sent is not None else None)
        if req is None or req.why is not None:
            raise  # nothing was sent; or the wait's own: it took a first Ctrl-C, or this is a second
        return req, collect(group, req, cb, timeout, ctrl_c=True, **kw)


class _Waiting:
    """collect()'s wait: drains the replies, and applies the failure policy as time passes."""

    def __init__(self, group, req: Request, cb: Callbacks, timeout, stop_waiting_at, on_failure):
        self.rt, self.req, self.cb = group.runtime, req, cb
        self.group = group
        self._healer = None  # made on first use: a request that fails nowhere never needs it
        self.deadline = None if timeout is None else req.started + timeout
        self.stop_waiting_at = stop_waiting_at
        self.on_failure = on_failure
        self.next_look = 0.0  # when to read the ranks' collectives again, after a rank raised
        self.look = None  # (seq, slots) of the collectives asked and not all answered yet
        self.paused_from = _paused_s()

    @property
    def healer(self):
        if self._healer is None:
            self._healer = self.group.healer()
        return self._healer

    def interrupt_pending(self, reason):
        req = self.req
        if reason != "failure" and req.collectives is None:
            # before the interrupt: where a rank that is not waiting is; for a death, what the
            # survivors were in and what the dead rank said, where that is something to say
            self.take_picture(only_findings=reason == "death")
        req.why, req.interrupted_at = reason, time.monotonic()
        for debugger in DEBUGGERS:
            debugger.let_go([self.rt.rank_ids[s] for s in req.pending])
        req.resignal |= req.pending
        req.resignal_at = req.interrupted_at  # now, and again while they still run it
        self._resignal(req.interrupted_at)

    def until_done(self, ctrl_c: bool = False):
        """Returns once every rank replied, or the grace after interrupting them ran out."""
        req = self.req
        while True:
            # Ctrl-C may land anywhere in here (in a callback too): the first one interrupts the
            # ranks and keeps collecting their replies; a second one stops waiting.
            try:
                if ctrl_c:
                    ctrl_c = False
                    self.interrupt_pending("ctrl-c")
                drain(self.rt, req, self.cb)
                if req.prompts.items and self.answer_prompts():
                    continue
                if req.heal is not None:
                    self.healer.release(req)  # ranks that left the collective release their peers
                if not req.pending:
                    return
                now = time.monotonic()
                if req.interrupted_at is not None:
                    end = req.interrupted_at + (DEATH_REPORT_S if req.why == "death" else INTERRUPT_GRACE_S)
                    if now >= end:
                        # What the runtime holds now may have their replies, behind their output.
                        self.rt.pump(0)
                        drain(self.rt, req, self.cb)
                        return
                    wake = min(end, self._resignal(now))
                else:
                    wake = self._act(now)
                    if wake is None:
                        continue
                    if req.resignal:
                        wake = min(wake, self._resignal(now))
                wake = self._stop_waiting(now, wake)
                if self.rt.coord is None and not req.mailbox:
                    for s in list(req.pending):  # closed under us (another thread)
                        req.mailbox.append(("closed", s))
                    continue
                self.rt.pump(max(0.0, min(wake - now, SLICE_S)), len(req.pending))
            except KeyboardInterrupt:
                if req.why == "ctrl-c":
                    raise  # the request stays registered: its late replies still free the ranks
                self.interrupt_pending("ctrl-c")

    def _resignal(self, now) -> float:
        """SIGINT, when resignal_at has come, to the interrupted ranks that still run the request
        (again RESIGNAL_S later); when to look again."""
        req, coord = self.req, self.rt.coord
        if now >= req.resignal_at:
            again = req.resignal & req.pending
            req.resignal_at = now + RESIGNAL_S if again else float("inf")
            if coord is not None:
                for s in again:
                    coord.signal(s, signal.SIGINT)
        return req.resignal_at

    def answer_prompts(self) -> bool:
        """The ranks' debugger prompts, one at a time (ddip/kernel/debugger.py); False when
        none can be asked yet. Time at a prompt is the user's, not the request's: its timeout
        and failure grace wait it out."""
        req, took = self.req, False
        while (item := req.prompts.next(req.pending)) is not None:
            took = True
            began = time.monotonic()
            try:
                req.prompts.ask(self.rt, req, *item)
            finally:
                spent = time.monotonic() - began
                if self.deadline is not None:
                    self.deadline += spent
                if req.failed_at is not None:
                    req.failed_at += spent
        return took

    def _act(self, now) -> float | None:
        """The failure policy before any interrupt: None when it acted now, else when to look again."""
        req = self.req
        wake = now + 0.25
        if req.died_at is not None and self.on_failure:
            self.forget_look()
            self.interrupt_pending("death")  # final: the others can't finish without it
            return None
        if req.failed_at is not None and self.on_failure:
            healer = self.healer
            if req.heal is not None:
                if now >= req.heal.started + healer.RELEASE_S:
                    self.interrupt_pending("failure")  # waits in Python: Ctrl-C's way out
                    return None
                wake = min(wake, req.heal.started + healer.RELEASE_S)
            elif self._survivors_wait_for_the_failed(now) or now >= req.failed_at + FAILURE_GRACE_S:
                self.forget_look()
                if req.collectives is None:
                    self.take_picture(only_findings=True)  # what the heal is about, said with it
                if not healer.begin(req):
                    self.interrupt_pending("failure")
                return None
            else:
                wake = min(wake, req.failed_at + FAILURE_GRACE_S,
                           now + SLICE_S if self.look is not None else self.next_look)
        if self.deadline is not None:
            deadline = self.deadline + _paused_s() - self.paused_from
            if now >= deadline:
                self.interrupt_pending("timeout")
                return None
            wake = min(wake, deadline)
        return wake

    def take_picture(self, only_findings: bool = False):
        """req.collectives: which collective each rank is in, and where a rank that is in none
        is, read now (answers that take longer than LOOK_S are named as missing); only_findings:
        only a picture that finds something. A second Ctrl-C meanwhile goes without it."""
        rt, req = self.rt, self.req
        if rt.coord is None:
            return
        try:
            answers = rt.collectives(list(range(len(rt.rank_ids))), LOOK_S, SLICE_S,
                                     time.time_ns() - int((time.monotonic() - req.started) * 1e9))
        except KeyboardInterrupt:
            return
        picture = CollectivePicture({rt.rank_ids[s]: a for s, a in answers.items()})
        if picture.findings or not only_findings:
            req.collectives = picture

    def _survivors_wait_for_the_failed(self, now) -> bool:
        """Whether the ranks still running wait in a collective that a rank which raised never
        entered (torch's flight recorder says so): heal now, not after FAILURE_GRACE_S. Each
        look waits for every rank's answer, however slowly it comes, while the wait goes on."""
        req, rt = self.req, self.rt
        if rt.coord is None or not self.healer.healable():
            return False
        if self.look is None:
            if now < self.next_look:
                return False
            self.look = rt.ask_start(_core.COLLECTIVES_REQUEST, list(range(len(rt.rank_ids))))
        seq, live = self.look
        if not rt.answered(seq, live):
            return False
        self.look = None
        self.next_look = now + 0.25
        failed = {rt.rank_ids[s] for s in req.slots if s not in req.pending
                  and req.results[s].error is not None and not req.results[s].error.died}
        answers = rt.collectives_of(list(range(len(rt.rank_ids))), rt.ask_end(seq), "did not answer")
        picture = CollectivePicture({rt.rank_ids[s]: a for s, a in answers.items()})
        running = {rt.rank_ids[s] for s in req.pending}
        if running and running <= set(picture.waiting) and failed & set(picture.missing):
            req.collectives = picture
            return True
        return False

    def forget_look(self):
        if self.look is not None:
            self.rt.ask_end(self.look[0])
            self.look = None

    def _stop_waiting(self, now, wake) -> float:
        """stop_waiting_at: past it, TimeoutError with the request left running."""
        at, req = self.stop_waiting_at, self.req
        if at is None:
            return wake
        if now >= at:
            err = TimeoutError(
                f"{req.what}: stopped waiting after {at - now + (now - req.started):.1f} s; "
                f"rank(s) {ranks_text(self.rt, req.pending)} are still running it (result() again to "
                f"wait more, cancel() to interrupt them)")
            err.results = [req.results[s] for s in req.slots]
            raise err
        return min(wake, at)

    def settle_stuck(self) -> set:
        """Ranks that did not stop when interrupted: their stacks, and why they failed."""
        rt, req = self.rt, self.req
        stuck = set(req.pending)
        if not stuck:
            return stuck
        stacks = rt.stacks(sorted(stuck), 2.0, SLICE_S) if rt.coord is not None else {}
        if rt.coord is not None and req.collectives is None:  # what keeps the stuck ones
            answers = rt.collectives(list(range(len(rt.rank_ids))), 2.0, SLICE_S)
            req.collectives = CollectivePicture({rt.rank_ids[s]: a for s, a in answers.items()})
        grace = DEATH_REPORT_S if req.why == "death" else INTERRUPT_GRACE_S
        for s in stuck:
            r = req.results[s]
            r.stacks = stacks.get(s)
            if s in rt.unresponsive:
                r.error = unresponsive_failure(r.rank, rt.unresponsive[s], rt.hosts[s])
            else:
                r.error = RankFailure(
                    rank=r.rank, kind=FailureKind.STILL_RUNNING, at=time.monotonic(),
                    evalue=f"did not stop within {grace:g} s of being interrupted (waiting in C code, or in "
                           f"a collective for a failed rank?); it stays busy until it finishes: {WAYS_ON}",
                    traceback=(["where it was:"] + r.stacks.splitlines()) if r.stacks else [])
        req.pending.clear()
        return stuck


def _raise_if_interrupted(rt, req: Request, stuck: set, timeout):
    """KeyboardInterrupt or TimeoutError when the user's Ctrl-C or the timeout interrupted it;
    where ranks did not stop, the message leads with the collective each rank is in."""
    picture = req.collectives.describe() if req.collectives is not None and req.collectives.known else ""
    picture = "\n" + picture if picture else ""
    if req.why == "ctrl-c":
        still = f"; rank(s) {ranks_text(rt, stuck)} did not stop and are still busy ({WAYS_ON})" if stuck else ""
        err = KeyboardInterrupt(f"interrupted rank(s) {ranks_text(rt, req.slots)}{still}{picture}")
        err.collectives = req.collectives
        err.results = [req.results[s] for s in req.slots]  # stuck ranks' .stacks: where they were
        raise err
    if req.why == "timeout":
        err = TimeoutError(f"the request did not finish within {timeout:g} s, so rank(s) "
                           f"{ranks_text(rt, req.slots)} were interrupted"
                           + (f"; rank(s) {ranks_text(rt, stuck)} did not stop and are still busy "
                              f"(their stacks are in .results[i].stacks; {WAYS_ON}){picture}" if stuck else
                              f"; they stopped after {time.monotonic() - req.started:.1f} s"))
        err.collectives = req.collectives
        err.results = [req.results[s] for s in req.slots]
        raise err


def unshown_note(rt, req: Request) -> str:
    """What was not shown of the ranks' output after they were interrupted, and where it is."""
    size = sum(req.unshown.values())
    amount = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
    return (f"ddip: {amount} more output from rank(s) {ranks_text(rt, req.unshown)} after they were "
            f"interrupted was not shown (the first {SHOWN_AFTER_INTERRUPT >> 10} KiB of each was; "
            f"the request's results keep it all, in .stdout and .stderr)\n")


def ranks_text(rt, slots) -> str:
    return ", ".join(str(rt.rank_ids[s]) for s in sorted(slots))


def unresponsive_failure(rank, age, host=None) -> RankFailure:
    return RankFailure(rank=rank, kind=FailureKind.UNRESPONSIVE,
                       evalue=f"no heartbeat for {age:.1f} s ({unresponsive_cause([host] if host else [])}); "
                              f"%makedip -r / g.restart() replaces it")


def drain(rt, req: Request, cb: Callbacks):
    """Processes what the runtime delivered into `req`'s mailbox, calling the callbacks."""
    mailbox = req.mailbox
    while mailbox:
        # deque's popleft is atomic: the pumping thread may append meanwhile, no lock needed.
        _handle(req, mailbox.popleft(), cb)


def _call(req: Request, cb: Callbacks, name: str, *args):
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


def close_fds(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _handle(req: Request, item, cb: Callbacks):
    tag, slot = item[0], item[1]
    if tag == "done alike":  # slot: the ranks of one host that replied alike (runtime.dispatch_shared)
        _done_alike(req, slot, item[2], cb)
        return
    if slot not in req.pending:
        if tag == "done":
            close_fds(item[3])
        return
    r = req.results[slot]
    if tag == "output":
        _output(req, r, slot, item[2], item[3].decode(errors="replace"), cb)
        return
    if tag == "done":
        _done(req, r, slot, item[2], item[3], cb)
        return
    if tag == "display" or tag == "message":
        try:
            msg = loads(item[2])
        except Exception:
            return
        prompt = _debugger.prompt_of(msg) if tag == "display" else None
        if prompt is not None:
            req.prompts.add(slot, prompt)  # asked by the request's waiter (collect)
        elif tag == "message":
            _call(req, cb, "on_message", r.rank, msg)
        elif cb.on_display is not None:
            _call(req, cb, "on_display", r.rank, msg)
        else:
            r.displays.append(msg)
        return
    if tag == "truncated":
        r.error = RankFailure(rank=r.rank, ename="OSError",
                              evalue="out of file descriptors: the notebook could not receive this rank's "
                                     "reply buffers (raise `ulimit -n`, or close files and DataLoader "
                                     "workers in the notebook)")
        _finish(req, slot, cb)
    elif tag == "died":
        r.error = item[2]
        # The lines it wrote while running this request: what led to its death, not earlier cells'.
        err = "".join(r._parts[1]) if r._parts is not None else ""
        r.error.stderr_tail = "\n".join(err.splitlines()[-STDERR_TAIL_LINES:])
        req.died_at = req.died_at or time.monotonic()
        _finish(req, slot, cb)
    elif tag == "unresponsive":
        r.error = unresponsive_failure(r.rank, item[2], item[3])
        req.died_at = req.died_at or time.monotonic()
        _finish(req, slot, cb)
    elif tag == "broken":
        r.error = RankFailure(rank=r.rank, kind=FailureKind.CLOSED, ename="RuntimeFailure", evalue=item[2])
        _finish(req, slot, cb)
    elif tag == "closed":
        r.error = RankFailure(rank=r.rank, kind=FailureKind.CLOSED, evalue="the group was closed while it ran")
        _finish(req, slot, cb)


def _output(req: Request, r: RankResult, slot: int, stream: str, text: str, cb: Callbacks):
    parts = r._parts
    if parts is None:
        parts = r._parts = ([], [])
    parts[stream == "stderr"].append(text)  # joined once at the end: += would be quadratic
    if req.interrupted_at is not None:
        shown = req.shown_after_interrupt.get(slot, 0)
        if shown >= SHOWN_AFTER_INTERRUPT:
            req.unshown[slot] = req.unshown.get(slot, 0) + len(text)
            return
        req.shown_after_interrupt[slot] = shown + len(text)
    _call(req, cb, "on_output", r.rank, stream, text)


def _done(req: Request, r: RankResult, slot: int, data, fds, cb: Callbacks):
    try:
        if isinstance(data, SharedReply):
            reply = data.take()
        elif fds:
            reply = loads_framed(data, fds)
        else:  # ranks on this host reply alike too: unpickled once while they do
            if req.last_reply is None or req.last_reply.data != data:
                req.last_reply = SharedReply(data)
            reply = req.last_reply.take()
        _fill(r, reply)
    except Exception as exc:
        r.error = _unpickling_failure(r.rank, exc)
    _finish(req, slot, cb)


def _done_alike(req: Request, slots: list[int], shared: SharedReply, cb: Callbacks):
    """The ranks whose one reply their host's agent gathered: each gets it (one object where
    nothing in it can change, else a copy), in one pass rather than one mailbox item each."""
    try:
        reply = shared.take()
    except Exception as exc:
        reply, failure = None, exc
    else:
        failure = None
    alike = shared._reply is not None
    pending, results = req.pending, req.results
    now = time.monotonic()
    if alike and cb.on_done is None:
        # The usual case (every rank's None after `pass`): each result's fields set in one
        # pass, with no call per rank, so that 128 ranks' replies cost the notebook little more
        # than 16's.
        value, format, count = reply.value, reply.format, reply.execution_count
        live = [slot for slot in slots if slot in pending]
        for slot in live:
            r = results[slot]
            r.value, r.format, r.execution_count, r.finished_at = value, format, count, now
        pending.difference_update(live)
        return
    for slot in slots:
        if slot in pending:
            r = results[slot]
            try:
                if failure is not None:
                    raise failure
                _fill(r, reply if alike else shared.take())
            except Exception as exc:
                r.error = _unpickling_failure(r.rank, exc)
            if r.error is None and cb.on_done is None:  # _finish, where it has nothing else to do
                pending.discard(slot)
                r.finished_at = now
            else:
                _finish(req, slot, cb)


def _unpickling_failure(rank: int, exc: Exception) -> RankFailure:
    return RankFailure(rank=rank, ename="UnpicklingError",
                       evalue=f"its reply could not be unpickled in the notebook: {type(exc).__name__}: {exc} "
                              f"(is what it returned importable here?)")


def _finish(req: Request, slot: int, cb: Callbacks):
    r = req.results[slot]
    req.pending.discard(slot)
    r.finished_at = time.monotonic()
    if r.error is not None:
        r.error.at = r.finished_at
        _name_the_interrupt(req, r.error)
        if r.error.kind is FailureKind.RAISED and req.failed_at is None:
            req.failed_at = r.finished_at  # the others may be waiting for it in a collective
    if cb.on_done is not None:
        _call(req, cb, "on_done", r)


def _name_the_interrupt(req: Request, error: RankFailure):
    """A KeyboardInterrupt that ddip's own interrupt raised in a rank (after a death, a failure or
    the timeout) says so, naming the cause: nobody pressed stop."""
    if req.why not in ("death", "failure", "timeout") or error.kind is not FailureKind.RAISED \
            or error.ename != "KeyboardInterrupt" or error.at < req.interrupted_at:
        return
    why = "the request's timeout ran out"
    if req.why != "timeout":
        first = root_cause_first([x.error for x in req.results.values()
                                  if x.error is not None and x.error is not error])
        if not first:
            return
        f = first[0]
        how = f"died ({f.evalue})" if f.died else (
            "stopped answering heartbeats" if f.kind is FailureKind.UNRESPONSIVE else f"raised {f.ename}")
        why = f"rank {f.rank} {how}" + (" while this rank still ran" if req.why == "failure" else "")
    old, error.evalue = error.evalue, f"interrupted by ddip because {why} (nobody pressed stop)"
    if error.traceback and old and old in error.traceback[-1]:  # IPython's last line: "ename: evalue"
        error.traceback[-1] = error.traceback[-1].replace(old, error.evalue)


def _fill(result: RankResult, reply: Done):
    result.value = reply.value
    result.format = reply.format
    result.execution_count = reply.execution_count
    err = reply.error
    if err is not None:
        result.error = RankFailure(rank=result.rank, ename=err.ename, evalue=err.evalue,
                                   traceback=list(err.traceback), exception=err.exception)


def raise_failures(results: list[RankResult], what: str, heal: HealReport | None = None, collectives=None):
    """RemoteError for the failed ranks, root cause first (errors.root_cause_first); with the
    collective picture when ranks did not stop."""
    failures = [r.error for r in results if r.error is not None]
    if failures:
        raise RemoteError(root_cause_first(failures), results, what, heal, collectives)


def positive_timeout(timeout, what="timeout"):
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ValueError(f"{what} must be a positive number of seconds (or None), got {timeout!r}")


class Pending:
    """A request sent with apply_async. results()/result() wait for it; with timeout= they stop
    waiting (TimeoutError) and leave it running, so they can be called again; cancel()
    interrupts it. It holds no runtime resources: a closed group's sockets are not pinned."""

    def __init__(self, group, req: Request):
        self._group_ref = weakref.ref(group)
        self._generation = group.generation
        self._req = req
        self._what = req.what
        self._cb = Callbacks()
        self._results: list[RankResult] | None = None
        # True: interrupt the other ranks when one fails; a caller that stops them itself (ranch) sets False
        self.on_failure = True
        self._heal: HealReport | None = None
        self._collectives = None

    @property
    def done(self) -> bool:
        """Whether every rank has replied (or died); does not wait."""
        if self._results is not None:
            return True
        group = self._live_group()
        group.runtime.pump(0)
        drain(group.runtime, self._req, self._cb)
        return not self._req.pending

    def _live_group(self):
        group = self._group_ref()
        if group is None or group.generation != self._generation or group.runtime is None:
            raise GroupClosedError(restarted=True)
        return group

    def results(self, on_output: Callable | None = None, on_display: Callable | None = None,
                timeout: float | None = None, *, on_message: Callable | None = None,
                on_done: Callable | None = None) -> list[RankResult]:
        """Waits for every rank; per-rank RankResults, errors included (nothing is raised).
        on_done(result) is called as each rank finishes (or dies), so a caller can act on the
        first failure; on_message(rank, obj) receives ddip.worker.notify(obj) from ranks.
        timeout: stop waiting after that many seconds (TimeoutError); the request goes on."""
        positive_timeout(timeout)
        if self._results is None:
            group = self._live_group()
            self._cb = Callbacks(on_output, on_display, on_message, on_done)
            stop = None if timeout is None else time.monotonic() + timeout
            _, self._results = sent_and_collected(group, self._req, self._cb, None, stop_waiting_at=stop,
                                                  on_failure=self.on_failure)
            self._heal = self._req.heal.report if self._req.heal else None
            self._collectives = self._req.collectives
            self._req = None  # nothing of the runtime is kept once collected
        return self._results

    def result(self, on_output: Callable | None = None, timeout: float | None = None) -> list:
        """Waits for every rank; their return values in rank order, or RemoteError.
        timeout: stop waiting after that many seconds (TimeoutError); the request goes on."""
        results = self.results(on_output=on_output, timeout=timeout)
        raise_failures(results, self._what, self._heal, self._collectives)
        return [r.value for r in results]

    def cancel(self):
        """Interrupts the request's ranks (KeyboardInterrupt in their code); result() then
        reports how each one ended."""
        if self._results is not None:
            return
        group = self._live_group()
        group.runtime.interrupt(list(self._req.pending))
