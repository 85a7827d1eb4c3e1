"""A ranked worker, started by a Group's Coordinator as `python -c "import ddip.worker; ..."`
(imported, not run as __main__, so rank code can `import ddip.worker` and reach this loop's state).

Runs an IPython InteractiveShell in __main__ and serves requests from the kernel until told to
shut down. stdout/stderr are pipes read by the kernel's runtime (fd level, so C libraries'
output is captured too); rich output and results travel as frames.
"""

from __future__ import annotations

import contextlib
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
from ddip.rank.displays import DisplayFrames, install_notebook_progress  # noqa: E402
from ddip.messages import RemoteValue, dumps, dumps_framed, loads, loads_framed, memfd_with  # noqa: E402

_endpoint = None  # set in main(); the display publisher sends through it
_displays = None  # DisplayFrames over _send_display, set in main()
_current_seq = 0
_busy = False
_stopping = False  # a shutdown came while a debugger's prompt waited for its answer
_prompt_lock = threading.Lock()  # one debugger prompt at a time


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
    if _displays is None:
        return
    _displays.publish(msg)


def notify(obj) -> None:
    """From code running in a rank: sends `obj` (picklable) to the kernel at once, to the
    `on_message(rank, obj)` callback of the call that is waiting on this request."""
    if _endpoint is None:
        raise RuntimeError("ddip.worker.notify() works only inside a ddip rank")
    _endpoint.send(_core.MESSAGE, _current_seq, dumps(obj))


def _release_segment(segment: int) -> None:
    # Called by a finalizer once the objects backed by a shared-memory segment are gone.
    try:
        if _endpoint is not None and not _endpoint.closed:
            _endpoint.send(_core.RELEASE, 0, struct.pack("<Q", segment))
    except Exception:
        pass


def _send_display(msg):
    if _endpoint is None:
        return
    payload = dumps(msg)  # first: a marker without its frame would hold back later output
    sys.stdout.flush()
    sys.stderr.flush()
    # Marks the display's place in the stdout text; the kernel's runtime strips it.
    os.write(1, _core.DISPLAY_MARKER)
    _endpoint.send(_core.DISPLAY, _current_seq, payload)


class RankShell(InteractiveShell):
    displayhook_class = RankDisplayHook
    display_pub_class = RankDisplayPublisher

    def _get_exc_info(self, exc_tuple=None):
        etype, value, tb = super()._get_exc_info(exc_tuple)
        tb = _users_frames(tb)
        _debugger.keep_last_exception(value, tb)  # for %dipdebug, as IPython keeps it for %debug
        return etype, value, tb

    def showtraceback(self, *args, **kwargs):
        global _busy
        _busy = False  # the user's code is over: an interrupt now must not replace its error
        super().showtraceback(*args, **kwargs)

    def _showtraceback(self, etype, evalue, stb):
        # Kept for the 'done' reply; the kernel shows it, labelled with the rank.
        self.ddip_error = {"ename": getattr(etype, "__name__", str(etype)), "evalue": str(evalue),
                           "traceback": list(stb), "exception": evalue}

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


def _format_exception(shell, exc, with_traceback=True, keep=True):
    tb = _users_frames(exc.__traceback__) if with_traceback else None
    if keep:
        _debugger.keep_last_exception(exc, tb)
    stb = shell.InteractiveTB.structured_traceback(type(exc), exc, tb)
    return {"ename": type(exc).__name__, "evalue": str(exc), "traceback": list(stb), "exception": exc}


def _reply(seq, reply):
    if "error" in reply and reply["error"] is not None:
        err = reply["error"]
        try:  # the notebook must be able to rebuild it, not only we to pickle it
            loads(dumps(err.get("exception")))
        except Exception:
            err["exception"] = None
    pack = lambda obj: dumps_framed(obj, lambda raw: (0, memfd_with(raw)), os.close)  # noqa: E731
    try:
        payload, fds = pack(reply)
    except Exception as exc:
        if reply.get("op") == "run":
            value = reply.get("value")
            reply["value"] = RemoteValue(type(value).__name__, repr(value))
            payload, fds = pack(reply)
        else:
            payload, fds = pack({"op": reply.get("op"), "value": None, "error": {
                "ename": "PicklingError",
                "evalue": f"the result could not be sent back to the notebook: {type(exc).__name__}: {exc}",
                "traceback": [], "exception": None}})
    if _displays is not None:
        _displays.flush(forget=True)  # a progress bar's last redraw, before "done"
    sys.stdout.flush()
    sys.stderr.flush()
    _core.flush_stdio()  # C extensions' printf too: "done" means the output is all in the pipe
    try:
        _endpoint.send(_core.DONE, seq, payload, fds)
    finally:
        for fd in fds:
            os.close(fd)


