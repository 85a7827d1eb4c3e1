import io
import os
import signal
import sys
import threading

import pytest

import ddip
from netns_hosts import wait_until  # noqa: F401  (one poller for the tests and the bench's hosts)

# The tests' Ctrl-C (SIGINT to this process) is a user's in a notebook: KeyboardInterrupt. A shell
# without job control starts a background `make test` with SIGINT ignored, and Python then keeps
# it ignored: those tests would wait out their ranks instead.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def children_of(pid: int) -> set[int]:
    """Live (non-zombie) direct children of `pid`, read from /proc."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == pid and not _is_rank_template(entry):
            out.add(int(entry))
    return out


def _is_rank_template(pid: str) -> bool:
    # The kernel's warm rank template (ddip.template) lives as long as the kernel, by design.
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"ddip.template.main()" in f.read()
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False




@pytest.fixture(scope="module")
def group2():
    with ddip.Group(n=2, backend=None) as g:
        yield g


@pytest.fixture(autouse=True)
def no_leftover_workers():
    """Every test leaves no worker of its own behind (module fixtures excepted)."""
    before = children_of(os.getpid())
    yield
    # Other hosts' standing agents live as long as the kernel, by design: let them go first, so
    # that what stays is a leftover (and letting go is checked to leave nothing).
    ddip.hosts.release()
    assert wait_until(lambda: children_of(os.getpid()) <= before, 10), \
        f"leftover child processes: {children_of(os.getpid()) - before}"


def render(text: str) -> list[str]:
    """Stream text as a notebook front end (or a terminal) shows it: '\\r' returns to the start of
    the line and what follows overwrites it."""
    lines, cur, col = [], [], 0
    for ch in text.replace("\r\n", "\n"):
        if ch == "\n":
            lines.append("".join(cur))
            cur, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            cur[col:col + 1] = [ch]
            col += 1
    return lines + (["".join(cur)] if cur else [])


requires_gpu = pytest.mark.skipif(ddip.kernel.group.gpu_count() == 0, reason="needs an NVIDIA GPU")
PY = sys.executable


class Tee(io.TextIOBase):
    """A stdout that keeps what was written and tells (`seen`) when every wanted text has arrived."""

    def __init__(self, *wanted):
        self.text, self.wanted, self.seen = "", wanted, threading.Event()

    def write(self, s):
        self.text += s
        if all(w in self.text for w in self.wanted):
            self.seen.set()
        return len(s)
