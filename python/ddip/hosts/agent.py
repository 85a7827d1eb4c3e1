"""A host's agent (`python -m ddip.remote`, which runs this module's main), started there by a
launcher (ssh, srun, a launcher command; see ddip.hosts.placement).

It reads a ticket line from stdin (the kernel's address, this host's index and the group's key),
connects back to the kernel, proves it knows the key and checks that the kernel does too, then
starts the ranks the kernel names and relays them (the C++ HostAgent does all of this).

A one-shot ticket (`ddip run`-style): stdin is pointed at /dev/null once it is read, and the
agent exits when its ranks are gone: when the kernel ends the group, or when the link drops or
falls silent for DDIP_KERNEL_TIMEOUT_MS (10 s), after killing their process groups.

A standing ticket (a notebook's groups): the agent stays for the kernel's life, one group per
ticket, and keeps this host's rank template (ddip.rank.template, torch preloaded, CUDA never touched)
across groups, so later groups, restarts and `%makedip -r` fork their ranks from it. End of file
on stdin (the kernel died, or let the host go: ddip.hosts.release()) stops everything under it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from .. import _core
from ..rank.template import DEFAULT_MODULES, command as rank_template_command, enabled


def command(python: str | None = None) -> list[str]:
    """The agent's argv, the one place it is written (`python -m ddip.remote`, the public path
    every launcher runs on the other host and tools look for; `python`: that host's interpreter)."""
    return [python or sys.executable, "-m", "ddip.remote"]


def main() -> int:
    # A terminal's Ctrl-C (ssh -t) must not leave ranks behind half-stopped: the link decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    timeout_ms = int(os.environ.get("DDIP_KERNEL_TIMEOUT_MS") or 10000)
    try:
        # The tickets are read from fd 0 by the C++ agent itself, never through Python's
        # buffered stdin, which could swallow the next group's ticket.
        rc, why = _core.serve_host_agent(0, host_spec(), kernel_timeout_ms=timeout_ms)
    except Exception as exc:  # can't connect, or the other end does not know the key
        print(f"ddip host agent on {socket.gethostname()}: {exc}", file=sys.stderr, flush=True)
        return 2
    if rc:
        print(f"ddip host agent on {socket.gethostname()}: {why}", file=sys.stderr, flush=True)
    return rc


def host_spec():
    """On another host, in its standing agent (`python -m ddip.remote`): how to start that host's
    rank template, as (argv, env, cwd), or None where DDIP_PREWARM=0 says cold ranks. The same
    program as the kernel's, preloading what is installed there (torch by default); the agent's
    C++ HostAgent starts it with the first group that wants warm ranks and keeps it."""
    if not enabled():
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDIP_")}
    if "OMP_NUM_THREADS" not in env:
        # Sized as the usual group's ranks there (2 per host): a fork that differs resizes.
        env["OMP_NUM_THREADS"] = str(_core.plan.omp_threads(_core.plan.cpu_count(), 2))
    env.update({"PYTHONUNBUFFERED": "1", "DDIP_TEMPLATE_MODULES": ",".join(DEFAULT_MODULES)})
    return rank_template_command(), [f"{k}={v}" for k, v in env.items()], os.getcwd()