def _serve(shell, req):
    op = req["op"]
    if op == "run":
        shell.ddip_format = None
        shell.ddip_error = None
        cell = req.get("cell")  # (file name, first line): the cell JupyterLab's debugger sets breakpoints in
        with _dap.cell_named(shell, *cell, req["code"]) if cell else contextlib.nullcontext():
            result = shell.run_cell(req["code"], store_history=True, silent=req.get("silent", False))
        failed = result.error_before_exec is not None or result.error_in_exec is not None
        error = None
        if failed:
            error = shell.ddip_error or _format_exception(shell, result.error_before_exec or result.error_in_exec)
        fmt = shell.ddip_format
        # values=False (%%dip): only the display form travels; the object stays in the rank.
        keep = not failed and req.get("values", True)
        return {"op": op, "value": result.result if keep else None,
                "format": fmt, "error": error, "execution_count": shell.execution_count - 1}
    try:
        if op == "apply":
            return {"op": op, "value": req["fn"](*req["args"], **req["kwargs"]), "error": None}
        if op == "debug":
            return _debug(shell)
        if op == "push":
            shell.user_ns.update(req["ns"])
            return {"op": op, "value": None, "error": None}
        if op == "pull":
            rank = os.environ.get("RANK", "?")
            missing = [n for n in req["names"] if n not in shell.user_ns]
            if missing:  # no traceback: the message says it all
                err = NameError(f"name '{missing[0]}' is not defined on rank {rank}")
                return {"op": op, "value": None, "error": _format_exception(shell, err, False)}
            return {"op": op, "value": [shell.user_ns[n] for n in req["names"]], "error": None}
        raise ValueError(f"unknown request {op!r}")
    except BaseException as exc:
        global _busy
        _busy = False  # the user's code is over: an interrupt now must not replace its error
        if not isinstance(exc, (Exception, KeyboardInterrupt)):
            raise
        return {"op": op, "value": None, "error": _format_exception(shell, exc)}


def _debug(shell):
    """Post-mortem on the rank's last exception; the debugger's own end (an interrupt at its
    prompt) does not replace that exception."""
    try:
        _debugger.post_mortem()
    except _debugger.NothingToDebug as exc:
        return {"op": "debug", "value": {"nothing": str(exc)}, "error": None}
    except KeyboardInterrupt as exc:
        return {"op": "debug", "value": None, "error": _format_exception(shell, exc, False, keep=False)}
    except SystemExit:  # the group is closing (ask_kernel): nobody waits for this reply
        pass
    return {"op": "debug", "value": {"nothing": None}, "error": None}


def ask_kernel(output: str, prompt: str):
    """A debugger's prompt in this rank, answered in the notebook: `output` (what the debugger
    printed since its last prompt) and `prompt` go to the kernel as part of the request being
    run, in order with this rank's output (a display frame, so they come after what the rank
    printed before), and the line typed there comes back on this rank's endpoint. prompt=None:
    the debugger left its prompt (the kernel may ask other ranks' prompts now)."""
    global _stopping
    with _prompt_lock:
        seq = _current_seq
        if _displays is not None:
            _displays.flush()
        if prompt is None:  # it left its prompt: nothing to wait for
            _send_display({"ddip_prompt": {"output": output, "left": True}})
            return None
        _send_display({"ddip_prompt": {"output": output, "prompt": prompt}})
        while True:
            kind, got_seq, payload, fds, _ = _endpoint.recv(-1)
            for fd in fds:
                os.close(fd)
            if kind == _core.SHUTDOWN:
                _stopping = True
                raise SystemExit("the notebook closed the group while this rank was at a debugger prompt")
            if kind == _core.REQUEST and got_seq == seq:
                answer = loads(payload)
                return _debugger.STOP if answer.get("stop") else answer.get("line")


def _can_ask() -> bool:
    # Only the code a request runs, in the thread that runs it: its caller waits for the answer.
    return _busy and _endpoint is not None and threading.current_thread() is threading.main_thread()


