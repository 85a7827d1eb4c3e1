"""Which GPUs a group's ranks get, decided without initializing CUDA in the notebook.

The notebook's own view is the universe, as torchrun and accelerate users expect: under Slurm,
in a container or on a shared machine the kernel may see only some GPUs
(CUDA_VISIBLE_DEVICES=4,5,6,7). So:

- "all" means every GPU the notebook can see;
- numbers are positions in the notebook's visible list (torch's device indices in the
  notebook), so `-g 0,1` keeps working under Slurm;
- entries given as UUIDs (GPU-...) or MIG ids (MIG-...) pass through as they are;
- anything outside the visible list is an error that names what is visible;
- CUDA_VISIBLE_DEVICES hides GPUs but can't add any: on a machine without an NVIDIA GPU nothing
  is visible, whatever it lists.

Every rank gets CUDA_VISIBLE_DEVICES listing the group's GPUs in the order given, and rank
LOCAL_RANK uses device index LOCAL_RANK. CUDA_DEVICE_ORDER is passed through unchanged, so a
number means in a rank what it means in the notebook.

The rules themselves are the launch plan's (cpp/ddip/plan.hpp, one copy for Group, ranch,
%makedip and ddip run): plain data in, data out, tested without a GPU. Here: Python's request
forms, and `inventory()` and `usage()`, which look at the machine through nvidia-smi and /proc.
"""

from __future__ import annotations

import operator
import os
import subprocess
import time
from dataclasses import dataclass

from . import _core


@dataclass(frozen=True)
class GpuInfo:
    index: int  # nvidia-smi's index (PCI bus order)
    uuid: str = ""  # "GPU-..." ("" when unknown)
    name: str = ""
    memory_total_mib: int | None = None


@dataclass(frozen=True)
class Selected:
    """One rank's GPU: the entry that goes into CUDA_VISIBLE_DEVICES, and its position in the
    notebook's visible list (its torch device index in the notebook; None when not visible)."""

    entry: str
    position: int | None


def _smi(*args: str, timeout: float = 20.0) -> list[list[str]] | None:
    try:
        out = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


# The GPUs themselves don't change while a kernel runs, and nvidia-smi takes 0.1-1 s: one
# %makedip -g or ranch(gpus=) asks several times (count, select, status), so a recent answer is
# reused. 30 s keeps a changed MIG layout or a driver reload from going unseen for long.
INVENTORY_TTL_S = 30.0
_inventory_cache: tuple[float, list[GpuInfo]] | None = None


def physical_gpus() -> list[GpuInfo]:
    """This machine's NVIDIA GPUs, without initializing CUDA here."""
    global _inventory_cache
    now = time.monotonic()
    if _inventory_cache is not None and now - _inventory_cache[0] < INVENTORY_TTL_S:
        return list(_inventory_cache[1])
    gpus = _query_physical_gpus()
    _inventory_cache = (now, gpus)
    return list(gpus)


def _query_physical_gpus() -> list[GpuInfo]:
    rows = _smi("--query-gpu=index,uuid,name,memory.total")
    if rows:
        gpus = []
        for row in rows:
            try:
                gpus.append(GpuInfo(int(row[0]), row[1], row[2], int(float(row[3]))))
            except (IndexError, ValueError):
                continue
        return sorted(gpus, key=lambda g: g.index)
    # No answer from nvidia-smi: the plan counts the GPUs as ddip run does (the driver's list).
    return [GpuInfo(i) for i in range(_core.plan.nvidia_device_count())]


def visible_entries(visible_env: str | None, physical_count: int) -> list[str]:
    """The notebook's visible GPUs as CUDA_VISIBLE_DEVICES entries, in its device-index order
    (CUDA's rule, decided by the launch plan: the list ends at the first invalid entry)."""
    return _core.plan.visible_gpus(visible_env, physical_count)


# How to ask for CPU ranks instead, said when no GPU is visible.
CPU_HINT = "; to run CPU processes instead, use n=2 (for example) for a group, or leave out gpus= in ranch"


