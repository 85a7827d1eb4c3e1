"""A ranked worker, started by a Group's Coordinator as `python -c "import ddip.worker; ..."`
(imported, not run as __main__, so rank code can `import ddip.worker` and reach this loop's state:
`current()`, the rank's `Worker`).

Runs an IPython InteractiveShell in __main__ and serves requests from the kernel until told to
shut down: each request is a record of ddip.messages (Run, Apply, Push, Pull, Debug), answered by
the Worker's method for its kind with a Done. stdout/stderr are pipes read by the kernel's
runtime (fd level, so C libraries' output is captured too); rich output and results travel as
frames.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import signal
import socket
import struct
import sys
import threading
import traceback


def _extend_sys_path():
    # The notebook's sys.path, so modules it imports by reference import here too.
    extra = os.environ.get("DDIP_SYS_PATH")
    if extra:
        for p in extra.split(os.pathsep):
            if p and p not in sys.path:
                sys.path.append(p)


_extend_sys_path()

from IPython.core.displayhook import DisplayHook  # noqa: E402
from IPython.core.displaypub import DisplayPublisher  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

from ddip import _core  # noqa: E402
from ddip.rank import collectives as _collectives  # noqa: E402
from ddip.rank import dap as _dap  # noqa: E402
from ddip.rank import debugger as _debugger  # noqa: E402
from ddip.rank import heal as _heal  # noqa: E402
from ddip.rank import plain_cells as _plain_cells  # noqa: E402
from ddip.rank.displays import DisplayFrames, install_notebook_progress  # noqa: E402
from ddip.messages import (Apply, Debug, Done, ErrorInfo, Pull, Push, RemoteValue, Run, dumps,  # noqa: E402
                           dumps_framed, loads, loads_framed, memfd_with)

_current: "Worker | None" = None  # this rank's Worker, once main() made it


def current() -> "Worker | None":
    """This rank's Worker (None before main() made it, or outside a rank)."""
    return _current


class RankDisplayHook(DisplayHook):
    """Keeps the last expression's MIME bundle for the 'done' reply instead of printing Out[n]."""

    def start_displayhook(self):
        self.shell.ddip_format = None

    def write_output_prompt(self):
        pass

    def write_format_data(self, format_dict, md_dict=None):
        self.shell.ddip_format = (format_dict, md_dict or {})

    def finish_displayhook(self):
        pass


class RankDisplayPublisher(DisplayPublisher):
    """display() in a rank becomes a display frame to the kernel (updates of one display id
    coalesced: see ddip.rank.displays)."""

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
        _publish({"data": data, "metadata": metadata or {}, "transient": transient or {},
                  "update": update})

    def clear_output(self, wait=False):
        _publish({"clear": True, "wait": wait})


def _publish(msg):
    worker = _current
    if worker is not None:
        worker.displays.publish(msg)


def notify(obj) -> None:
    """From code running in a rank: sends `obj` (picklable) to the kernel at once, to the
    `on_message(rank, obj)` callback of the call that is waiting on this request."""
    worker = _current
    if worker is None:
        raise RuntimeError("ddip.worker.notify() works only inside a ddip rank")
    worker.endpoint.send(_core.MESSAGE, worker.seq, dumps(obj))


def _release_segment(segment: int) -> None:
    # Called by a finalizer once the objects backed by a shared-memory segment are gone.
    try:
        endpoint = _current.endpoint if _current is not None else None
        if endpoint is not None and not endpoint.closed:
            endpoint.send(_core.RELEASE, 0, struct.pack("<Q", segment))
    except Exception:
        pass


