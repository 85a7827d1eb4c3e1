"""JupyterLab's visual debugger across ranks: the Debug Adapter Protocol (DAP) requests the
kernel receives (`debug_request` on the control channel) reach each rank's own debugpy too.

ipykernel answers them with its own debugpy, as it does without ddip; `VisualDebugger` wraps its
`do_debug_request` (nothing changes for the notebook's own cells) and adds the ranks:

- once JupyterLab has switched the debugger on, a `%%dip` cell first starts debugpy in each of
  its ranks (ddip/rank/dap.py; a rank never debugged never imports it) and connects to it, one
  `RankSession` per rank; the breakpoints JupyterLab set are sent to it, and the cell runs
  compiled as the file ipykernel's dumpCell names for the whole cell, so a breakpoint in the
  cell's gutter stops the ranks on that line;
- `threads` lists each rank's threads as "rank N: <name>"; a request for a rank's thread, frame
  or variables (`stackTrace`, `scopes`, `variables`, `evaluate`, `next`, `stepIn`, `continue`,
  ...) goes to that rank, its ids mapped both ways (`Ids`: a range of their own, above any id
  of the kernel's own debugger); `setBreakpoints` and `setExceptionBreakpoints` go to every rank;
- a rank's `stopped`, `continued`, `thread` and `output` events become the kernel's
  `debug_event`s on IOPub, their ids mapped.

`continue` for one rank's thread continues that rank; `continue` for a thread that is not
stopped (JupyterLab sends threadId 1, the kernel's, whose thread waits for the ranks) continues
every stopped rank. After one rank continues, another still stopped is announced again
(`stopped`), since JupyterLab shows one stopped thread at a time.

Ranks on other hosts are left out (their debugpy listens on their own 127.0.0.1); their
`breakpoint()` prompts under the cell as ever (ddip/kernel/debugger.py).

Why this shape: debugpy's in-process adapter in each rank plus one plain DAP connection each
(ddip/kernel/dap_session.py) adds no process that could outlive a rank, and leaves the kernel's
own debugpy and ipykernel's handling of it exactly as they are.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import itertools
import os
import sys
import threading
import time
import weakref

from ..errors import RankFailedError
from . import request as _request
from .dap_session import REPLY_S, RankSession
BASE_ID = 1 << 48  # above every id the kernel's debugpy hands out: small counters, and id() of objects
RANK_EVENTS = ("stopped", "continued", "thread", "output")
_DDIP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_installed: dict = {}  # the shell -> its VisualDebugger


class Ids:
    """Rank-side ids (threads, frames, variables) as the frontend sees them: numbers of their
    own, from BASE_ID up, both ways. Frames and variables last while their rank is stopped."""

    KINDS = ("thread", "frame", "var")

    def __init__(self):
        self._next = itertools.count(BASE_ID)
        self._out: dict[tuple, int] = {}  # (kind, rank, its id) -> ours
        self._in: dict[tuple, tuple] = {}  # (kind, ours) -> (rank, its id)

    def outward(self, kind: str, rank: int, rid: int) -> int:
        key = (kind, rank, rid)
        if key not in self._out:
            ours = next(self._next)
            self._out[key], self._in[(kind, ours)] = ours, (rank, rid)
        return self._out[key]

    def inward(self, kind: str, ours) -> tuple | None:
        return self._in.get((kind, ours)) if isinstance(ours, int) else None

    def forget(self, rank: int, kinds=("frame", "var")):
        for key in [k for k in self._out if k[1] == rank and k[0] in kinds]:
            self._in.pop((key[0], self._out.pop(key)), None)


# Which ids a request's arguments carry, by argument name.
_ARG_KINDS = {"threadId": "thread", "frameId": "frame", "srcFrameId": "frame", "variablesReference": "var"}


class VisualDebugger:
    """The kernel's debug_request handling, extended to the ranks of the %%dip cells."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.own = kernel.debugger  # ipykernel's: the notebook's own debugpy
        self._do_own = kernel.do_debug_request
        self._lock = threading.RLock()
        self._sessions: dict[int, RankSession] = {}  # by rank, of `_group`
        self._group = None  # a weakref to the group whose ranks they are
        self._breakpoints: dict[str, dict] = {}  # source path -> its last setBreakpoints arguments
        self._exception_breakpoints: dict | None = None
        self._attach_args: dict = {}
        self._ids = Ids()
        self._stops: list[tuple[int, int]] = []  # (rank, its thread id) in the order they stopped
        self._event_seq = itertools.count(1)
        self._raw_cell: str | None = None
        self._depth = 0  # cells running inside a cell
        self._told_remote: set = set()
        self._paused_total = 0.0  # seconds during which some rank was stopped, before _paused_since
        self._paused_since: float | None = None

    # -- installing ---------------------------------------------------------------------------------

    def install(self, shell):
        self.kernel.do_debug_request = self.do_debug_request  # this kernel's only: its class keeps its own
        shell.events.register("pre_run_cell", self._note_cell)
        shell.events.register("post_run_cell", self._cell_ended)
        _request.DEBUGGERS.append(self)

    def uninstall(self, shell):
        shell.events.unregister("pre_run_cell", self._note_cell)
        shell.events.unregister("post_run_cell", self._cell_ended)
        if self in _request.DEBUGGERS:
            _request.DEBUGGERS.remove(self)
        if self.kernel.__dict__.get("do_debug_request") == self.do_debug_request:
            del self.kernel.do_debug_request
        self._drop_sessions()

    def paused_s(self) -> float:
        """Seconds during which some rank was stopped in its debugpy (a cell's --timeout does not
        count them, as it does not count the time at a pdb prompt)."""
        with self._lock:
            return self._paused_total + (time.monotonic() - self._paused_since if self._paused_since else 0.0)

    def let_go(self, ranks: list[int]):
        """Before `ranks` are interrupted (the stop button, a timeout, another rank's failure).
        The interrupt lands in a stopped rank's debugpy, where it ends the wait and the cell, but
        leaves debugpy taking the rank for stopped (its other threads too): once the rank says
        it went on, it is told to continue (_on_event), which debugpy takes as a clean start."""
        with self._lock:
            for s in self._sessions.values():
                if s.rank in ranks and s.stopped:
                    s.interrupted = True

    def _note_pause(self):
        """After a rank stopped or went on (under the lock)."""
        now, stopped = time.monotonic(), any(s.stopped for s in self._sessions.values())
        if stopped and self._paused_since is None:
            self._paused_since = now
        elif not stopped and self._paused_since is not None:
            self._paused_total += now - self._paused_since
            self._paused_since = None

    def _note_cell(self, info):
        if self._depth == 0:  # not the body that %%dip --to everywhere runs here too
            self._raw_cell = info.raw_cell  # the cell as typed: what dumpCell names, %%dip line and all
        self._depth += 1

    def _cell_ended(self, result):
        self._depth = max(0, self._depth - 1)

    # -- the kernel's side of a %%dip cell (the shell's thread) ---------------------------------------

    def cell_for(self, group, code: str, ranks=None) -> tuple[str, int] | None:
        """While JupyterLab's debugger is on: the (file name, first line) the ranks compile a
        %%dip cell's `code` as, once its ranks' debugpy are started and given the breakpoints;
        None while it is off (the ranks are not touched)."""
        if not self.own.is_started:
            return None
        raw = self._raw_cell
        # The body %%dip got is the cell's end, up to the newline IPython adds to a cell.
        whole, body = (raw or "").rstrip("\n"), code.rstrip("\n")
        if raw is None or not whole.endswith(body):
            return None  # not a cell typed in the notebook (run_cell_magic from code): nothing to match
        self._attach(group, list(group.rank_ids) if ranks is None else list(ranks))
        from ipykernel.compiler import get_file_name

        return get_file_name(raw), whole[:len(whole) - len(body)].count("\n") + 1

    def _attach(self, group, ranks: list[int]):
        with self._lock:
            if self._group is None or self._group() is not group:
                self._drop_sessions()
                self._group = weakref.ref(group)
            missing = [r for r in ranks if r not in self._sessions]
        away = [r for r in missing if not group.on_this_host(r)]
        if away and id(group) not in self._told_remote:
            self._told_remote.add(id(group))
            print(f"ddip: JupyterLab's debugger covers the ranks on this machine; rank(s) "
                  f"{', '.join(map(str, away))} on other hosts run without it (a breakpoint() in "
                  f"their code prompts under the cell)", file=sys.stderr, flush=True)
        missing = [r for r in missing if r not in away]
        if not missing:
            return
        from ..rank import dap as _rank_dap

        try:
            ports = group.apply(_rank_dap.listen, ranks=missing)
        except RankFailedError as exc:
            raise RuntimeError(f"JupyterLab's debugger could not start debugpy in the ranks: {exc}") from None
        for rank, port in zip(missing, ports):
            try:
                self._connect(rank, port)
            except (OSError, TimeoutError, RuntimeError) as exc:
                raise RuntimeError(f"JupyterLab's debugger could not reach rank {rank}'s debugpy "
                                   f"(127.0.0.1:{port}): {exc}") from None

    def _connect(self, rank: int, port: int):
        """A session with rank's debugpy, configured as JupyterLab configured the kernel's."""
        session = RankSession(rank, port, self._on_event, self._on_closed)
        try:
            _ok(session.ask("initialize", {"clientID": "ddip", "adapterID": "python", "pathFormat": "path",
                                           "linesStartAt1": True, "columnsStartAt1": True}))
            # ddip's own frames (the worker's loop around the cell) are not the user's code.
            attach = dict(self._attach_args,
                          rules=[*self._attach_args.get("rules", []), {"path": _DDIP_DIR, "include": False}])
            _ok(session.ask("attach", attach))
        except BaseException:
            session.close()
            raise
        with self._lock:  # from now on every setBreakpoints reaches it, through the replay or directly
            self._sessions[rank] = session
            sent = [session.request("setBreakpoints", args) for args in self._breakpoints.values()]
            if self._exception_breakpoints is not None:
                sent.append(session.request("setExceptionBreakpoints", self._exception_breakpoints))
        for fut in sent:
            fut.result(REPLY_S)
        # Its configuration is done here, once; the frontend's configurationDone was the kernel's.
        _ok(session.ask("configurationDone"))

    def _drop_sessions(self):
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
            self._stops.clear()
            self._note_pause()
        for s in sessions:
            s.close()

    # -- requests (the kernel's control thread) -------------------------------------------------------

    async def do_debug_request(self, msg: dict) -> dict:
        try:
            return await self._handle(msg)
        except Exception as exc:  # a handler never throws: ipykernel would send no reply at all
            return _failed(msg, f"ddip: {type(exc).__name__}: {exc}")

    async def _handle(self, msg: dict) -> dict:
        cmd = msg.get("command")
        routed = self._route(msg)
        if routed is not None:
            return await self._ask_rank(msg, *routed)
        if cmd == "continue" and not self.own.stopped_threads and self._stopped_sessions():
            # JupyterLab's Continue (for thread 1, the notebook's, which waits for the ranks): it is
            # the ranks'. Not the kernel's debugpy's: a continue while nothing of its own is
            # stopped gets no answer there, and its debugger answers nothing after it.
            await self._continue_all()
            return {"type": "response", "request_seq": msg.get("seq"), "success": True, "command": cmd,
                    "body": {"allThreadsContinued": True}}
        reply = await self._do_own(msg)
        if cmd == "attach":
            # As ipykernel completed them (its debug options, and its rules that keep the kernel's
            # own modules out of stack traces and steps: the same files run the rank's cells).
            self._attach_args = {k: v for k, v in (msg.get("arguments") or {}).items()
                                 if k not in ("connect", "logToFile")}
        elif cmd == "threads":
            await self._add_threads(reply)
        elif cmd == "setBreakpoints":
            await self._fan_out(msg, "_breakpoints")
        elif cmd == "setExceptionBreakpoints":
            await self._fan_out(msg, "_exception_breakpoints")
        elif cmd == "debugInfo" and reply.get("body") is not None:
            with self._lock:
                stopped = [self._ids.outward("thread", s.rank, t) for s in self._sessions.values() for t in s.stopped]
            reply["body"]["stoppedThreads"] = list(reply["body"].get("stoppedThreads", [])) + stopped
        elif cmd == "disconnect":
            await self._disconnect_ranks()
        return reply

    def _route(self, msg: dict) -> tuple | None:
        """(session, the request in the rank's ids) when msg's arguments name a rank's thread,
        frame or variables."""
        args = msg.get("arguments") or {}
        with self._lock:
            for name, kind in _ARG_KINDS.items():
                found = self._ids.inward(kind, args.get(name))
                if found is not None:
                    rank = found[0]
                    session = self._sessions.get(rank)  # None: it ended; the reply says so
                    inner = {k: (self._ids.inward(_ARG_KINDS[k], v) or (rank, v))[1] if k in _ARG_KINDS else v
                             for k, v in args.items()}
                    return session, rank, inner
        return None

    async def _ask_rank(self, msg: dict, session, rank: int, args: dict) -> dict:
        cmd = msg["command"]
        if session is None:
            return _failed(msg, f"rank {rank}'s debugger is gone (the rank ended, or the group was closed)")
        if cmd == "richInspectVariables":
            return await self._rich_inspect(msg, session, args)
        if cmd == "copyToGlobals":
            if not (str(args.get("dstVariableName")).isidentifier() and str(args.get("srcVariableName")).isidentifier()):
                return _failed(msg, "dstVariableName and srcVariableName must be valid identifiers")
            cmd, args = "setExpression", {"expression": f"globals()['{args['dstVariableName']}']",
                                          "value": args["srcVariableName"], "frameId": args["srcFrameId"]}
        try:
            resp = await _awaited(session.request(cmd, args))
        except (ConnectionError, TimeoutError) as exc:
            return _failed(msg, str(exc))
        with self._lock:
            body = self._outward(rank, resp.get("body"))
        reply = {"type": "response", "request_seq": msg.get("seq"), "success": resp.get("success", False),
                 "command": msg["command"], "body": body if body is not None else {}}
        if "message" in resp:
            reply["message"] = resp["message"]
        if cmd == "continue":
            reply["body"]["allThreadsContinued"] = not (self.own.stopped_threads or self._stopped_sessions())
            self._announce_next_stop()
        return reply

    async def _rich_inspect(self, msg: dict, session, args: dict) -> dict:
        """ipykernel's richInspectVariables, for a rank's frame: the variable's MIME bundle."""
        name = args.get("variableName", "")
        data, metadata = {}, {}
        if name.isidentifier():
            resp = await _awaited(session.request("evaluate", {
                "expression": f"get_ipython().display_formatter.format({name})",
                "frameId": args.get("frameId"), "context": "clipboard"}))
            if resp.get("success"):
                try:
                    data, metadata = ast.literal_eval(resp["body"]["result"])
                except (ValueError, SyntaxError, TypeError):
                    pass
        return {"type": "response", "request_seq": msg.get("seq"), "success": True, "command": msg["command"],
                "body": {"data": data, "metadata": {k: v for k, v in metadata.items() if k in data}}}

    async def _add_threads(self, reply: dict):
        body = reply.setdefault("body", {})
        threads = list(body.get("threads", []))
        for session in self._live_sessions():
            try:
                resp = await _awaited(session.request("threads"))
            except (ConnectionError, TimeoutError):
                continue  # it ended meanwhile: it has no threads to show
            with self._lock:
                threads += self._outward(session.rank, resp.get("body") or {}).get("threads", [])
        body["threads"] = threads
        reply["success"] = True

    async def _fan_out(self, msg: dict, kept: str):
        args = msg.get("arguments") or {}
        with self._lock:
            if kept == "_breakpoints":
                self._breakpoints[args.get("source", {}).get("path")] = args
            else:
                self._exception_breakpoints = args
            sent = [s.request(msg["command"], args) for s in self._sessions.values()]
        for fut in sent:
            try:
                await _awaited(fut)
            except (ConnectionError, TimeoutError):
                pass  # a rank that ended has no breakpoints to keep

    async def _continue_all(self):
        with self._lock:
            # One continue a rank: debugpy resumes every thread of the rank.
            sent = [s.request("continue", {"threadId": next(iter(s.stopped))})
                    for s in self._sessions.values() if s.stopped]
        for fut in sent:
            try:
                await _awaited(fut)
            except (ConnectionError, TimeoutError):
                pass

    async def _disconnect_ranks(self):
        """The debugger was switched off: the ranks' breakpoints go, stopped ranks go on."""
        with self._lock:
            sent = [s.request("disconnect", {"restart": False, "terminateDebuggee": False})
                    for s in self._sessions.values()]
            self._breakpoints.clear()
            self._exception_breakpoints = None
        for fut in sent:
            try:
                await _awaited(fut)
            except (ConnectionError, TimeoutError):
                pass
        self._drop_sessions()

    # -- events (each session's reader thread) --------------------------------------------------------

    def _on_event(self, session: RankSession, event: dict):
        try:
            self._take_event(session, event)
        except Exception as exc:  # never into the reader: the session must go on reading
            print(f"ddip: rank {session.rank}'s debugger event {event.get('event')!r} was dropped: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def _take_event(self, session: RankSession, event: dict):
        name = event.get("event")
        if name not in RANK_EVENTS:
            return  # its process, module and initialized events are the kernel's business
        body = dict(event.get("body") or {})
        with self._lock:
            tid = body.get("threadId")
            if name == "stopped":
                body["allThreadsStopped"] = False  # the notebook and the other ranks run on
                body.setdefault("description", f"rank {session.rank}")
                session.stopped[tid] = dict(body)
                self._stops.append((session.rank, tid))
            elif name == "continued" or (name == "thread" and body.get("reason") == "exited"):
                gone = list(session.stopped) if body.get("allThreadsContinued") else [tid]
                for t in gone:
                    session.stopped.pop(t, None)
                    if (session.rank, t) in self._stops:
                        self._stops.remove((session.rank, t))
                self._ids.forget(session.rank)
                if session.interrupted and not session.stopped:
                    session.interrupted = False
                    session.request("continue", {"threadId": tid})  # its answer is not waited for
            elif name == "output" and body.get("output"):
                body["output"] = f"[rank {session.rank}] {body['output']}"
            self._note_pause()
            body = self._outward(session.rank, body)
        self._publish(name, body)

    def _on_closed(self, session: RankSession):
        with self._lock:
            if self._sessions.get(session.rank) is session:
                del self._sessions[session.rank]
            threads = [self._ids.outward("thread", session.rank, t) for t in session.stopped]
            self._stops = [s for s in self._stops if s[0] != session.rank]
            self._ids.forget(session.rank, Ids.KINDS)
            self._note_pause()
        for t in threads:
            self._publish("continued", {"threadId": t, "allThreadsContinued": False})

    def _announce_next_stop(self):
        """After a rank continued: the next rank still stopped, announced again for a frontend
        that shows one stopped thread at a time (JupyterLab)."""
        with self._lock:
            for rank, tid in self._stops:
                session = self._sessions.get(rank)
                if session is not None and tid in session.stopped:
                    body = self._outward(rank, dict(session.stopped[tid]))
                    break
            else:
                return
        self._publish("stopped", body)

    def _publish(self, name: str, body: dict):
        try:
            self.own.event_callback({"type": "event", "event": name, "body": body, "seq": next(self._event_seq)})
        except Exception as exc:  # never into the reader thread: a lost event is said, not raised
            print(f"ddip: a rank's debugger event ({name}) could not be sent to the frontend: {exc}",
                  file=sys.stderr, flush=True)

    # -- helpers --------------------------------------------------------------------------------------

    def _outward(self, rank: int, obj):
        """obj (a DAP body from `rank`) with the rank's ids as the frontend sees them."""
        if isinstance(obj, list):
            return [self._outward(rank, x) for x in obj]
        if not isinstance(obj, dict):
            return obj
        out = {}
        for k, v in obj.items():
            if k == "threads" and isinstance(v, list):
                v = [dict(t, id=self._ids.outward("thread", rank, t["id"]), name=f"rank {rank}: {t.get('name', '')}")
                     for t in v if isinstance(t, dict) and "id" in t]
            elif k == "stackFrames" and isinstance(v, list):
                v = [dict(self._outward(rank, f), id=self._ids.outward("frame", rank, f["id"]))
                     for f in v if isinstance(f, dict) and "id" in f]
            elif k in _ARG_KINDS and isinstance(v, int) and v:
                v = self._ids.outward(_ARG_KINDS[k], rank, v)
            else:
                v = self._outward(rank, v)
            out[k] = v
        return out

    def _stopped_sessions(self) -> list[RankSession]:
        with self._lock:
            return [s for s in self._sessions.values() if s.stopped]

    def _live_sessions(self) -> list[RankSession]:
        with self._lock:
            return list(self._sessions.values())


async def _awaited(fut: concurrent.futures.Future) -> dict:
    try:
        return await asyncio.wait_for(asyncio.wrap_future(fut), REPLY_S)
    except asyncio.TimeoutError:
        raise TimeoutError(f"a rank's debugger did not answer within {REPLY_S:.0f} s") from None


def _ok(resp: dict) -> dict:
    if not resp.get("success"):
        raise RuntimeError(resp.get("message") or f"{resp.get('command')} failed")
    return resp


def _failed(msg: dict, why: str) -> dict:
    return {"type": "response", "request_seq": msg.get("seq"), "success": False, "command": msg.get("command"),
            "message": why, "body": {}}


def install(shell) -> VisualDebugger | None:
    """Extends the Jupyter kernel `shell` runs in (if any, with ipykernel's debugger) to the ranks."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None or getattr(kernel, "debugger", None) is None or shell in _installed:
        return _installed.get(shell)
    visual = VisualDebugger(kernel)
    visual.install(shell)
    _installed[shell] = visual
    return visual


def uninstall(shell):
    visual = _installed.pop(shell, None)
    if visual is not None:
        visual.uninstall(shell)


def cell_for(shell, group, code: str, ranks=None) -> tuple[str, int] | None:
    """For %%dip: the (file name, first line) the ranks compile the cell as while JupyterLab's
    debugger is on; None otherwise."""
    visual = _installed.get(shell)
    return None if visual is None else visual.cell_for(group, code, ranks)
