"""Which GPUs a group's ranks get, decided without initializing CUDA in the notebook.

The notebook's own view is the universe, as torchrun and accelerate users expect: under Slurm,
in a container or on a shared machine the kernel may see only some GPUs
(CUDA_VISIBLE_DEVICES=4,5,6,7). So:

- "all" means every GPU the notebook can see;
- numbers are positions in the notebook's visible list (torch's device indices in the
  notebook), so `-g 0,1` keeps working under Slurm;
- entries given as UUIDs (GPU-...) or MIG ids (MIG-...) pass through as they are;
- anything outside the visible list is an error that names what is visible.

Every rank gets CUDA_VISIBLE_DEVICES listing the group's GPUs in the order given, and rank
LOCAL_RANK uses device index LOCAL_RANK. CUDA_DEVICE_ORDER is passed through unchanged, so a
number means in a rank what it means in the notebook.

The selection itself is plain data in, data out (`visible_entries`, `select`), tested without
a GPU; only `inventory()` and `usage()` look at the machine, through /proc and nvidia-smi.
"""

from __future__ import annotations

import operator
import os
import subprocess
import time
from dataclasses import dataclass


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
    try:  # no nvidia-smi: the driver still lists its devices
        return [GpuInfo(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def visible_entries(visible_env: str | None, physical_count: int) -> list[str]:
    """The notebook's visible GPUs as CUDA_VISIBLE_DEVICES entries, in its device-index order.
    Like CUDA, the list ends at the first invalid entry: an empty or negative one ("" or "-1"
    hide every GPU), a word that is no index, UUID or MIG id, or an index past the GPUs there
    are (when their number is known)."""
    if visible_env is None:
        return [str(i) for i in range(physical_count)]
    entries = []
    for e in visible_env.split(","):
        e = e.strip()
        if _is_id(e):
            entries.append(e)
            continue
        if not e.isdigit() or (physical_count > 0 and int(e) >= physical_count):
            break
        entries.append(e)
    return entries


def _describe_visible(visible: list[str], visible_env: str | None, who: str = "the notebook") -> str:
    if not visible:
        if visible_env is not None:
            return f"{who} sees no GPU (CUDA_VISIBLE_DEVICES={visible_env!r})"
        return "this machine has no NVIDIA GPU"
    where = f" (CUDA_VISIBLE_DEVICES={visible_env})" if visible_env is not None else ""
    positions = "0" if len(visible) == 1 else f"0-{len(visible) - 1}"
    return f"{who} sees {len(visible)} GPU{'s' if len(visible) > 1 else ''}{where}: give positions {positions}, 'all', or their UUIDs"


def _position(item) -> int | None:
    """An int, a numpy integer or a string of digits (with an optional '-'); None otherwise
    (a float is no position: 1.5 must not quietly mean GPU 1)."""
    if isinstance(item, str):
        t = item.strip()
        return int(t) if t.lstrip("-").isdigit() else None
    if isinstance(item, bool):
        return None
    try:
        return operator.index(item)
    except TypeError:
        return None


def _is_id(entry: str) -> bool:
    return entry.startswith(("GPU-", "MIG-"))


def select(request, visible: list[str], visible_env: str | None = None,
           physical: list[GpuInfo] | None = None, who: str = "the notebook") -> list[Selected]:
    """'all', 2, '0,3', [3, 2], 'GPU-ab12...,GPU-cd34...' -> one Selected per rank, in order.
    Raises ValueError naming what is visible when the request can't be met. `who` names whose
    CUDA_VISIBLE_DEVICES `visible_env` is (the notebook's, or a group's env=)."""
    bad_form = (f"gpus={request!r} is not a GPU list; give 'all', positions like '0,3' or [3, 2], "
                f"or GPU UUIDs")
    cpu_hint = "; to run CPU processes instead, use n=2 (for example) for a group, or leave out gpus= in ranch"
    if isinstance(request, str) and request.strip().lower() == "all":
        if not visible:
            raise ValueError(f"gpus='all' but {_describe_visible(visible, visible_env, who)}{cpu_hint}")
        return [Selected(e, i) for i, e in enumerate(visible)]
    if isinstance(request, (bool, bytes, bytearray, float)):
        raise ValueError(bad_form)
    if isinstance(request, (set, frozenset, dict)):
        raise ValueError(f"gpus={request!r} has no order; give a list, since rank r uses the r-th GPU")
    if _position(request) is not None and not isinstance(request, str):
        items = [_position(request)]
    elif isinstance(request, str):
        items = [x.strip() for x in request.split(",") if x.strip() != ""]
    else:
        try:
            items = list(request)
        except TypeError:
            raise ValueError(bad_form) from None
    if not items:
        raise ValueError("gpus is empty; give 'all', positions like '0,3', or GPU UUIDs")
    chosen: list[Selected] = []
    for item in items:
        if isinstance(item, bool):
            raise ValueError(bad_form)
        if isinstance(item, str) and _is_id(item):
            chosen.append(_by_id(item, visible, visible_env, physical, who))
            continue
        pos = _position(item)
        if pos is None:
            raise ValueError(bad_form)
        if not 0 <= pos < len(visible):
            raise ValueError(f"GPU {pos} is not visible: {_describe_visible(visible, visible_env, who)}"
                             + (cpu_hint if not visible else ""))
        chosen.append(Selected(visible[pos], pos))
    # The same GPU named twice (a position and its UUID, say) is a duplicate too.
    keys = [c.position if c.position is not None else c.entry for c in chosen]
    dup = sorted({c.entry for c, k in zip(chosen, keys) if keys.count(k) > 1})
    if dup:
        raise ValueError(f"gpus={request!r} lists GPU {', '.join(dup)} more than once; each rank needs its own GPU")
    return chosen


def _by_id(uid: str, visible: list[str], visible_env, physical, who="the notebook") -> Selected:
    if uid in visible:
        return Selected(uid, visible.index(uid))
    if visible_env is None and physical is not None:
        # Nothing hidden: a UUID names a physical GPU; its position is its index (when the
        # default order agrees with nvidia-smi's, which a UUID request makes moot for ranks).
        for g in physical:
            if g.uuid and g.uuid.startswith(uid):  # CUDA takes a unique UUID prefix too
                return Selected(uid, g.index)
        if any(g.uuid for g in physical) and uid.startswith("GPU-"):
            known = ", ".join(g.uuid for g in physical if g.uuid)
            raise ValueError(f"no GPU has UUID {uid}; this machine has {known}")
        return Selected(uid, None)
    if visible_env is None:
        return Selected(uid, None)
    raise ValueError(f"{uid} is not visible: {_describe_visible(visible, visible_env, who)}")


def inventory() -> tuple[list[str], str | None, list[GpuInfo]]:
    """(the notebook's visible entries, its CUDA_VISIBLE_DEVICES or None, the physical GPUs)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = physical_gpus()
    return visible_entries(env, len(physical)), env, physical


def resolve(request) -> list[Selected]:
    """select() against this machine and the notebook's environment."""
    visible, env, physical = inventory()
    return select(request, visible, env, physical)


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
