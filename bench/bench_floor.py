"""What a trivial request to N ranks costs on this machine with nothing of ddip's in the way:
the floor under `run("pass")` (issue 34's round trip at 128 ranks).

    .venv/bin/python bench/run.py floor      (long: not in a plain `make bench`)

Three rows at N = 2, 8, 32 and 128 processes, all on this host, each a round trip: one message to
every process and every answer back, medians over rounds.
- **bare Python**: N forked Python processes, each woken by one byte on a Unix socket, runs
  `exec` of a compiled `pass` and answers one byte. No IPython, no pickling, no runtime: the
  machine's floor for N Python processes that each do something.
- **IPython's cell, no runtime**: the same, but each process runs the cell as a rank does (an
  IPython shell and ddip's lean path, `PlainCells.run("pass")`: the execution count, `In`, the
  history, events), and pickles a reply. What the rank's Python does per request, without ddip's
  messaging.
- **ddip**: a Group of N ranks (`backend=None`), `g.run("pass")`.

On 2 cores the first two rows show how much of ddip's time at 128 ranks is the ranks' Python
itself, cold in cache as 128 processes take turns.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import statistics
import sys
import time

from common import close_group, ms

LONG = True
SIZES = (2, 8, 32, 128)
ROUNDS = 5
REQS = 200  # round trips per round
WARMUP = 50


def _log(msg: str):
    print(f"[bench_floor] {msg}", file=sys.stderr, flush=True)


def _median_round(once) -> float:
    """once() WARMUP times, then ROUNDS rounds of REQS: the median round's time per call (s)."""
    for _ in range(WARMUP):
        once()
    rounds = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(REQS):
            once()
        rounds.append((time.perf_counter() - t0) / REQS)
    return statistics.median(rounds)


def _child(sock: socket.socket, kind: str):
    try:
        if kind == "bare":
            code, ns = compile("pass", "<cell>", "exec"), {}

            def step():
                exec(code, ns)
        else:
            import pickle

            from IPython.core.interactiveshell import InteractiveShell

            from ddip.rank.plain_cells import PlainCells

            shell = InteractiveShell.instance()
            shell.history_manager.enabled = False  # as a rank's
            cells = PlainCells(shell)

            def step():
                result = cells.run("pass")
                pickle.dumps((None, result.execution_count))
        step()
        sock.send(b"r")  # ready
        while sock.recv(64):
            step()
            sock.send(b"k")
    finally:
        os._exit(0)


def _processes(n: int, kind: str) -> float:
    """Median round trip (s) to n forked processes of `kind`."""
    socks, pids = [], []
    try:
        for _ in range(n):
            parent, child = socket.socketpair()
            pid = os.fork()
            if pid == 0:
                for s in socks + [parent]:  # only its own end: the others' ends close with theirs
                    s.close()
                _child(child, kind)
            child.close()
            socks.append(parent)
            pids.append(pid)
        poller = select.epoll()
        for s in socks:
            poller.register(s.fileno(), select.EPOLLIN)

        def collect():
            left = n
            while left:
                for fd, _ in poller.poll():
                    os.read(fd, 64)
                    left -= 1

        collect()  # every one ready

        def once():
            for s in socks:
                s.send(b"q")
            collect()

        try:
            return _median_round(once)
        finally:
            poller.close()
    finally:
        for s in socks:
            s.close()  # each child's recv sees the end and exits
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _ddip(n: int) -> float:
    import ddip

    g = ddip.Group(n=n, backend=None)
    try:
        return _median_round(lambda: g.run("pass"))
    finally:
        close_group(g)


def main() -> str:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    rows = {"bare Python (`exec`, one byte back)": {}, "IPython's cell, no runtime (`PlainCells`, a pickled reply)": {},
            "ddip `run(\"pass\")`": {}}
    names = list(rows)
    load = []
    for n in SIZES:  # the forks first, from a process with no group's threads yet
        _log(f"N={n}: bare Python, IPython's cell")
        rows[names[0]][n] = _processes(n, "bare")
        rows[names[1]][n] = _processes(n, "ipython")
    for n in SIZES:
        _log(f"N={n}: ddip")
        rows[names[2]][n] = _ddip(n)
        load.append(os.getloadavg()[0])
    head = "| round trip, one host | " + " | ".join(f"N={n}" for n in SIZES) + " |"
    lines = [head, "|---" * (len(SIZES) + 1) + "|"]
    for name, by_n in rows.items():
        lines.append(f"| {name} | " + " | ".join(ms(by_n[n]) for n in SIZES) + " |")
    lines.append("| load average (1 min) after ddip's | " + " | ".join(f"{x:.1f}" for x in load) + " |")
    return (f"Medians of {ROUNDS} rounds of {REQS} round trips, after {WARMUP}; {os.cpu_count()} cores.\n\n"
            + "\n".join(lines) + "\n")


if __name__ == "__main__":
    print(main())