class RankShell(InteractiveShell):
    displayhook_class = RankDisplayHook
    display_pub_class = RankDisplayPublisher

    def _get_exc_info(self, exc_tuple=None):
        etype, value, tb = super()._get_exc_info(exc_tuple)
        tb = _users_frames(tb)
        _debugger.keep_last_exception(value, tb)  # for %dipdebug, as IPython keeps it for %debug
        return etype, value, tb

    def showtraceback(self, *args, **kwargs):
        if _current is not None:
            _current.busy = False  # the user's code is over: an interrupt now must not replace its error
        super().showtraceback(*args, **kwargs)

    def _showtraceback(self, etype, evalue, stb):
        # Kept for the 'done' reply; the kernel shows it, labelled with the rank.
        self.ddip_error = ErrorInfo(getattr(etype, "__name__", str(etype)), str(evalue), list(stb), evalue)

    def enable_gui(self, gui=None):
        pass


_DDIP_DIR = os.path.dirname(os.path.abspath(__file__))


def _users_frames(tb):
    """The traceback without ddip's own frames around the user's code (the request dispatch
    before it, the SIGINT handler after it)."""
    ours = lambda t: t.tb_frame.f_code.co_filename.startswith(_DDIP_DIR)  # noqa: E731
    while tb is not None and ours(tb) and tb.tb_next is not None:
        tb = tb.tb_next
    frames = []
    t = tb
    while t is not None:
        frames.append(t)
        t = t.tb_next
    while len(frames) > 1 and ours(frames[-1]):
        frames.pop()
    if frames:
        frames[-1].tb_next = None
    return tb


def _format_exception(shell, exc, with_traceback=True, keep=True) -> ErrorInfo:
    tb = _users_frames(exc.__traceback__) if with_traceback else None
    if keep:
        _debugger.keep_last_exception(exc, tb)
    stb = shell.InteractiveTB.structured_traceback(type(exc), exc, tb)
    return ErrorInfo(type(exc).__name__, str(exc), list(stb), exc)


def _pack(done: Done) -> tuple[bytes, list]:
    # A reply's big buffers go in fresh memfds: the kernel's private mapping keeps their pages.
    return dumps_framed(done, lambda raw: (0, memfd_with(raw)), os.close)


