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
# False: ddip run's sitecustomize loaded this file from ddip run's own installation, because this
# rank's Python cannot import ddip (installed in another environment): no prompt can open here.
IMPORTABLE = True
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
    _watch_end(os.path.dirname(os.path.abspath(hook_dir)))
    _take_store_socket()
    if os.environ.get("PYTHONBREAKPOINT") == _BREAKPOINT_HOOK:
        if not IMPORTABLE:  # breakpoint() would be skipped with only a warning: say why
            sys.breakpointhook = _no_prompt
        sys.meta_path.insert(0, _PatchPdb())


# How the rank's script ended, for ddip run (cpp/tools/run_collectives.hpp, script_status): torch
# can abort a process in Python's teardown after its script has ended (one of gloo's threads drops
# tensors once Python has begun to shut down, and the C++ runtime aborts: "terminate called
# without an active exception"). The last atexit handler, which runs once the script and every
# other handler are done and before that teardown, writes the status Python is about to exit with
# into the launch's private directory, in a file named by this process's id; ddip run reads it
# only when the rank dies of SIGABRT. Python itself still exits as it always does (open files are
# flushed, objects finalized): nothing is skipped, only the abort's status is read as the script's.
_end_dir = None
_main_thread = None
_mode = None  # "file" (python script.py) or "module" (python -m): where Python says how it ended
_exit_code = None  # the code of the last sys.exit(), exit() or quit() in the main thread
_module_end = None  # with -m: how runpy's _run_module_as_main ended (None: KeyboardInterrupt)


def _watch_end(end_dir: str) -> None:
    import atexit

    global _end_dir, _main_thread, _mode
    _end_dir, _main_thread = end_dir, _thread.get_ident()
    _mode = {"-c": None, "-m": "module", "": None}.get(sys.argv[0] if sys.argv else "", "file")
    if _mode is None:
        return  # python -c, or a prompt: nothing says how it ended
    # Registered before the script runs, so it runs after every handler the script registers.
    atexit.register(_write_end)
    os.register_at_fork(after_in_child=_forget_end)
    sys.exit = _exiting(sys.exit)
    import builtins

    for name in ("exit", "quit"):  # site's Quitter objects, which raise SystemExit themselves
        if hasattr(builtins, name):
            setattr(builtins, name, _exiting(getattr(builtins, name)))
    if _mode == "module":
        import runpy

        runpy._run_module_as_main = _run_module(runpy._run_module_as_main)


def _forget_end() -> None:
    """A child forked without exec is not the rank: its end says nothing of the script's."""
    global _end_dir
    _end_dir = None


def _code(code) -> int:
    """The exit status Python makes of SystemExit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


def _exiting(exit):
    def exiting(*args, **kwargs):
        global _exit_code
        if _thread.get_ident() == _main_thread:
            _exit_code = _code(args[0] if args else kwargs.get("status", kwargs.get("code")))
        return exit(*args, **kwargs)

    exiting.__wrapped__ = exit
    exiting.__name__ = exiting.__qualname__ = getattr(exit, "__name__", "exit")
    exiting.__doc__ = getattr(exit, "__doc__", None)
    return exiting


def _run_module(run):
    def _run_module_as_main(*args, **kwargs):
        global _module_end
        try:
            result = run(*args, **kwargs)
        except SystemExit as exc:
            _module_end = _code(exc.code)
            exc.__traceback__ = exc.__traceback__.tb_next  # the report shows runpy's frames only
            raise
        except KeyboardInterrupt as exc:  # Python ends by SIGINT: nothing to say
            exc.__traceback__ = exc.__traceback__.tb_next
            raise
        except BaseException as exc:
            _module_end = 1
            exc.__traceback__ = exc.__traceback__.tb_next
            raise
        _module_end = 0
        return result

    return _run_module_as_main


def _script_status():
    """The status Python exits with, where the rank can know it; None where it can't."""
    if _mode == "module":
        return _module_end
    main = sys.modules.get("__main__")
    if main is None:
        return None
    # Python deletes __main__.__file__ once the file has run to its end or to an exception it
    # reported (setting sys.last_type); a SystemExit leaves it, as Python exits from inside.
    if "__file__" not in vars(main):
        last = getattr(sys, "last_type", None)
        if last is None:
            return 0
        return None if issubclass(last, KeyboardInterrupt) else 1
    # A SystemExit: its code when sys.exit(), exit() or quit() raised it; `raise SystemExit(n)`
    # itself can't be seen.
    return _exit_code


