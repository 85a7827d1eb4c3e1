"""The warm rank template: one process per kernel that has imported what ranks need (IPython,
cloudpickle, numpy, ddip.worker, and torch by default) without touching CUDA, and forks ranks on
request. A forked rank starts in milliseconds instead of importing torch again.

Kernel side: `prewarm()` starts it (in the background); `Group` asks `choose()` for it, and the
C++ Coordinator forks each rank from it (`_core.RankTemplate`); `status()` says in one line where
it stands. Template side: `main()` imports, checks, and serves fork requests; in each forked
child `_become_rank()` applies the rank's environment, argv and random state, then runs the
rank's `-c` code (the ddip worker), exactly as a cold `python -c ...` would.

See docs/warm.md.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import os
import sys
import threading
import time

from . import _core

# Imported by every template: what ddip.worker needs before it can serve.
BASE_MODULES = ("IPython.core.interactiveshell", "cloudpickle", "numpy", "ddip.worker")
DEFAULT_MODULES = ("torch",) if importlib.util.find_spec("torch") is not None else ()
# How long a group waits for a template that is still importing, at most: cold ranks would
# import the same modules from scratch on the same cores, so waiting is rarely slower.
MAX_WAIT_S = 60.0

forked = False  # True in a rank forked from a template (for tests and `%makedip -v`)
serving = False  # True in the template once it waits for fork requests

_lock = threading.RLock()
_handle = None  # _core.RankTemplate: one per kernel, reused for every group and launch
_modules: tuple = ()  # what the current template was asked to preload
_excluded: dict = {}  # module -> why it is left out of the template (it initializes CUDA)
_disabled: str | None = None  # why ddip stopped using templates in this kernel, if it did
_said: set = set()


def enabled() -> bool:
    return os.environ.get("DDIP_PREWARM", "1").strip() != "0"


def prewarm(modules=None) -> None:
    """Starts the kernel's rank template in the background (or restarts it with other modules):
    ranks of later groups and launches are forked from it, with `modules` already imported.

        ddip.prewarm()                                  # torch (when installed)
        ddip.prewarm(modules=("torch", "fastai.learner"))

    Modules that initialize CUDA when imported are left out (ranks import them themselves)."""
    global _disabled
    if modules is None:
        modules = DEFAULT_MODULES
    elif isinstance(modules, str):
        modules = (modules,)
    modules = tuple(modules)
    bad = [m for m in modules if not (isinstance(m, str) and m and all(p.isidentifier() for p in m.split(".")))]
    if bad:
        raise ValueError(f"modules must be module names like 'torch' or 'fastai.learner', got {bad!r}")
    if not enabled():
        return
    with _lock:
        _disabled = None
        same = tuple(m for m in modules if m not in _excluded) == _modules
        if same and _handle is not None and _handle.status()[0] in ("starting", "ready"):
            return  # already there (or on its way): %load_ext after prewarm() restarts nothing
        _start(modules)


def status() -> str:
    """Where the rank template stands, in one line (for logs and `%makedip -v`)."""
    if not enabled():
        return "rank template: off (DDIP_PREWARM=0); ranks start cold"
    with _lock:
        if _disabled:
            return f"rank template: off ({_disabled}); ranks start cold"
        if _handle is None:
            return "rank template: not started (it starts with %load_ext ddip, ddip.prewarm() or the first group)"
        state, pid, detail = _handle.status()
        mods = ", ".join(_modules) or "no extra modules"
        if state == "starting":
            return f"rank template: importing {mods} (pid {pid}, {time.monotonic() - _started_at:.1f} s so far)"
        if state == "ready":
            info = _info(detail)
            line = f"rank template: ready (pid {pid}; preloaded {', '.join(info.get('modules', [])) or 'nothing'}"
            line += f" in {info.get('seconds', 0):.1f} s)"
            for name, why in {**_excluded, **info.get("failed", {})}.items():
                line += f"; {name} left out: {why}"
            return line
        return f"rank template: {state}: {_reason(state, detail)}; ranks start cold"


def choose(specs, warm=None, timeout: float = MAX_WAIT_S, wait: bool = True):
    """The template the Coordinator should fork `specs` from, or None for cold ranks (having said
    why once, unless the caller chose cold). Starts or replaces the template as needed. `wait`:
    whether ranks would use what a template still starting imports; if not, they start cold at
    once (cold ranks are ready in a fraction of a second) and the template goes on for later ones."""
    global _disabled
    if warm is False or not enabled() or not specs:
        return None
    with _lock:
        if _disabled:
            _say_once(f"ranks start cold: {_disabled}")
            return None
        why = _unforkable(specs)
        if why:
            _say_once(f"ranks start cold: {why}")
            return None
        if _handle is None:
            # Started here and waited for: one template importing torch costs the cores less
            # than n cold ranks each importing it, and every later group reuses it.
            _start(DEFAULT_MODULES)
        for _ in range(len(_modules) + 2):  # each round excludes a module or ends
            state, pid, detail = _handle.status()
            if state == "starting" and not wait:
                return None
            if state == "starting":
                state, pid, detail = _handle.wait_ready(min(timeout, MAX_WAIT_S) * 1000)
            if state == "ready":
                return _handle
            if state == "starting":
                _say_once(f"ranks start cold: the rank template is still importing "
                          f"{', '.join(_modules)} after {min(timeout, MAX_WAIT_S):g} s")
                return None
            info = _info(detail)
            if state == "failed" and info.get("cuda_module"):
                name = info["cuda_module"]
                _excluded[name] = "it initializes CUDA on import (ranks import it themselves)"
                _say_once(f"{name} initializes CUDA on import, so the rank template leaves it out; "
                          f"ranks import it themselves")
                _start(_modules)
                continue
            if state == "failed":
                _disabled = f"the rank template failed: {_reason(state, detail)}"
                _say_once(f"ranks start cold: {_disabled}")
                return None
            # Dead (killed, crashed, or discarded): replace it transparently, and say so.
            _say_once(f"the rank template had stopped ({_reason(state, detail)}); started a new one")
            _start(_modules)
        return None


def after_start(template, refusals_before: int) -> None:
    """Called once a group started with `template`: says why, if some ranks had to start cold."""
    if template is None or template.refusals == refusals_before:
        return
    global _disabled
    state, _pid, detail = template.status()
    # The first refusal is the cause; later ones only say the template was gone by then.
    why = _reason(state, detail) if state in ("dead", "failed") else template.last_error
    if "CUDA" in why:
        with _lock:
            _disabled = "CUDA was found initialized in the rank template; ddip.prewarm() tries again"
    _say_once(f"some ranks started cold: {why}")


# -- kernel side: the handle ----------------------------------------------------------------------


def _start(modules) -> None:
    global _handle, _modules, _started_at
    modules = tuple(m for m in modules if m not in _excluded)
    if _handle is None:
        _handle = _core.RankTemplate()
    env = dict(os.environ)
    for k in ("DDIP_SOCKET", "DDIP_SLOT", "DDIP_BACKEND", "DDIP_TEMPLATE_SOCKET"):
        env.pop(k, None)
    if "OMP_NUM_THREADS" not in env:
        # Sized as the usual group's ranks will be (one per GPU, else 2): a fork whose thread
        # counts differ from the template's must resize its pools, ~20 ms per rank.
        env["OMP_NUM_THREADS"] = str(_usual_rank_threads())
    env.update({"PYTHONUNBUFFERED": "1", "DDIP_TEMPLATE_MODULES": ",".join(modules),
                "DDIP_SYS_PATH": os.pathsep.join(p for p in sys.path if p)})
    argv = [sys.executable, "-c", "import ddip.template; ddip.template.main()"]
    _handle.start(argv, [f"{k}={v}" for k, v in env.items()], os.getcwd())
    _modules = modules
    _started_at = time.monotonic()


_started_at = 0.0


# -- kernel side: other hosts' standing agents ----------------------------------------------------

_keeper = None  # _core.AgentKeeper: each host's launcher + agent (and its template), kernel-long


def agent_keeper():
    """The kernel's standing host agents (created on first use): groups across hosts lease each
    host's agent from it, so that host's rank template outlives the group."""
    global _keeper
    with _lock:
        if _keeper is None:
            _keeper = _core.AgentKeeper()
        return _keeper


def remote_warm(warm, uses_torch: bool) -> int:
    """The tickets' `warm` for a group's other hosts: 0 cold, 1 fork when the host's template is
    ready, 2 wait for it while it imports (the ranks will use torch)."""
    if warm is False or not enabled():
        return 0
    return 2 if uses_torch else 1


def release_hosts(timeout: float = 5.0) -> int:
    """Lets every other host go: each idle standing agent stops its rank template and exits now,
    one serving a group when that group ends. The next group there starts a new agent (and pays
    its imports again). Returns how many were idle."""
    with _lock:
        keeper = _keeper
    if keeper is None:
        return 0
    return keeper.release(int(timeout * 1000))


def host_spec():
    """On another host, in its standing agent (`python -m ddip.remote`): how to start that host's
    rank template, as (argv, env, cwd), or None where DDIP_PREWARM=0 says cold ranks. The same
    program as the kernel's, preloading what is installed there (torch by default); the agent's
    C++ HostAgent starts it with the first group that wants warm ranks and keeps it."""
    if not enabled():
        return None
    from . import _core

    env = {k: v for k, v in os.environ.items() if not k.startswith("DDIP_")}
    if "OMP_NUM_THREADS" not in env:
        # Sized as the usual group's ranks there (2 per host): a fork that differs resizes.
        env["OMP_NUM_THREADS"] = str(_core.plan.omp_threads(_core.plan.cpu_count(), 2))
    env.update({"PYTHONUNBUFFERED": "1", "DDIP_TEMPLATE_MODULES": ",".join(DEFAULT_MODULES)})
    argv = [sys.executable, "-c", "import ddip.template; ddip.template.main()"]
    return argv, [f"{k}={v}" for k, v in env.items()], os.getcwd()


def _usual_rank_threads() -> int:
    from . import _core
    from .group import omp_threads

    plan = _core.plan
    gpus = len(plan.visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), plan.nvidia_device_count()))
    return omp_threads(gpus if gpus > 0 else 2)


def _info(detail: bytes) -> dict:
    try:
        info = json.loads(detail.decode())
        return info if isinstance(info, dict) else {}
    except (ValueError, UnicodeDecodeError):
        return {}


def _reason(state: str, detail: bytes) -> str:
    info = _info(detail)
    text = info.get("reason") if info else detail.decode(errors="replace")
    return (text or state).strip().replace("\n", " | ")


def _say_once(text: str) -> None:
    if text in _said:
        return
    _said.add(text)
    print(f"ddip: {text}", file=sys.stderr, flush=True)


def _unforkable(specs) -> str | None:
    """Why these ranks can't be forks of the template, or None (the runtime's rule, which a
    host's agent applies to its own template too)."""
    argv = [sys.executable, "-c", ""]
    env = [f"{k}={v}" for k, v in os.environ.items()] + ["PYTHONUNBUFFERED=1"]
    for rank_argv, rank_env, _cwd in specs:
        why = _core.unforkable(argv, env, list(rank_argv), list(rank_env))
        if why:
            return why
    return None


# -- template side --------------------------------------------------------------------------------


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
    """The template process: `python -c "import ddip.template; ddip.template.main()"`."""
    global serving
    began = time.monotonic()
    server = _core.ForkServer(os.environ["DDIP_TEMPLATE_SOCKET"])
    wanted = [m for m in os.environ.get("DDIP_TEMPLATE_MODULES", "").split(",") if m]
    loaded, failed = [], {}
    for name in list(BASE_MODULES) + [m for m in wanted if m not in BASE_MODULES]:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - any failure is reported, never raised
            why = f"{type(exc).__name__}: {exc}"
            if name in ("IPython.core.interactiveshell", "cloudpickle", "ddip.worker"):
                server.failed(json.dumps({"reason": f"importing {name} failed: {why}"}).encode())
                os._exit(1)
            if name != "numpy":
                failed[name] = f"import failed ({why})"
            continue
        if _cuda_initialized():
            server.failed(json.dumps({"reason": f"importing {name} initialized CUDA",
                                      "cuda_module": name}).encode())
            os._exit(0)
        loaded.append(name)
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
    server.ready(json.dumps({"modules": [m for m in loaded if m not in BASE_MODULES],
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