class Worker:
    """The rank's side of every request: the loop that serves them and the state they share.
    Each request is a record of ddip.messages, answered by the method `handlers` names for its
    type with a Done."""

    def __init__(self, shell, endpoint):
        self.shell = shell
        self.endpoint = endpoint
        self.seq = 0  # the request being served: its display, message and prompt frames carry it
        self.busy = False  # user code runs for a request: SIGINT interrupts it (never an idle rank)
        self.interrupted = None  # the request the last SIGINT interrupted: once per request
        self.stopping = False  # a shutdown came while a debugger's prompt waited for its answer
        self.prompt_lock = threading.Lock()  # one debugger prompt at a time
        self.displays = DisplayFrames(self.send_display)
        # Cells that need none of IPython's machinery skip run_cell (None: DDIP_LEAN=0, all take it)
        self.plain = _plain_cells.PlainCells(shell) if _plain_cells.enabled() else None
        # History is off in ranks (_make_shell): what IPython queues for its database is never
        # written, and would grow by every cell's text for good.
        history = shell.history_manager
        self.unwritten = None if history.enabled else (history.db_input_cache, history.db_output_cache)
        self.handlers = {Run: self.run, Apply: self.apply, Push: self.push, Pull: self.pull, Debug: self.debug}

    # -- the loop ---------------------------------------------------------------------------------

    def serve(self) -> bool:
        """Serves requests until the kernel says to stop (False) or is gone (True)."""
        endpoint = self.endpoint
        while not self.stopping:
            try:
                kind, seq, payload, fds, truncated = endpoint.recv(-1)
            except _core.EndpointClosed:
                return True
            if kind == _core.SHUTDOWN:
                return False
            if kind != _core.REQUEST:
                for fd in fds:
                    os.close(fd)
            elif truncated:
                self.refuse_truncated(seq, payload, fds)
            else:
                self.serve_one(seq, payload, fds)
        return False

    def serve_one(self, seq, payload, fds):
        self.seq = seq
        req = None
        try:
            self.busy = True
            req = loads_framed(payload, fds, _release_segment)
            done = self.answer(req)
        except (KeyboardInterrupt, Exception) as exc:
            done = Done(error=_format_exception(self.shell, exc))
        finally:
            self.busy = False
        run = type(req) is Run
        req = None  # drop the request's buffers now, so their segments can be reused
        try:
            self.reply(seq, done, run)
        except Exception as exc:  # the reply itself failed: say so rather than go quiet
            traceback.print_exc()
            self.endpoint.send(_core.DONE, seq, dumps_framed(Done(error=ErrorInfo(
                type(exc).__name__, f"the reply could not be sent: {exc}")), None, None)[0])

    def answer(self, req) -> Done:
        """The handler of req's kind; what it raises becomes the reply's error."""
        try:
            handler = self.handlers.get(type(req))
            if handler is None:
                raise ValueError(f"unknown request {req!r}")
            return handler(req)
        except BaseException as exc:
            self.busy = False  # the user's code is over: an interrupt now must not replace its error
            if not isinstance(exc, (Exception, KeyboardInterrupt)):
                raise
            return Done(error=_format_exception(self.shell, exc))

    def refuse_truncated(self, seq, payload, fds):
        """Out of fds: some of the request's buffers never arrived."""
        for fd in fds:
            os.close(fd)
        try:  # the kernel holds its segments for us until we release them
            (count,) = struct.unpack_from("<I", payload)
            for segment in struct.unpack_from(f"<{2 * count}Q", payload, 4)[0::2]:
                _release_segment(segment)
        except struct.error:
            pass
        self.reply(seq, Done(error=ErrorInfo(
            "OSError", "out of file descriptors: the request's shared-memory buffers could not "
                       "be received (raise `ulimit -n`, or close files/DataLoader workers)")), False)

    def reply(self, seq, done: Done, run: bool):
        """Sends `done` once the request's output is all in the pipes. What can't be pickled is
        replaced: an exception the notebook could not rebuild by None, a run's value by its
        RemoteValue, any other value by a PicklingError."""
        err = done.error
        if err is not None and err.exception is not None:
            try:  # the notebook must be able to rebuild it, not only we to pickle it
                loads(dumps(err.exception))
            except Exception:
                done = dataclasses.replace(done, error=dataclasses.replace(err, exception=None))
        try:
            payload, fds = _pack(done)
        except Exception as exc:
            if run:
                value = done.value
                payload, fds = _pack(dataclasses.replace(done, value=RemoteValue(type(value).__name__, repr(value))))
            else:
                payload, fds = _pack(Done(error=ErrorInfo(
                    "PicklingError",
                    f"the result could not be sent back to the notebook: {type(exc).__name__}: {exc}")))
        self.displays.flush(forget=True)  # a progress bar's last redraw, before "done"
        sys.stdout.flush()
        sys.stderr.flush()
        _core.flush_stdio()  # C extensions' printf too: "done" means the output is all in the pipe
        try:
            self.endpoint.send(_core.DONE, seq, payload, fds)
        finally:
            for fd in fds:
                os.close(fd)

    # -- one method per request kind ------------------------------------------------------------

    def run(self, req: Run) -> Done:
        shell = self.shell
        shell.ddip_format = None
        shell.ddip_error = None
        result = count = None
        if self.plain is not None and req.cell is None:
            result = self.plain.run(req.code, req.silent)
            if result is not None:
                count = result.execution_count  # the shell's count is one past it now
        if result is None:
            # cell: (file name, first line), the cell JupyterLab's debugger sets breakpoints in
            with _dap.cell_named(shell, *req.cell, req.code) if req.cell else contextlib.nullcontext():
                result = shell.run_cell(req.code, store_history=True, silent=req.silent)
        if self.unwritten is not None:
            for queued in self.unwritten:
                queued.clear()
        failed = result.error_before_exec is not None or result.error_in_exec is not None
        error = None
        if failed:
            error = shell.ddip_error or _format_exception(shell, result.error_before_exec or result.error_in_exec)
        # values=False (%%dip): only the display form travels; the object stays in the rank.
        keep = not failed and req.values
        if count is None:
            count = shell.execution_count - 1
        return Done(result.result if keep else None, error, shell.ddip_format, count)

    def apply(self, req: Apply) -> Done:
        return Done(req.fn(*req.args, **req.kwargs))

    def push(self, req: Push) -> Done:
        self.shell.user_ns.update(req.ns)
        return Done()

    def pull(self, req: Pull) -> Done:
        ns = self.shell.user_ns
        missing = [n for n in req.names if n not in ns]
        if missing:  # no traceback: the message says it all
            err = NameError(f"name '{missing[0]}' is not defined on rank {os.environ.get('RANK', '?')}")
            return Done(error=_format_exception(self.shell, err, False))
        return Done([ns[n] for n in req.names])

    def debug(self, req: Debug) -> Done:
        """Post-mortem on the rank's last exception; the debugger's own end (an interrupt at its
        prompt) does not replace that exception."""
        try:
            _debugger.post_mortem()
        except _debugger.NothingToDebug as exc:
            return Done({"nothing": str(exc)})
        except KeyboardInterrupt as exc:
            return Done(error=_format_exception(self.shell, exc, False, keep=False))
        except SystemExit:  # the group is closing (ask_kernel): nobody waits for this reply
            pass
        return Done({"nothing": None})

    # -- what rank code reaches while a request runs --------------------------------------------

    def send_display(self, msg):
        payload = dumps(msg)  # first: a marker without its frame would hold back later output
        sys.stdout.flush()
        sys.stderr.flush()
        # Marks the display's place in the stdout text; the kernel's runtime strips it.
        os.write(1, _core.DISPLAY_MARKER)
        self.endpoint.send(_core.DISPLAY, self.seq, payload)

    def ask_kernel(self, output: str, prompt: str):
        """A debugger's prompt in this rank, answered in the notebook: `output` (what the debugger
        printed since its last prompt) and `prompt` go to the kernel as part of the request being
        run, in order with this rank's output (a display frame, so they come after what the rank
        printed before), and the line typed there (a PromptAnswer) comes back on this rank's
        endpoint. prompt=None: the debugger left its prompt (the kernel may ask other ranks'
        prompts now)."""
        with self.prompt_lock:
            seq = self.seq
            self.displays.flush()
            if prompt is None:  # it left its prompt: nothing to wait for
                self.send_display({"ddip_prompt": {"output": output, "left": True}})
                return None
            self.send_display({"ddip_prompt": {"output": output, "prompt": prompt}})
            while True:
                kind, got_seq, payload, fds, _ = self.endpoint.recv(-1)
                for fd in fds:
                    os.close(fd)
                if kind == _core.SHUTDOWN:
                    self.stopping = True
                    raise SystemExit("the notebook closed the group while this rank was at a debugger prompt")
                if kind == _core.REQUEST and got_seq == seq:
                    answer = loads(payload)
                    return _debugger.STOP if answer.stop else answer.line

    def can_ask(self) -> bool:
        # Only the code a request runs, in the thread that runs it: its caller waits for the answer.
        return self.busy and threading.current_thread() is threading.main_thread()


