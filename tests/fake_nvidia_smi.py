"""GPUs for tests on a machine without any: an `nvidia-smi` on PATH that lists them.

CUDA_VISIBLE_DEVICES can only hide GPUs a machine has, so a test that checks which GPU each rank
is given (positions in the visible list, the order kept) needs GPUs to be there. ddip learns the
machine's GPUs from the driver's list in /proc, or, where /proc has none, from `nvidia-smi` (the
notebook asks `--query-gpu=...` for UUIDs, the launch plan `-L` for a count): this stands in for
that program, so every way in (Group, ranch, %makedip, `ddip run`) sees the same GPUs. Nothing in
a rank touches CUDA in these tests. Use the `fake_gpus` fixture: `fake_gpus(8)`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import ddip.gpus

SCRIPT = """#!/bin/sh
# nvidia-smi as a machine with {n} GPUs would answer (tests only); apps.csv: the processes on them.
n={n}
i=0
case "$1" in
  -L)
    while [ $i -lt $n ]; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-${{i}}aaa${{i}})"; i=$((i+1)); done ;;
  --query-gpu=uuid,utilization.gpu)
    while [ $i -lt $n ]; do echo "GPU-${{i}}aaa${{i}}, $((i*10+37))"; i=$((i+1)); done ;;
  --query-gpu=*)
    while [ $i -lt $n ]; do echo "$i, GPU-${{i}}aaa${{i}}, NVIDIA H100 80GB HBM3, 81559"; i=$((i+1)); done ;;
  --query-compute-apps=*)  # the processes a test put on the GPUs: apps.csv beside this script
    apps="$(dirname "$0")/apps.csv"; if [ -f "$apps" ]; then cat "$apps"; fi ;;
  *) echo "fake nvidia-smi: $* is not answered here" >&2; exit 2 ;;
esac
"""


@pytest.fixture
def fake_gpus(tmp_path, monkeypatch):
    """fake_gpus(n): from now on, for this process and what it starts, the machine has n GPUs
    (UUIDs GPU-0aaa0, GPU-1aaa1, ...; GPU i is 10*i+37% busy); returns the folder of the stand-in, where
    an apps.csv ('PID, GPU-UUID, MIB' lines) lists the processes on the GPUs. Skips where the driver lists real ones in /proc: those
    are the machine's, whatever nvidia-smi says."""
    if Path("/proc/driver/nvidia/gpus").exists():
        pytest.skip("this machine's driver lists its own GPUs")

    def install(n: int) -> str:
        bin_dir = tmp_path / "fake-nvidia-smi"
        bin_dir.mkdir(exist_ok=True)
        smi = bin_dir / "nvidia-smi"
        smi.write_text(SCRIPT.format(n=n))
        smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        monkeypatch.setattr(ddip.gpus, "_inventory_cache", None)  # asked afresh, and after the test
        return str(bin_dir)  # for a process that does not inherit this one's PATH (a kernel)

    return install
