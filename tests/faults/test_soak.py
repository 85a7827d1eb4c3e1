"""1000 cells in a row with output, pushes and pulls: open fds, threads, the process's memory
and /dev/shm stay flat. And several groups / several 'kernels' at once never collide."""

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import ddip
from conftest import PY


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _snapshot():
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
            "pythreads": threading.active_count(), "shm": sorted(os.listdir("/dev/shm")), "rss": _rss_mib()}


@pytest.mark.timeout(600)
def test_a_thousand_cells_leave_no_trace():
    small = np.arange(1000.0)
    big = np.ones(1 << 19)  # 4 MiB: through shared memory
    with ddip.Group(n=2, backend=None) as g:
        def cycle(i):
            res = g.run(f"print('cell {i}')\nimport sys; print('err {i}', file=sys.stderr)\n{i}")
            assert [r.value for r in res] == [i, i] and res[1].stdout == f"cell {i}\n"
            g.push(a=small + i, b=big if i % 10 == 0 else None)
            assert g.pull("a", rank=i % 2)[999] == 999.0 + i
        for i in range(100):  # warm-up: pools, caches, lazily created threads
            cycle(i)
        g._coord.trim_pool() if hasattr(g._coord, "trim_pool") else None
        before = _snapshot()
        for i in range(100, 1100):
            cycle(i)
        g._coord.trim_pool() if hasattr(g._coord, "trim_pool") else None
        after = _snapshot()
    assert after["fds"] == before["fds"]
    assert after["threads"] == before["threads"] and after["pythreads"] == before["pythreads"]
    assert after["shm"] == before["shm"]
    assert after["rss"] - before["rss"] < 32, f"RSS grew {after['rss'] - before['rss']:.1f} MiB"


def test_two_notebooks_at_once_do_not_collide(tmp_path):
    script = textwrap.dedent("""
        import ddip, sys
        with ddip.Group(n=2, backend="gloo") as g:
            res = g.run("import torch, torch.distributed as dist\\n"
                        "t = torch.ones(1) * (dist.get_rank() + 1)\\ndist.all_reduce(t)\\nt.item()")
            print(g._coord.socket_path, g.master_port, [r.value for r in res])
    """)
    pytest.importorskip("torch")
    procs = [subprocess.Popen([PY, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.split())
    (sock_a, port_a, *vals_a), (sock_b, port_b, *vals_b) = outs
    assert sock_a != sock_b and port_a != port_b
    assert " ".join(vals_a) == " ".join(vals_b) == "[3.0, 3.0]"