def _on_sigint(signum, frame):
    # Ctrl-C in the notebook is forwarded here: it interrupts running code, never an idle rank,
    # and a request once. The kernel sends it again while the rank goes on: one that reached the
    # rank before its request did (read after it) would be lost, and a later one must not cut
    # short what the request does about the first (its `except KeyboardInterrupt:`).
    worker = _current
    if worker is not None and worker.busy and worker.interrupted != worker.seq:
        worker.interrupted = worker.seq
        raise KeyboardInterrupt("interrupted from the notebook")


def _init_torch(backend: str):
    import torch

    from ddip.rank import torchdist

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torchdist.init(backend, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                   rendezvous_timeout=float(os.environ.get("DDIP_RENDEZVOUS_TIMEOUT", "60")))


def _shutdown_torch():
    from ddip.rank import torchdist

    torchdist.shutdown()


def main():
    global _current
    signal.signal(signal.SIGINT, _on_sigint)
    shell = _make_shell()
    backend = os.environ.get("DDIP_BACKEND")
    if backend:
        _init_torch(backend)
    _current = worker = Worker(shell, _connect(backend))
    _debugger.install(worker.ask_kernel, worker.can_ask)  # breakpoint() prompts in the notebook
    install_notebook_progress()  # only in a notebook's group (DDIP_NOTEBOOK=1)
    kernel_gone = False
    try:
        kernel_gone = worker.serve()
    except BaseException:
        traceback.print_exc()  # the last lines of stderr are what the notebook reports
        exit_code = 1
    else:
        exit_code = 0
    finally:
        try:
            _shutdown_torch()
        except Exception:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        _core.flush_stdio()
    if kernel_gone and os.environ.get("DDIP_KERNEL_PID") and os.getpgrp() == os.getpid():
        # The kernel died (its socket closed before its death signal reached us): what this
        # rank started must not outlive it either (the parent-death handler would do the same).
        os.killpg(0, signal.SIGKILL)
    os._exit(exit_code)


