"""Other hosts' standing agents, kept for the kernel's life: groups across hosts lease each
host's agent (a launcher + `python -m ddip.remote`, and that host's rank template) from the one
`_core.AgentKeeper`, so the rank template outlives the group; `release_hosts()` lets them all go."""

from __future__ import annotations

import threading

from .. import _core
from ..rank.template import enabled

_lock = threading.Lock()

_keeper = None  # _core.AgentKeeper: each host's launcher + agent (and its rank template), kernel-long


def agent_keeper():
    """The kernel's standing host agents (created on first use): groups across hosts lease each
    host's agent from it, so that host's rank template outlives the group."""
    global _keeper
    with _lock:
        if _keeper is None:
            _keeper = _core.AgentKeeper()
        return _keeper


def remote_warm(warm, uses_torch: bool) -> int:
    """The tickets' `warm` for a group's other hosts: 0 cold, 1 fork when the host's rank template is
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
