"""The warm rank template's own process: imports what ranks need (IPython, cloudpickle, numpy,
ddip's worker, and torch by default) without touching CUDA, then forks ranks on request. In each
forked child `_become_rank()` applies the rank's environment, argv and random state, then runs the
rank's `-c` code (the ddip worker), exactly as a cold `python -c ...` would.

Started with `command()` (`python -c "import ddip.template; ddip.template.main()"`) by the
kernel's handle (ddip.kernel.template) or by a host's agent (ddip.hosts.agent). See docs/warm.md.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import os
import sys
import time

from .. import _core

# Imported by every template: what the rank's worker needs before it can serve.
BASE_MODULES = ("IPython.core.interactiveshell", "cloudpickle", "numpy", "ddip.rank.worker", "ddip.worker")
# What IPython imports only when a shell is built (its completer, inspector, magics, profile
# application): two thirds of a rank's shell-building CPU, paid here once instead of by every rank.
# Only modules, no shell: a forked rank still builds its own, as a cold one does. (A name IPython
# no longer has is skipped: the rank would import what it needs itself.)
SHELL_MODULES = ("IPython.core.completer", "IPython.core.completerlib", "IPython.core.oinspect",
                 "IPython.core.magics", "IPython.core.application", "IPython.core.crashhandler")
# torch._dynamo too: DDP's first construction in a process imports it (1 s here), which every
# rank of every group, and a rank that replaces a dead one, would otherwise pay again.
DEFAULT_MODULES = ("torch", "torch._dynamo") if importlib.util.find_spec("torch") is not None else ()

forked = False  # True in a rank forked from a template (for tests and `%makedip -v`)
serving = False  # True in the template once it waits for fork requests


def command(python: str | None = None) -> list[str]:
    """The template process's argv, the one place it is written: the public path ddip.template,
    which tools (and tests) look for in a process's command line."""
    return [python or sys.executable, "-c", "import ddip.template; ddip.template.main()"]


def enabled() -> bool:
    """Whether ranks may fork from templates at all (DDIP_PREWARM=0 says cold ranks)."""
    return os.environ.get("DDIP_PREWARM", "1").strip() != "0"


def _cuda_initialized() -> bool:
    # torch's own flag, read without initializing anything. (Tests simulate a module that
    # initializes CUDA by making this report True: see tests/test_template.py.)
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False


def _threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            names.append("?")
    return names


def main() -> None:
    """The template process (its command line: `command()`)."""
    global serving
    began = time.monotonic()
    server = _core.ForkServer(os.environ["DDIP_TEMPLATE_SOCKET"])
    wanted = [m for m in os.environ.get("DDIP_TEMPLATE_MODULES", "").split(",") if m]
    loaded, failed = [], {}
    for name in list(BASE_MODULES + SHELL_MODULES) + [m for m in wanted if m not in BASE_MODULES + SHELL_MODULES]:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - any failure is reported, never raised
            why = f"{type(exc).__name__}: {exc}"
            if name in ("IPython.core.interactiveshell", "cloudpickle", "ddip.rank.worker", "ddip.worker"):
                server.failed(json.dumps({"reason": f"importing {name} failed: {why}"}).encode())
                os._exit(1)
            if name != "numpy" and name not in SHELL_MODULES:
                failed[name] = f"import failed ({why})"
            continue
        if _cuda_initialized():
            server.failed(json.dumps({"reason": f"importing {name} initialized CUDA",
                                      "cuda_module": name}).encode())
            os._exit(0)
        loaded.append(name)
    _warm_shell_caches()
    # Some libraries start helper threads when loaded (OpenBLAS does); a fork of a multi-threaded
    # process would hold their locks. One throwaway os.fork() runs their at-fork "prepare"
    # handlers, which stop those threads until next use.
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    threads = _threads()
    if len(threads) > 1:
        server.failed(json.dumps({"reason": f"the template still has {len(threads)} threads after its "
                                            f"imports ({', '.join(threads)}); it can't be forked safely"}).encode())
        os._exit(0)
    gc.collect()
    gc.freeze()  # ranks then share these objects' pages instead of copying them on first GC
    server.ready(json.dumps({"modules": [m for m in loaded if m not in BASE_MODULES + SHELL_MODULES],
                             "failed": failed, "seconds": time.monotonic() - began}).encode())
    serving = True
    while True:
        try:
            req = server.next(-1)
        except EOFError:
            os._exit(0)  # the kernel is gone
        if req is None:
            continue
        if _cuda_initialized():
            # Never fork a process whose CUDA has started: the child's CUDA would be broken.
            server.refuse(req, "CUDA is initialized in the rank template; it was discarded")
            os._exit(0)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid, spec = server.fork(req)
        except Exception:
            continue  # the kernel was told why and starts that rank cold
        if pid == 0:
            _become_rank(*spec)


