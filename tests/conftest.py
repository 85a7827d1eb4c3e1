import io
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

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




# `make test` runs the suite on two pytest-xdist workers (Makefile, py-test). A unit of work is a
# whole file, so its module fixtures (kernels, groups, namespace hosts) are made once, and the
# Slurm files are one unit together: one test cluster at a time. Units are handed out in the order
# below, longest first, so that neither worker is left with a long file at the end (longest
# processing time first); files not listed follow in name order. Run without xdist, the order is
# pytest's own. (xdist's own grouping, --dist loadgroup, renames node ids, which pytest 9 ignores.)
# The `ddip` launcher beside this Python (a virtual environment's bin), else the one on PATH (an
# install with pip's --target, as on the GPU machine).
DDIP = (str(Path(sys.executable).with_name("ddip")) if Path(sys.executable).with_name("ddip").exists()
        else shutil.which("ddip") or str(Path(sys.executable).with_name("ddip")))


def _torch_at_least(major: int, minor: int) -> bool:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return tuple(int(x) for x in version("torch").split(".")[:2]) >= (major, minor)
    except (PackageNotFoundError, ValueError):
        return False


# ddip run follows torch 2.13's torchrun (torch/distributed/run.py), the reference; where an older
# torchrun (the GPU machine's 2.11) differs, the tests that compare with it say so.
TORCHRUN_IS_THE_REFERENCE = _torch_at_least(2, 13)

SLURM_FILES = {"test_slurm", "test_slurm_nodes", "test_slurm_node_lost", "test_slurm_alloc"}
LONGEST_FIRST = ["test_run_nodes", "slurm", "test_browser", "test_magics", "test_heal", "test_multihost",
                 "test_docs", "test_run", "test_group", "test_debugger", "test_collectives",
                 "test_run_torchrun", "test_examples", "test_frameworks", "test_cell_messages",
                 "test_panel", "test_replace_rank", "test_template", "test_launch", "test_stragglers"]


def _unit(nodeid: str) -> str:
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return "slurm" if name in SLURM_FILES else name


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # the collection's order (LONGEST_FIRST) is the plan

        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ByUnit(config, log)


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # only in xdist's workers, which all sort alike
        return
    first = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (first.get(_unit(item.nodeid), len(first)), _unit(item.nodeid)))  # stable


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
    assert wait_until(lambda: {p for p in children_of(os.getpid()) - before if _ours(p)} == set(), 10), \
        f"leftover child processes: {describe(p for p in children_of(os.getpid()) - before if _ours(p))}"


def _ours(pid: int) -> bool:
    """Open MPI's singleton daemon (orted) is not ddip's: mpi4py starts it when a process first
    imports mpi4py.MPI (Lightning's MPIEnvironment probe does, where mpi4py is installed), and it
    lives as long as that process, here the test's own (the notebook of ranch)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() != "orted"
    except OSError:
        return True


def describe(pids) -> str:
    """Each process as `pid (state) command line`: what a leftover is, in the failure message."""
    out = []
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
        except OSError:
            state, cmd = "?", "(gone)"
        out.append(f"{pid} ({state}) {cmd}")
    return "; ".join(out)


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

