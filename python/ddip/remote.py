"""`python -m ddip.remote`: a group's agent on another host, started there by a launcher (ssh,
srun, a template; see ddip.hosts).

It reads one line from stdin (the kernel's address, this host's index and the group's key),
connects back to the kernel, proves it knows the key and checks that the kernel does too, then
starts the ranks the kernel names and relays them (the C++ HostAgent does all of this). It exits
when they are gone: when the kernel ends the group, or when the link drops or falls silent for
DDIP_KERNEL_TIMEOUT_MS (10 s), after killing their process groups.
"""

from __future__ import annotations

import os
import signal
import socket
import sys


def main() -> int:
    # A terminal's Ctrl-C (ssh -t) must not leave ranks behind half-stopped: the link decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ticket = sys.stdin.readline()
    # The key is in memory now; stdin is left to nothing.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    from ddip import _core

    timeout_ms = int(os.environ.get("DDIP_KERNEL_TIMEOUT_MS") or 10000)
    try:
        rc, why = _core.run_host_agent(ticket, kernel_timeout_ms=timeout_ms)
    except Exception as exc:  # can't connect, or the other end does not know the key
        print(f"ddip.remote on {socket.gethostname()}: {exc}", file=sys.stderr, flush=True)
        return 2
    if rc:
        print(f"ddip.remote on {socket.gethostname()}: {why}", file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