def _warm_shell_caches() -> None:
    """What a rank's shell builds the first time and keeps in module-level caches, built here once
    for every rank forked later (about 7 ms of each one's 16 ms of building its shell and running
    its first cell): the tokenizer's and IPython's input transformers' compiled regular
    expressions, and the modules its first cell imports. No shell: nothing of one is inherited."""
    try:
        import hashlib  # noqa: F401 - a cell's code name is a hash of its text
        import unicodedata  # noqa: F401

        import IPython.core.logger  # noqa: F401
        from IPython.core.inputtransformer2 import TransformerManager

        TransformerManager().transform_cell("pass\n")  # compiles tokenize's and IPython's patterns
    except Exception:  # noqa: BLE001 - an optimization: a rank builds whatever is missing itself
        pass


def _become_rank(argv, env, cwd) -> None:
    """In the forked child: become what `argv` in `env` would have started, then run it."""
    global forked, serving
    forked, serving = True, False
    gc.unfreeze()
    # The rank's own environment, in os.environ and (through putenv/unsetenv) the C environ, so
    # CUDA_VISIBLE_DEVICES and OMP_NUM_THREADS are in place before anything reads them.
    new = dict(e.split("=", 1) for e in env if "=" in e)
    env_at_start = dict(os.environ)
    for k in [k for k in os.environ if k not in new]:
        del os.environ[k]
    for k, v in new.items():
        if os.environ.get(k) != v:
            os.environ[k] = v
    sys.argv = ["-c"] + list(argv[3:])
    sys.orig_argv = list(argv)
    # Modules written since the template started (the notebook's own) must be found.
    importlib.invalidate_caches()
    for p in os.environ.get("DDIP_SYS_PATH", "").split(os.pathsep):
        if p and p not in sys.path:
            sys.path.append(p)
    _reseed()
    _apply_thread_counts(env_at_start)
    import builtins
    import types

    main_module = types.ModuleType("__main__")
    main_module.__builtins__ = builtins
    sys.modules["__main__"] = main_module
    code = 0
    try:
        exec(compile(argv[2], "<string>", "exec"), main_module.__dict__)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _reseed() -> None:
    """Fresh random state, distinct per rank, as a cold process would have: Python's and numpy's
    global generators and torch's default generator are seeded from the OS at start-up."""
    import random

    random.seed(os.urandom(32))
    if "numpy.random" in sys.modules:
        sys.modules["numpy"].random.seed()  # None: fresh entropy from the OS
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.manual_seed(int.from_bytes(os.urandom(8), "little"))


_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _apply_thread_counts(template_env: dict) -> None:
    """Thread pools size themselves from the environment when loaded, which happened in the
    template: where the rank's OMP_NUM_THREADS (or MKL_/OPENBLAS_) differs from the template's,
    resize them as a cold start with the rank's environment would have sized them."""
    changed = [k for k in _THREAD_VARS if os.environ.get(k) != template_env.get(k)]
    if not changed:
        return

    def count(*names):
        for name in names:
            try:
                n = int(os.environ.get(name, ""))
            except ValueError:
                continue
            if n > 0:
                return n
        return None

    torch = sys.modules.get("torch")
    n = count("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    if torch is not None and n is not None:
        torch.set_num_threads(n)
    n = count("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
    if n is not None and "numpy" in sys.modules:
        try:
            from threadpoolctl import threadpool_limits

            threadpool_limits(n, user_api="blas")
        except Exception:  # threadpoolctl missing: numpy's BLAS keeps the template's count
            pass
