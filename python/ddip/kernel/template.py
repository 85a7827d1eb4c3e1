"""The kernel's side of the warm rank template: one template process per kernel that has
imported what ranks need (IPython, cloudpickle, numpy, ddip's worker, and torch by default)
without touching CUDA, and forks ranks on request. A forked rank starts in milliseconds instead
of importing torch again.

`prewarm()` starts it (in the background); `Group` asks `choose()` for it, and the C++
Coordinator forks each rank from it (`_core.RankTemplate`); `status()` says in one line where it
stands. The template process itself is ddip.rank.template. See docs/warm.md.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from .. import _core
from ..hosts.placement import omp_threads
from ..rank.template import DEFAULT_MODULES, command, enabled

# How long a group waits for a template that is still importing, at most: cold ranks would
# import the same modules from scratch on the same cores, so waiting is rarely slower.
MAX_WAIT_S = 60.0

_lock = threading.RLock()
_handle = None  # _core.RankTemplate: one per kernel, reused for every group and launch
_modules: tuple = ()  # what the current template was asked to preload
_excluded: dict = {}  # module -> why it is left out of the template (it initializes CUDA)
_disabled: str | None = None  # why ddip stopped using templates in this kernel, if it did
_said: set = set()
_hosts: dict = {}  # another host -> what its agent said at its last group start (after_start_on_hosts)


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
    """Where the rank template stands, in one line (for logs and `%makedip -v`); then, for each
    other host whose ranks started cold at its last group start, why (its agent's words)."""
    line = _here()
    with _lock:
        for host, texts in _hosts.items():
            line += "".join(f"; host {host}: {text}" for text in texts)
    return line


def _here() -> str:
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


def after_start_on_hosts(hosts, notes) -> None:
    """Called once a group across `hosts` (other hosts' names) started, or failed to: says what
    their agents said about their own rank templates, `notes` as (host, text) (why that host's
    ranks start cold: each takes seconds more), once per group start and host, and keeps it for
    status() until the host's next group start."""
    with _lock:
        for host in hosts:
            _hosts.pop(host, None)
        for host, text in notes:
            _hosts.setdefault(host, []).append(text)
    for host, text in notes:
        print(f"ddip: host {host}: {text}", file=sys.stderr, flush=True)


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
    _handle.start(command(), [f"{k}={v}" for k, v in env.items()], os.getcwd())
    _modules = modules
    _started_at = time.monotonic()


_started_at = 0.0


def _usual_rank_threads() -> int:
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
