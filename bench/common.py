"""What the bench modules share (not a benchmark itself: run.py picks up bench_*.py only)."""

from __future__ import annotations

import psutil

GRACE_S = 5.0


def kill_leftovers(before: set[int], grace: float = GRACE_S) -> int:
    """Kills, by pid, every descendant of this process not in `before` that is still there after
    `grace` seconds (psutil checks the pid still names the same process); returns the count."""
    me = psutil.Process()
    left = [p for p in me.children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(left, timeout=grace) if left else ([], [])
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if alive:
        psutil.wait_procs(alive, timeout=grace)
    return len(alive)
