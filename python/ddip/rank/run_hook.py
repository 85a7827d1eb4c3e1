"""ddip's startup hook in each Python rank of `ddip run`: when ddip run times out or is
interrupted, it sends its ranks SIGURG, and each answers with its torch flight recorder's
collectives and its main thread's Python stack, so that ddip run can say who never joined which
collective before it stops them (cpp/tools/run_collectives.hpp).

Nothing in the user's script or command line asks for it: ddip run puts a sitecustomize.py of its
own first on the rank's PYTHONPATH, with DDIP_RUN_HOOK=1, and that file loads this one by its
path and calls start() (DDIP_RUN_HOOK=0 from the user turns it off). It costs nothing measurable
at a rank's start: it imports only what Python's start has imported already, and neither torch
nor the ddip package. The rank's children (dataloader workers, subprocesses) are not hooked.

It also makes `pdb.set_trace()` prompt through ddip run as `breakpoint()` does, when
PYTHONBREAKPOINT is ddip run's (ddip.rank.run_debug), by patching pdb when it is first imported.

Loaded by path, this module uses no relative import; ddip.rank.collectives is loaded the same way
when a rank is first asked, unless the rank imported it itself.
"""

import _signal
import _thread
import os
import sys

_RECORD = "\x1eddip state"
# PYTHONBREAKPOINT as ddip run sets it (cpp/tools/run_plan.hpp's kBreakpointHook).
_BREAKPOINT_HOOK = "ddip.rank.run_debug.set_trace"


def field(text: str) -> str:
    """A text field of a record, escaped as cpp/tools/run_protocol.hpp says: one line, no
    spaces."""
    if not text:
        return "\\e"
    return text.replace("\\", "\\\\").replace(" ", "\\s").replace("\n", "\\n").replace("\r", "\\r")


def start(hook_dir: str) -> None:
    """Called by ddip run's sitecustomize.py (in `hook_dir`), in the main thread, before any
    other thread exists."""
    if os.environ.pop("DDIP_RUN_HOOK", None) != "1":
        return
    _leave_pythonpath(hook_dir)
    # Every thread started from now on inherits the mask, so SIGURG reaches only the thread
    # that waits for it. That thread blocks every other signal: Ctrl-C's SIGINT, say, must still
    # interrupt the main thread's wait, which only the thread it is delivered to sees. A child
    # forked without exec has no such thread: it gets SIGURG's default (ignored) back.
    old = _signal.pthread_sigmask(_signal.SIG_BLOCK, _signal.valid_signals())
    try:
        _thread.start_new_thread(_serve, (_thread.get_ident(),))
    finally:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, old | {_signal.SIGURG})
    os.register_at_fork(after_in_child=lambda: _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {_signal.SIGURG}))
    if os.environ.get("PYTHONBREAKPOINT") == _BREAKPOINT_HOOK:
        sys.meta_path.insert(0, _PatchPdb())


def _leave_pythonpath(hook_dir: str) -> None:
    """The rank's children find the PYTHONPATH the user gave, without the hook."""
    parts = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if hook_dir in parts:
        parts.remove(hook_dir)
    if any(parts):
        os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        os.environ.pop("PYTHONPATH", None)


def _serve(main_thread: int) -> None:
    """One record on stderr for each SIGURG, for as long as the rank runs."""
    while True:
        try:
            _signal.sigwait({_signal.SIGURG})
            record = _state(main_thread)
        except Exception:  # the interpreter is finishing, say: nothing to answer with
            return
        data = record.encode("utf-8", "replace")
        try:
            while data:
                data = data[os.write(2, data):]
        except OSError:
            return  # stderr is gone: ddip run is too


def _state(main_thread: int) -> str:
    import json
    import traceback

    try:
        # Nothing to read without torch.distributed, and nothing imported for it: a module that
        # imports threading (collectives.py does) must not be imported first on this thread, or
        # threading takes it for the main thread and the rank's exit waits for it for ever.
        if "torch.distributed" not in sys.modules or "threading" not in sys.modules:
            snapshot = {"off": "torch.distributed is not initialized"}
        else:
            snapshot = _collectives().snapshot()
    except Exception as exc:  # a torch without the recorder's reader, say: ddip run is told
        snapshot = {"off": f"the flight recorder could not be read: {type(exc).__name__}: {exc}"}
    frame = sys._current_frames().get(main_thread)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(the main thread has ended)\n"
    rank = os.environ.get("RANK", "0")
    return f"{_RECORD} {rank} {field(json.dumps(snapshot))} {field(stack)}\n"


_loaded = None


def _collectives():
    global _loaded
    module = sys.modules.get("ddip.rank.collectives")
    if module is not None:
        return module
    if _loaded is None:
        from importlib.machinery import SourceFileLoader

        module = type(sys)("_ddip_run_collectives")
        module.__file__ = os.path.join(os.path.dirname(os.path.abspath(__file__)), "collectives.py")
        SourceFileLoader(module.__name__, module.__file__).exec_module(module)
        _loaded = module
    return _loaded


def _set_trace(*, header=None, **_ignored):
    """pdb.set_trace() in a rank of ddip run: ddip.rank.run_debug's, stopping in the caller's
    frame."""
    from importlib import import_module

    module, name = _BREAKPOINT_HOOK.rsplit(".", 1)
    getattr(import_module(module), name)(header=header, frame=sys._getframe().f_back)


class _PatchPdb:
    """A finder first on sys.meta_path that finds nothing itself: when pdb is imported, it finds
    it where the standard library is and makes its set_trace ours once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "pdb":
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.set_trace = _set_trace

        spec.loader.exec_module = exec_module
        return spec