def _make_shell():
    from traitlets.config import Config

    config = Config()
    # No sqlite history file: it costs milliseconds per cell and ranks must not share one.
    config.HistoryManager.enabled = False
    shell = RankShell.instance(config=config)
    shell.ddip_format = None
    shell.ddip_error = None
    # IPython sets sys.ps1 "so that scripts can decide if they are running interactively", and
    # libraries do (Lightning refuses strategy='ddp' then); a rank is launched from outside, like
    # torchrun's, so it must not look interactive. The shell's features don't depend on these.
    for prompt in ("ps1", "ps2", "ps3"):
        if hasattr(sys, prompt):
            delattr(sys, prompt)
    # Rank code runs as the notebook's would: in __main__, with IPython's features.
    sys.modules["__main__"] = shell.user_module
    return shell


def _connect(backend):
    """The rank's endpoint to the kernel (hello, stack dumps and, with torch, aborts)."""
    hello = {"pid": os.getpid(), "host": socket.gethostname(), "rank": int(os.environ.get("RANK", 0)),
             "backend": backend or None, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    endpoint = _core.Endpoint(os.environ["DDIP_SOCKET"], int(os.environ.get("DDIP_SLOT", 0)), dumps(hello))
    _collectives.serve(endpoint, _core.COLLECTIVES)  # which collective it waits in, when asked
    # Stack dumps on request, answered even while Python is stuck in C code (faulthandler's handler
    # is C-level). A real-time signal: SIGUSR1/2 are often taken (user handlers, Slurm); SIGRTMAX
    # is the runtime's kernel-death one. Code that resets every handler (Lightning's teardown)
    # would make it a kill: the endpoint raises it itself, after putting its handler back.
    stack_signal = signal.SIGRTMAX - 1
    dump_r, dump_w = os.pipe()
    os.set_blocking(dump_w, False)  # a dump nobody reads must never block the rank
    faulthandler.register(stack_signal, file=dump_w, all_threads=True, chain=False)
    endpoint.enable_stack_dumps(stack_signal, dump_r)  # it owns dump_r; dump_w stays open for good
    if backend:  # only groups whose torch.distributed ddip set up are healed
        _heal.listen_for_abort()  # a heal can free this rank from a broken collective, even in C code
        endpoint.enable_abort(_heal.ABORT_SIGNAL)  # asked through the endpoint, which keeps the handler
    return endpoint


if __name__ == "__main__":
    main()
