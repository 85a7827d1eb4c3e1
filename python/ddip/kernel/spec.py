"""Where a launch's ranks run and with what, checked once: the one place that reads hosts=, gpus=,
launcher=, python=, bind=, env=, warm= and backend= for `Group` and for `ranch` (whose children are
a Group), so the same bad input gets the same error from both, before anything starts.

What differs between the two stays with each: how many ranks (Group's n=, rank_ids= and
world_size=; ranch's nprocs, which counts the notebook, and its caller_rank); each says so in
`check_hosts`, run on the parsed host list before its names are resolved.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Callable

from .. import gpus as _gpus
from ..hosts import placement as _hosts


@dataclass(frozen=True, eq=False)
class RanksSpec:
    """A launch's where and what, checked and normalized: across hosts (`layout`), or on this
    machine's GPUs in the order given (`selected`), or CPU ranks here (neither)."""

    layout: _hosts.Layout | None = None
    selected: list | None = None  # one ddip.gpus.Selected per GPU, in the order given
    env: dict = field(default_factory=dict)  # env= for the ranks, on top of what they inherit
    warm: bool | None = None  # None/True: forked from a rank template where one can be; False: cold
    backend: str | None = None  # torch.distributed's, set up in every rank; None: the user's code does it

    @property
    def gpus(self) -> list[str] | None:
        """The ranks' CUDA_VISIBLE_DEVICES entries, in order (None: CPU ranks, or across hosts)."""
        return None if self.selected is None else [s.entry for s in self.selected]

    @property
    def all_gpus(self) -> list[str]:
        """Every GPU the ranks get, on every host."""
        if self.layout is not None:
            return [g for h in self.layout.hosts for g in (h.gpus or [])]
        return self.gpus or []

    @classmethod
    def checked(cls, *, hosts=None, gpus=None, env=None, warm=None, backend=None, launcher=None, python=None,
                bind=None, launcher_env=None, check_hosts: Callable[[list], None] | None = None) -> "RanksSpec":
        """hosts=, gpus=, ... as Group and ranch take them, checked in one order (the cheap and
        local first; a host list's names are resolved last). `check_hosts(parsed)`: the caller's
        own rules for a host list (its counts), run before the names are resolved.
        `launcher_env`: the launchers' environment where it is not the notebook's (a Slurm job's)."""
        env = check_env(env)
        warm = check_warm(warm)
        layout, gpus = lay_out(hosts, gpus, launcher, python, bind, launcher_env, check_hosts)
        selected = None if gpus is None else select_gpus(gpus, env)
        spec = cls(layout=layout, selected=selected, env=env, warm=warm)
        return dataclasses.replace(spec, backend=resolve_backend(backend, spec.all_gpus))


def check_env(env) -> dict:
    if env is not None and not (isinstance(env, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("env must be a dict of strings to strings, e.g. env={'OMP_NUM_THREADS': '1'}")
    return dict(env or {})


def check_warm(warm) -> bool | None:
    if warm not in (None, True, False):
        raise ValueError(f"warm must be True (fork ranks from a rank template), False (start them cold) "
                         f"or None (warm where it can be), got {warm!r}")
    return warm


def lay_out(hosts, gpus, launcher, python, bind, launcher_env=None, check_hosts=None):
    """hosts= (see ddip.hosts), with gpus= for every host ('0,1') or per host ('node1:0,1
    node2:2,3'): ranks on several hosts, reached by `launcher` running `python` there, connecting
    back to this machine's address `bind`. Returns (the layout or None, the GPUs left for this
    machine's ranks or None)."""
    if gpus is not None and (hosts is not None or _hosts.host_qualified(gpus)):
        hosts, gpus = _hosts.with_gpus(hosts, gpus), None
    if hosts is None:
        if launcher is not None or python is not None or bind is not None:
            raise ValueError("launcher=, python= and bind= are for ranks across hosts: give hosts= too")
        return None, gpus
    if check_hosts is not None:
        # What the host list says is checked before the network is asked anything (laying it out
        # resolves the other hosts' names): a wrong list gets the same answer whether or not its
        # names resolve from here.
        check_hosts(hosts.hosts if isinstance(hosts, _hosts.Layout) else _hosts.parse_hosts(hosts))
    return _hosts.layout(hosts, launcher, python, bind, launcher_env), None


def select_gpus(gpus, env: dict) -> list:
    """gpus= ('all', '0,3', 2, [3, 2], UUIDs) -> one ddip.gpus.Selected per GPU, in order. The
    user's own CUDA_VISIBLE_DEVICES (in env=) is the list that positions refer to."""
    visible_env = env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    who = "the group's env=" if "CUDA_VISIBLE_DEVICES" in env else "the notebook"
    return _gpus.select(gpus, visible_env, _gpus.physical_gpus(), who)


def resolve_backend(backend, gpus) -> str | None:
    if backend in (None, "none", "None", False):
        return None
    if backend == "auto":
        if importlib.util.find_spec("torch") is None:
            return None
        return "nccl" if gpus else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not one of 'gloo', 'nccl', 'auto' or None")
    if backend == "nccl" and not gpus:
        raise ValueError("backend='nccl' needs GPUs: pass gpus=[...], or use backend='gloo' for CPU ranks")
    if importlib.util.find_spec("torch") is None:
        raise ValueError(f"backend={backend!r} needs PyTorch, which is not installed here")
    return backend