def _write_end() -> None:
    status = _script_status() if _end_dir else None
    if status is None:
        return
    try:
        path = os.path.join(_end_dir, f"ended.{os.getpid()}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, str(status).encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # ddip run then reads an abort as what it is


# Rank 0's TCPStore socket (cpp/tools/run_collectives.hpp, with_store_socket): ddip run made it
# listen at MASTER_PORT before any rank started, so the other ranks' store clients connect at once
# instead of being refused and backing off. init_process_group makes its server here through
# torch.distributed.rendezvous._create_c10d_store, which is wrapped to hand it the socket.
_store_fd = None
_store_port = None


def _take_store_socket() -> None:
    global _store_fd, _store_port
    fd = os.environ.pop("DDIP_STORE_FD", None)
    if fd is None:
        return
    try:
        _store_fd, _store_port = int(fd), int(os.environ["MASTER_PORT"])
        os.set_inheritable(_store_fd, False)  # the rank's subprocesses don't hold the port
    except (KeyError, ValueError, OSError):
        _store_fd = None
        return
    os.register_at_fork(after_in_child=_drop_store_socket)
    sys.meta_path.insert(0, _PatchModule("torch.distributed.rendezvous", _patch_rendezvous))


def _drop_store_socket() -> None:
    """A forked child serves no store: the socket is its parent's."""
    global _store_fd
    if _store_fd is not None:
        try:
            os.close(_store_fd)
        except OSError:
            pass
        _store_fd = None


def _patch_rendezvous(module) -> None:
    create = getattr(module, "_create_c10d_store", None)
    if create is None:  # another torch: its own store as before; the socket must not hold the port
        _drop_store_socket()
        return

    def _create_c10d_store(hostname, port, rank, world_size, timeout, *args, **kwargs):
        global _store_fd
        fd = _store_fd
        if fd is None or rank != 0 or port != _store_port or module._torchelastic_use_agent_store():
            return create(hostname, port, rank, world_size, timeout, *args, **kwargs)
        _store_fd = None
        use_libuv = kwargs.get("use_libuv", args[0] if args else True)
        try:
            # As torch makes it (rendezvous.py), on the socket that listens already.
            return module.TCPStore(host_name=hostname, port=port, world_size=world_size, is_master=True,
                                   timeout=timeout, multi_tenant=True, use_libuv=use_libuv,
                                   master_listen_fd=fd)
        except TypeError:  # a torch whose TCPStore takes no master_listen_fd: its own, as before
            os.close(fd)
            return create(hostname, port, rank, world_size, timeout, *args, **kwargs)

    module._create_c10d_store = _create_c10d_store


class _PatchModule:
    """A finder first on sys.meta_path that finds nothing itself: when `name` is imported, it finds
    it as the rest of sys.meta_path would and calls `patch` on the module once it has run."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        try:
            from importlib.util import find_spec

            spec = find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        sys.meta_path.remove(self)  # found once: later imports pass it by
        run, patch = spec.loader.exec_module, self.patch

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


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
            snapshot = {"outside": "uninitialized"}
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


def _no_prompt(*_args, **_kwargs):
    """breakpoint() or pdb.set_trace() in a rank whose Python has no ddip: says so, and goes on."""
    rank = os.environ.get("RANK", "?")
    text = (f"ddip run: rank {rank} reached a breakpoint but cannot stop there: its Python "
            f"({sys.executable}) cannot import ddip, which ddip run's prompts need. Install ddip "
            f"in that environment ({sys.executable} -m pip install ddip), or set "
            f"PYTHONBREAKPOINT=0 to pass breakpoints by. Going on.\n")
    try:
        sys.stderr.flush()
        os.write(2, text.encode(errors="replace"))
    except (OSError, ValueError):
        pass


def _set_trace(*, header=None, **_ignored):
    """pdb.set_trace() in a rank of ddip run: ddip.rank.run_debug's, stopping in the caller's
    frame."""
    from importlib import import_module

    if not IMPORTABLE:
        return _no_prompt()
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