def _on_sigint(signum, frame):
    # Ctrl-C in the notebook is forwarded here: it interrupts running code, never an idle rank.
    if _busy:
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
    signal.signal(signal.SIGINT, _on_sigint)
    shell = _make_shell()
    backend = os.environ.get("DDIP_BACKEND")
    if backend:
        _init_torch(backend)
    _connect(backend)
    kernel_gone = False
    try:
        kernel_gone = _serve_forever(shell)
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
    """The rank's endpoint to the kernel: hello, displays, stack dumps and (with torch) aborts."""
    global _endpoint, _displays
    hello = {"pid": os.getpid(), "host": socket.gethostname(), "rank": int(os.environ.get("RANK", 0)),
             "backend": backend or None, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    _endpoint = _core.Endpoint(os.environ["DDIP_SOCKET"], int(os.environ.get("DDIP_SLOT", 0)), dumps(hello))
    _collectives.serve(_endpoint, _core.COLLECTIVES)  # which collective it waits in, when asked
    _displays = DisplayFrames(_send_display)
    _debugger.install(ask_kernel, _can_ask)  # breakpoint() prompts in the notebook
    install_notebook_progress()  # only in a notebook's group (DDIP_NOTEBOOK=1)
    # Stack dumps on request, answered even while Python is stuck in C code (faulthandler's handler
    # is C-level). A real-time signal: SIGUSR1/2 are often taken (user handlers, Slurm); SIGRTMAX
    # is the runtime's kernel-death one. Code that resets every handler (Lightning's teardown)
    # would make it a kill: the endpoint raises it itself, after putting its handler back.
    stack_signal = signal.SIGRTMAX - 1
    dump_r, dump_w = os.pipe()
    os.set_blocking(dump_w, False)  # a dump nobody reads must never block the rank
    faulthandler.register(stack_signal, file=dump_w, all_threads=True, chain=False)
    _endpoint.enable_stack_dumps(stack_signal, dump_r)  # it owns dump_r; dump_w stays open for good
    if backend:  # only groups whose torch.distributed ddip set up are healed
        _heal.listen_for_abort()  # a heal can free this rank from a broken collective, even in C code
        _endpoint.enable_abort(_heal.ABORT_SIGNAL)  # asked through the endpoint, which keeps the handler


def _serve_forever(shell) -> bool:
    """Serves requests until the kernel says to stop (False) or is gone (True)."""
    while not _stopping:
        try:
            frame = _endpoint.recv(-1)
        except _core.EndpointClosed:
            return True
        kind, seq, payload, fds, truncated = frame
        if kind == _core.SHUTDOWN:
            return False
        if kind != _core.REQUEST:
            for fd in fds:
                os.close(fd)
        elif truncated:
            _refuse_truncated(seq, payload, fds)
        else:
            _serve_one(shell, seq, payload, fds)
    return False


def _refuse_truncated(seq, payload, fds):
    """Out of fds: some of the request's buffers never arrived."""
    for fd in fds:
        os.close(fd)
    try:  # the kernel holds its segments for us until we release them
        (count,) = struct.unpack_from("<I", payload)
        for segment in struct.unpack_from(f"<{2 * count}Q", payload, 4)[0::2]:
            _release_segment(segment)
    except struct.error:
        pass
    _reply(seq, {"op": "?", "value": None, "error": {
        "ename": "OSError",
        "evalue": "out of file descriptors: the request's shared-memory buffers could not "
                  "be received (raise `ulimit -n`, or close files/DataLoader workers)",
        "traceback": [], "exception": None}})


def _serve_one(shell, seq, payload, fds):
    global _current_seq, _busy
    _current_seq = seq
    try:
        _busy = True
        req = loads_framed(payload, fds, _release_segment)
        reply = _serve(shell, req)
    except KeyboardInterrupt as exc:
        reply = {"op": "?", "value": None, "error": _format_exception(shell, exc)}
    except Exception as exc:
        reply = {"op": "?", "value": None, "error": _format_exception(shell, exc)}
    finally:
        _busy = False
        req = None  # drop the request's buffers now, so their segments can be reused
    try:
        _reply(seq, reply)
    except Exception as exc:  # the reply itself failed: say so rather than go quiet
        traceback.print_exc()
        _endpoint.send(_core.DONE, seq, dumps_framed({"op": "?", "value": None, "error": {
            "ename": type(exc).__name__, "evalue": f"the reply could not be sent: {exc}",
            "traceback": [], "exception": None}}, None, None)[0])


if __name__ == "__main__":
    main()
