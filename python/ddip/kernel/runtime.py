"""The runtime side of a started group: the Coordinator, its event stream, and where each event
goes.

One `Runtime` per start of a `Group` (a restart makes a new one). It owns the ranks' state (idle,
busy, dead), the request each rank is running, and the mailboxes events are delivered into.
Whoever waits on the group pumps: one thread at a time takes events from the runtime and puts
each into the mailbox of the request its rank is running (the frame's sequence number must
match); the others wait on the condition. Callbacks never run here: each request's own waiter
(ddip/kernel/request.py) processes its mailbox.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
import weakref

from .. import _core
from ..errors import FailureKind, RankBusyError, RankDeadError, RankFailure, RankUnresponsiveError, StartError
from ..labels import LabelledOutput
from ..messages import dumps, dumps_framed, loads
from .request import RESIGNAL_S, Request, SharedReply, close_fds

# Events from _core.Coordinator are _core.Event objects whose kind the runtime has classified
# (python/src/bind_coordinator.cpp): ev.kind, ev.slot, ev.seq, ev.data, ... What a request's
# mailbox gets from them, by tag: ("output", slot, stream, data), ("done", slot, data, fds),
# ("done alike", slots, SharedReply) (one reply for several ranks, dispatch_shared),
# ("display" | "message", slot, data), ("truncated", slot); see request.py for the others.
_REPLY_KINDS = frozenset(("done", "display", "message", "truncated"))
# A dead rank's last lines of stderr that its collectives answer carries (CollectivePicture).
LAST_WORDS = 4
# How long an idle rank's output is kept for the next cell (per rank); older output is dropped.
BACKGROUND_KEEP_BYTES = 64 * 1024


class Runtime:
    """A started group's Coordinator and the state its events change."""

    def __init__(self, coord, rank_ids: list[int], hosts: list[str | None] | None = None):
        size = len(rank_ids)
        self.coord = coord
        self.rank_ids = rank_ids
        self.hosts = hosts or [None] * size  # slot -> the other host it runs on (None: this machine)
        self.mu = threading.RLock()  # guards the state below; never held while waiting
        # Per thread, the request it sent last (a weak reference: its results are the caller's
        # to keep), recorded with the request's bookkeeping (send): how a KeyboardInterrupt that
        # came after the frames left finds the request it left running, wherever it landed
        # (sent_and_collected). Registered, it lives while its ranks run it.
        self.sent_here = threading.local()
        self.cv = threading.Condition(self.mu)
        self.pumping = False  # one thread at a time takes events from the runtime
        self.waiters = 0  # threads waiting in pump() for the one that pumps
        self.broken = None  # why the runtime stopped on its own, if it did
        self.seq = 0
        self.state = ["starting"] * size
        self.exits: dict[int, RankFailure] = {}
        self.running: dict[int, Request] = {}  # slot -> the request it is busy with
        self.inbox = collections.deque()  # events taken from the Coordinator, not yet dispatched
        self.unresponsive: dict[int, float] = {}  # slot -> seconds without a heartbeat
        self.background = {s: collections.deque() for s in range(size)}  # idle ranks' output
        self.background_bytes = [0] * size
        self.background_dropped = [0] * size
        self.background_waiting: set[int] = set()  # slots with background output kept or dropped
        self.answers: dict[int, dict[int, bytes]] = {}  # seq -> slot -> a stacks/collectives answer
        self.info: list[dict] = [{} for _ in range(size)]  # each rank's hello
        self.last_line: list[str] = [""] * size  # the last line each rank printed (the rank panel's)
        self.replaced: dict[int, RankFailure] = {}  # slot -> the death heal replaced it after
        self.specs: list[tuple] = []  # slot -> (argv, env, cwd) it was started with (Group._start)
        self.template = None  # the rank template the ranks were started with, if any

    def wait_ready(self, timeout: float):
        """Until every rank said hello; StartError naming the rank and why when one can't."""
        deadline = time.monotonic() + timeout
        waiting = set(range(len(self.rank_ids)))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = ", ".join(str(self.rank_ids[s]) for s in sorted(waiting))
                raise StartError(f"rank(s) {ranks} did not become ready within {timeout:g} s",
                                 [self.rank_ids[s] for s in waiting], timeout=timeout)
            ev = self.coord.next_event(min(left, 0.25) * 1000)
            if ev is None:
                continue
            kind, slot = ev.kind, ev.slot
            if kind == "hello":
                self.info[slot] = loads(ev.data)
                self.state[slot] = "idle"
                waiting.discard(slot)
            elif kind == "exited":
                f = self.death(slot, ev)
                raise StartError(f"rank {f.rank} exited while starting ({f.evalue})"
                                 + (f"; last lines of its stderr:\n{f.stderr_tail}" if f.stderr_tail else ""),
                                 [f.rank], failure=f)
            elif kind == "lost":
                f = self.lost(slot, ev.data)
                raise StartError(f"rank {f.rank} could not start: {f.evalue}", [f.rank], failure=f)
            elif kind == "failed":
                raise StartError(ev.data.decode(errors="replace"))
            else:
                with self.mu:
                    self.dispatch(ev)

    def lost(self, slot, why: bytes) -> RankFailure:
        """A rank on another host, gone with its host's link (or launcher): a death."""
        f = RankFailure(rank=self.rank_ids[slot], kind=FailureKind.LOST, evalue=why.decode(errors="replace"))
        self.state[slot] = "dead"
        self.exits[slot] = f
        return f

    def death(self, slot, ev) -> RankFailure:
        """An "exited" event: its cause in the runtime's words (ExitStatus::describe)."""
        code, sig = ev.code, ev.signal
        f = RankFailure(rank=self.rank_ids[slot], kind=FailureKind.DIED, evalue=ev.why,
                        stderr_tail=ev.data.decode(errors="replace"),
                        exit_code=None if sig or code < 0 else code, exit_signal=sig or None)
        self.state[slot] = "dead"
        self.exits[slot] = f
        return f

    def pump(self, timeout: float, replies: int = 0):
        """Delivers the events that arrive within `timeout` seconds (at least those already
        there) into their requests' mailboxes. Returns early once something was delivered; with
        `replies` (a request's ranks yet to reply), once that many replies were, or what came
        waited 5 ms (CoordinatorOptions::reply_wait): a request's replies are taken in one go."""
        inbox = self.inbox
        mine = False  # this call set `pumping`: its `finally` must clear it
        try:
            # The lock's exit is itself a place where a Ctrl-C's KeyboardInterrupt lands (Python
            # checks for signals after a call of C code): inside this `try`, so that `pumping` set
            # just before it is cleared, not left set for good (every later pump would wait for
            # one that never comes: replies undelivered, "did not stop", the group busy).
            with self.mu:
                if self.pumping:
                    # Another thread pumps; it wakes us when it delivers something.
                    if timeout > 0:
                        self.waiters += 1
                        try:
                            self.cv.wait(timeout)
                        finally:
                            self.waiters -= 1
                    return
                coord = self.coord
                if coord is None:
                    return
                self.pumping = mine = True
            # Everything queued comes in one call, straight into the inbox: an interrupt can't
            # lose what was taken, and what a Ctrl-C left undispatched goes first next time.
            coord.next_events(inbox, timeout * 1000 if timeout > 0 else 0, replies)
        finally:
            if mine:
                # Every event taken is delivered, whatever a Ctrl-C does meanwhile: its
                # KeyboardInterrupt (raised wherever Python checks for signals: a function's entry,
                # a loop's turn, after a call of C code) is raised again after. Else the events
                # still in the inbox (replies among them) would wait for the next pump, and
                # `pumping` left set would make every later pump wait for one that never comes:
                # the ranks done, and the group busy for good. An event is taken off the inbox
                # once dispatched: one interrupted on its way is dispatched again. These loops
                # (and send's) are inline, not a helper: a helper's entry would itself be a place
                # where a KeyboardInterrupt lands, outside its `try`.
                interrupted = None
                with self.mu:
                    try:
                        while True:
                            try:
                                while inbox:
                                    self.dispatch(inbox[0])
                                    inbox.popleft()
                                break
                            except KeyboardInterrupt as exc:
                                interrupted = exc
                    finally:
                        self.pumping = False
                        if self.waiters:
                            self.cv.notify_all()
                if interrupted is not None:
                    raise interrupted

    def dispatch(self, ev):
        """Puts one event where it belongs. Called with self.mu held; never raises."""
        kind, slot = ev.kind, ev.slot
        req = self.running.get(slot) if slot >= 0 else None
        if kind == "output":
            self.note_line(slot, ev.data)
            if req is not None:
                req.mailbox.append(("output", slot, ev.stream, ev.data))
            else:
                self.keep_background(slot, ev.stream, ev.data)
        elif kind in _REPLY_KINDS:
            if ev.slots:
                return self.dispatch_shared(ev)
            if req is None or req.seq != ev.seq:
                close_fds(ev.fds)  # a reply to a request its rank no longer runs (cannot happen)
                return
            if kind == "done":
                req.mailbox.append(("done", slot, ev.data, ev.fds))
            elif kind == "truncated":
                req.mailbox.append(("truncated", slot))
            else:
                req.mailbox.append((kind, slot, ev.data))
            if kind == "done" or kind == "truncated":
                del self.running[slot]
                if self.state[slot] == "busy":
                    self.state[slot] = "idle"
        elif kind == "stacks" or kind == "collectives":
            answers = self.answers.get(ev.seq)
            if answers is not None:
                answers[slot] = ev.data
        elif kind == "exited" or kind == "lost":
            f = self.death(slot, ev) if kind == "exited" else self.lost(slot, ev.data)
            self.unresponsive.pop(slot, None)
            if req is not None:
                del self.running[slot]
                req.mailbox.append(("died", slot, f))
        elif kind == "hello":  # a rank started again (respawn), connected
            self.info[slot] = loads(ev.data)
            if self.state[slot] == "starting":
                self.state[slot] = "idle"
        elif kind == "unresponsive":
            self.unresponsive[slot] = ev.age
            if req is not None:
                req.mailbox.append(("unresponsive", slot, ev.age, self.hosts[slot]))
        elif kind == "responsive":
            self.unresponsive.pop(slot, None)
        elif kind == "failed":
            self.broken = ev.data.decode(errors="replace")
            for r in set(self.running.values()):
                for s in list(r.pending):
                    r.mailbox.append(("broken", s, self.broken))
            self.running = {}

    def dispatch_shared(self, ev):
        """A reply that several ranks of one host sent alike, gathered by its agent (ev.slots):
        each of their requests gets it, to be unpickled once for all (request.SharedReply)."""
        shared = SharedReply(ev.data)
        slots, running, state = ev.slots, self.running, self.state
        reqs = set(map(running.get, slots))
        if len(reqs) == 1:  # the usual case: one request's ranks, in one pass with no call per rank
            req = reqs.pop()
            if req is None or req.seq != ev.seq:
                return  # a reply to a request its ranks no longer run (cannot happen)
            for slot in slots:
                del running[slot]
                if state[slot] == "busy":
                    state[slot] = "idle"
            req.mailbox.append(("done alike", slots, shared))
            return
        by_request: dict[Request, list[int]] = {}
        for slot in ev.slots:
            req = self.running.get(slot)
            if req is None or req.seq != ev.seq:
                continue  # a reply to a request its rank no longer runs (cannot happen)
            by_request.setdefault(req, []).append(slot)
            del self.running[slot]
            if self.state[slot] == "busy":
                self.state[slot] = "idle"
        for req, slots in by_request.items():  # one mailbox item for all of them
            req.mailbox.append(("done alike", slots, shared))

    def respawn(self, slot: int, env: dict[str, str], template_for=None) -> int:
        """Starts a dead slot's rank again: its spec as it was started, with `env` on top, forked
        from template_for(spec) (the group's rank template, or None: cold) when the group's ranks
        were forked from one; on another host, by that host's agent from its own rank template. The
        slot is "starting" (and no longer dead) until its hello. Returns the new pid (-1 on
        another host: its hello says); raises (changing nothing) when it can't."""
        with self.mu:
            coord = self.coord
            if coord is None or slot not in self.exits:
                raise RuntimeError(f"rank {self.rank_ids[slot]} is not dead: only a dead rank is replaced")
        argv, old_env, cwd = self.specs[slot]
        merged = [kv for kv in old_env if kv.split("=", 1)[0] not in env] + [f"{k}={v}" for k, v in env.items()]
        spec = (argv, merged, cwd)
        here = self.hosts[slot] is None  # another host's rank forks from that host's rank template
        tmpl = template_for(spec) if here and self.template is not None and template_for is not None else None
        pid = coord.respawn(slot, spec, tmpl)
        with self.mu:
            self.specs[slot] = spec
            self.replaced[slot] = self.exits.pop(slot)
            self.unresponsive.pop(slot, None)
            self.running.pop(slot, None)
            self.state[slot] = "starting"
            self.info[slot] = {}
            self.background[slot].clear()
            self.background_bytes[slot] = self.background_dropped[slot] = 0
            self.last_line[slot] = ""
        return pid

    def wait_hello(self, slots, timeout: float, slice_s: float):
        """Until each of `slots` (started again) said hello; the slots that died instead, or did
        not say it within `timeout`, with why."""
        deadline = time.monotonic() + timeout
        while True:
            with self.mu:
                waiting = [s for s in slots if self.state[s] == "starting"]
            left = deadline - time.monotonic()
            if not waiting or left <= 0 or self.coord is None:
                break
            self.pump(min(left, slice_s))
        with self.mu:
            bad = {s: self.exits[s].evalue for s in slots if s in self.exits}
            bad.update({s: f"it did not connect within {timeout:g} s" for s in slots
                        if self.state[s] == "starting"})
        return bad

    def note_line(self, slot, data: bytes):
        """Keeps the last line of text in `data` as the rank's last line (a bar redrawn with \\r
        counts by its latest state); output that is only line ends leaves it as it was."""
        end = len(data)
        while end > 0:
            start = max(data.rfind(b"\n", 0, end), data.rfind(b"\r", 0, end)) + 1
            if data[start:end].strip():
                self.last_line[slot] = data[start:end].decode(errors="replace").strip()[-400:]
                return
            end = start - 1

    def keep_background(self, slot, stream, data):
        self.background_waiting.add(slot)
        q = self.background[slot]
        q.append((stream, data))
        self.background_bytes[slot] += len(data)
        while self.background_bytes[slot] > BACKGROUND_KEEP_BYTES and len(q) > 1:
            _, old = q.popleft()
            self.background_bytes[slot] -= len(old)
            self.background_dropped[slot] += len(old)

    def show_background(self):
        """Output ranks wrote while no request ran (a thread they started, say): shown, labelled,
        before the next request's output; only the last BACKGROUND_KEEP_BYTES per rank are kept."""
        if not self.background_waiting:  # a look without the lock: what comes meanwhile shows next time
            return
        with self.mu:
            pending = []
            waiting, self.background_waiting = self.background_waiting, set()
            for slot in sorted(waiting):
                q = self.background[slot]
                if q or self.background_dropped[slot]:
                    pending.append((slot, list(q), self.background_dropped[slot]))
                    q.clear()
                    self.background_bytes[slot] = 0
                    self.background_dropped[slot] = 0
        if not pending:
            return
        out = LabelledOutput()
        for slot, items, dropped in pending:
            rank = self.rank_ids[slot]
            if dropped:
                out(rank, "stderr", f"[ddip: {dropped} bytes of earlier output from rank {rank} "
                                    f"were dropped while no cell was running]\n")
            for stream, data in items:
                out(rank, stream, data.decode(errors="replace"))

    def send(self, slots: list[int], msg, what: str) -> Request:
        """Sends `msg` (a request record of ddip.messages) to `slots` as one request; raises
        (sending nothing) when one of them is dead, stopped or busy (RankDeadError,
        RankUnresponsiveError, RankBusyError), or `msg` can't be pickled."""
        coord = self.coord
        if coord is not None:
            # What the ranks printed while idle and is still in their pipes is read now, and shown
            # as theirs before this request's output, not taken for the request's own.
            coord.catch_up_output(slots)
        self.pump(0)
        self.show_background()
        with self.mu:
            self._refuse_unready(slots)
            coord = self.coord
            # Pickled before anything is sent: a value that can't be pickled changes nothing.
            payload, segments = dumps_framed(msg, lambda raw: (coord.put(raw),) * 2, coord.release)
            self.seq += 1
            request = Request(self.rank_ids, self.seq, slots, what)
            # Once the frames are sent, the bookkeeping is done whatever a Ctrl-C does (its
            # KeyboardInterrupt lands where Python checks for signals: a loop's turn, a function's
            # entry, after a call of C code, this `with`'s exit among them): a request sent and
            # not registered would run in its ranks with no one to wait for it or interrupt it.
            # The KeyboardInterrupt is raised after; sent_and_collected finds the request in
            # sent_here, waits for it and interrupts the ranks.
            interrupted = None
            try:
                coord.send(slots, _core.REQUEST, request.seq, payload, segments)
            except KeyboardInterrupt as exc:  # raised as send returned: the frames are gone, so
                interrupted = exc  # the request is registered (let through, it ran on unwaited for)
            finally:
                while True:
                    try:
                        while segments:  # the frames hold their own references now
                            coord.release(segments.pop())
                        break
                    except KeyboardInterrupt as exc:
                        interrupted = exc
            while True:
                try:
                    self.running.update(dict.fromkeys(slots, request))
                    state = self.state
                    for s in slots:
                        state[s] = "busy"
                    self.sent_here.request = weakref.ref(request)
                    break
                except KeyboardInterrupt as exc:
                    interrupted = exc
            if interrupted is not None:
                raise interrupted
        return request

    def _refuse_unready(self, slots):
        """Raises, before anything is sent, when one of `slots` is dead, stopped or busy
        (RankDeadError, RankUnresponsiveError, RankBusyError). With self.mu held."""
        # Each check looks at the ranks only when some rank is in that state.
        dead = self.exits and [self.exits[s] for s in slots if s in self.exits]
        if dead:
            raise RankDeadError(dead)
        # Before busy: a stopped rank may still hold a request, and it would never answer a new one.
        stopped = self.unresponsive and {
            self.rank_ids[s]: max(self.unresponsive[s], self.coord.heartbeat_age_ms(s) / 1000)
            for s in slots if s in self.unresponsive}
        if stopped:
            raise RankUnresponsiveError(stopped, {self.rank_ids[s]: self.hosts[s] for s in slots})
        busy = self.running and [self.rank_ids[s] for s in slots if s in self.running]
        if busy:
            raise RankBusyError(busy)

    def answer(self, slot: int, req: Request, msg) -> bool:
        """Sends `msg` to one rank while it runs `req` (a debugger prompt's PromptAnswer: the rank
        waits for it with the request's own sequence number). False when it no longer runs it."""
        with self.mu:
            coord = self.coord
            if coord is None or self.running.get(slot) is not req:
                return False
        coord.send([slot], _core.REQUEST, req.seq, dumps(msg))
        return True

    def signal(self, slots, sig: int):
        for s in slots:
            self.coord.signal(s, sig)

    def interrupt(self, slots):
        """SIGINT to `slots`; those running a request get it again from its waiter until they
        reply (Request.resignal): one sent before the rank read its request is lost."""
        with self.mu:
            for s in slots:
                req = self.running.get(s)
                if req is not None:
                    req.resignal.add(s)
                    req.resignal_at = min(req.resignal_at, time.monotonic() + RESIGNAL_S)
        self.signal(slots, signal.SIGINT)

    def abort_collectives(self, slots):
        """Heal's abort, asked of each slot's runtime thread: it raises the rank's abort signal
        on the rank itself, after putting back its handler if other code had reset it (a signal
        sent from here would kill a rank whose handler was reset)."""
        with self.mu:
            live = [s for s in slots if s not in self.exits]
            self.seq += 1
            seq = self.seq
            coord = self.coord
        if live and coord is not None:
            coord.send(live, _core.ABORT_REQUEST, seq, b"")

    def stacks(self, slots, timeout, slice_s: float) -> dict[int, str]:
        """Each slot's Python stack, answered by its runtime thread; a text saying why not for a
        dead rank or one that did not answer within `timeout`."""
        got = self.ask(_core.STACK_REQUEST, slots, timeout, slice_s)
        out = {}
        for s in slots:
            if s in self.exits:
                out[s] = f"(rank {self.rank_ids[s]} is dead: {self.exits[s].evalue})"
            elif s in got:
                out[s] = with_own_frames_folded(without_own_threads(got[s].decode(errors="replace")))
            else:
                out[s] = f"(rank {self.rank_ids[s]} did not answer within {timeout:g} s)"
        return out

    def collectives(self, slots, timeout, slice_s: float, since_ns: int | None = None) -> dict[int, dict | bytes]:
        """Each live slot's collectives as its flight recorder has them: rank/collectives.py's
        snapshot, its JSON as it came (the runtime's CollectivePicture reads it), or {"off": why}:
        dead, not answering, no flight recorder there. since_ns: the wall-clock start of the
        request a rank died in (its death is read against the collectives issued since)."""
        return self.collectives_of(slots, self.ask(_core.COLLECTIVES_REQUEST, slots, timeout, slice_s),
                                   f"did not answer within {timeout:g} s", since_ns)

    def collectives_of(self, slots, got: dict, silent: str, since_ns: int | None = None) -> dict[int, dict | bytes]:
        """collectives()' answers from what `got` holds; `silent` says why a live slot has none."""
        out = {}
        for s in slots:
            if s in self.exits:
                # its last words say what killed it (gloo aborts a rank given the wrong size)
                out[s] = {"off": f"dead: {self.exits[s].evalue}", "since_ns": since_ns,
                          "last_words": self.exits[s].stderr_tail.splitlines()[-LAST_WORDS:]}
            elif s not in got:
                out[s] = {"off": f"{silent} (the runtime's Python thread is held: code that keeps the GIL in C)"}
            else:
                out[s] = got[s] or {"off": "not a rank with torch.distributed"}
        return out

    def ask(self, request_kind: int, slots, timeout, slice_s: float) -> dict[int, bytes]:
        """Sends `request_kind` to each live slot and waits up to `timeout` for their answers,
        which their runtime thread gives even while their code runs; slot -> answer."""
        seq, live = self.ask_start(request_kind, slots)
        try:
            deadline = time.monotonic() + timeout
            while not self.answered(seq, live):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.pump(min(left, slice_s))
        finally:
            got = self.ask_end(seq)
        return got

    def ask_start(self, request_kind: int, slots) -> tuple[int, list[int]]:
        """ask() without the wait: (its sequence number, the live slots asked). Whoever pumps
        files the answers as they come; answered() says when all are in, ask_end() takes them."""
        with self.mu:
            self.seq += 1
            seq = self.seq
            self.answers[seq] = {}
            coord = self.coord
        live = [s for s in slots if s not in self.exits]
        if live and coord is not None:
            coord.send(live, request_kind, seq, b"")
        return seq, live

    def answered(self, seq: int, live) -> bool:
        """Whether every slot of `live` answered ask `seq` (or died meanwhile, or the group closed)."""
        with self.mu:
            got = self.answers.get(seq, {})
            return self.coord is None or all(s in got or s in self.exits for s in live)

    def ask_end(self, seq: int) -> dict[int, bytes]:
        with self.mu:
            return self.answers.pop(seq, {})

    def detach(self):
        """Marks every rank closed and tells the requests still running; returns the
        Coordinator to close (None when already detached). Called once, by Group.close()."""
        with self.mu:
            coord, self.coord = self.coord, None
            if coord is not None:
                self.state = ["closed"] * len(self.state)
                for req in set(self.running.values()):
                    for s in list(req.pending):
                        req.mailbox.append(("closed", s))
                self.running = {}
                self.cv.notify_all()
        return coord


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_THREADING = os.sep + "threading.py"