def _position(item) -> str | None:
    """An int, a numpy integer or a string of digits (with an optional '-') as a position;
    None otherwise (a float is no position: 1.5 must not quietly mean GPU 1)."""
    if isinstance(item, str):
        t = item.strip()
        return t if t.lstrip("-").isdigit() else None
    if isinstance(item, bool):
        return None
    try:
        return str(operator.index(item))
    except TypeError:
        return None


def request_entries(request) -> list[str]:
    """'all', 2, '0,3', [3, 2], 'GPU-ab12...,GPU-cd34...' -> the entries the launch plan resolves
    (Python's own forms: ints, numpy integers, lists; the plan says what they mean)."""
    bad_form = (f"gpus={request!r} is not a GPU list; give 'all', positions like '0,3' or [3, 2], "
                f"or GPU UUIDs")
    if isinstance(request, (bool, bytes, bytearray, float)):
        raise ValueError(bad_form)
    if isinstance(request, (set, frozenset, dict)):
        raise ValueError(f"gpus={request!r} has no order; give a list, since rank r uses the r-th GPU")
    if isinstance(request, str):
        items = [x.strip() for x in request.split(",") if x.strip() != ""]
        items = ["all"] if [i.lower() for i in items] == ["all"] else items
    elif _position(request) is not None:
        items = [_position(request)]
    else:
        try:
            items = list(request)
        except TypeError:
            raise ValueError(bad_form) from None
        for i, item in enumerate(items):
            if isinstance(item, str) and item.strip().startswith(("GPU-", "MIG-")):
                items[i] = item.strip()
            elif _position(item) is not None:
                items[i] = _position(item)
            else:
                raise ValueError(bad_form)
    if not items:
        raise ValueError("gpus is empty; give 'all', positions like '0,3', or GPU UUIDs")
    return items


def select(request, visible_env: str | None = None, physical: list[GpuInfo] | None = None,
           who: str = "the notebook") -> list[Selected]:
    """One Selected per rank, in order, resolved by the launch plan against `visible_env` (the
    CUDA_VISIBLE_DEVICES positions refer to) and the `physical` GPUs. Raises ValueError naming
    what is visible when the request can't be met. `who` names whose view it is (the notebook's,
    or a group's env=)."""
    physical = physical or []
    pairs = _core.plan.select_gpus(request_entries(request), visible_env, len(physical),
                                   [g.uuid for g in physical], who, CPU_HINT)
    return [Selected(entry, position) for entry, position in pairs]


def inventory() -> tuple[list[str], str | None, list[GpuInfo]]:
    """(the notebook's visible entries, its CUDA_VISIBLE_DEVICES or None, the physical GPUs)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = physical_gpus()
    return visible_entries(env, len(physical)), env, physical


def resolve(request) -> list[Selected]:
    """select() against this machine and the notebook's environment."""
    return select(request, os.environ.get("CUDA_VISIBLE_DEVICES"), physical_gpus())


def utilization() -> dict[str, int]:
    """GPU uuid -> its utilization now (percent of the last sample period a kernel ran), read with
    nvidia-smi; {} where it can't say."""
    out = {}
    for row in _smi("--query-gpu=uuid,utilization.gpu", timeout=5.0) or []:
        try:
            out[row[0]] = int(float(row[1]))
        except (IndexError, ValueError):
            continue
    return out


def usage(pids) -> dict[int, dict]:
    """Per process id: the GPU it is using (physical index, name, MiB used), read with
    nvidia-smi, never through CUDA in the notebook. Processes not on a GPU are left out."""
    apps = _smi("--query-compute-apps=pid,gpu_uuid,used_memory", timeout=5.0)
    if not apps:
        return {}
    by_uuid = {g.uuid: g for g in physical_gpus() if g.uuid}
    wanted = set(pids)
    out: dict[int, dict] = {}
    for row in apps:
        try:
            pid, uuid, used = int(row[0]), row[1], int(float(row[2]))
        except (IndexError, ValueError):
            continue
        if pid in wanted:
            g = by_uuid.get(uuid)
            out[pid] = {"index": g.index if g else None, "name": g.name if g else "", "uuid": uuid,
                        "used_mib": used + out.get(pid, {}).get("used_mib", 0)}
    return out