def without_own_threads(dump: str) -> str:
    """A rank's stack dump without the threads ddip itself runs in it (its runtime's helpers:
    collectives, heal's abort, displays), which only stand between the user and their own; a
    line says how many were left out. The thread that runs the user's code always stays."""
    blocks = dump.split("\n\n")
    kept, hidden = [], 0
    for block in blocks:
        files = [line.strip().split('"')[1] for line in block.splitlines()
                 if line.strip().startswith('File "') and line.count('"') >= 2]
        own = (block.startswith("Thread ") and files and any(f.startswith(_PACKAGE) for f in files)
               and all(f.startswith(_PACKAGE) or f.endswith(_THREADING) for f in files))
        if own:
            hidden += 1
        else:
            kept.append(block)
    text = "\n\n".join(kept)
    if hidden:
        text = text.rstrip("\n") + f"\n({hidden} of ddip's own threads not shown)\n"
    return text


_IPYTHON = os.sep + "IPython" + os.sep


def _runner_frame(line: str) -> bool:
    """A stack line of what runs the user's code, not of the code itself: ddip's worker and rank
    template (and the `<string>` that starts them), IPython's run_cell."""
    line = line.strip()
    if not line.startswith('File "') or line.count('"') < 2:
        return False
    path = line.split('"')[1]
    return path.startswith(_PACKAGE) or _IPYTHON in path or path == "<string>"


def with_own_frames_folded(dump: str) -> str:
    """A stack dump whose runs of frames of ddip and IPython (the worker loop, run_cell: a dozen
    lines under every cell) are one line each, so the user's own frames stand out."""
    out, run = [], 0
    for line in dump.split("\n"):
        if _runner_frame(line):
            run += 1
            continue
        if run:
            out.append(f"  ({run} frames of ddip and IPython)")
            run = 0
        out.append(line)
    if run:
        out.append(f"  ({run} frames of ddip and IPython)")
    return "\n".join(out)
