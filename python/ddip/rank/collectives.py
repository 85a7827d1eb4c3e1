"""A rank's collectives as torch's flight recorder keeps them (the rank's side of "which rank
never joined which collective"). The kernel asks through the rank's endpoint; the answer is made
on a thread of its own, since the main thread may be the one waiting in the collective (that wait
lets go of the GIL). The flight recorder is on in every rank ddip starts (TORCH_FR_BUFFER_SIZE,
set by the launch plan); torch keeps it, this only reads it."""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import time

# Completed collectives kept per process group in an answer: the picture needs the last only.
KEEP_DONE = 3


def snapshot() -> dict:
    """This rank's collectives: {"rank", "now_ns", "groups": {name: ranks}, "entries": [...]},
    or {"off": why} where there is nothing to read. Never imports torch itself."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {"off": "torch.distributed is not initialized"}
    from torch._C._distributed_c10d import _dump_fr_trace_json

    raw = json.loads(_dump_fr_trace_json(includeCollectives=True, onlyActive=False))
    entries = _current([_entry(e) for e in raw.get("entries") or []])
    if not entries and os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")) == "0":
        return {"off": "torch's flight recorder is off (TORCH_FR_BUFFER_SIZE=0)"}
    kept, done_seen = [], {}
    for e in reversed(entries):  # newest first: the last completed ones of each group
        if e["done"]:
            done_seen[e["pg"]] = done_seen.get(e["pg"], 0) + 1
            if done_seen[e["pg"]] > KEEP_DONE:
                continue
        kept.append(e)
    groups = {}
    for name, cfg in (raw.get("pg_config") or {}).items():
        try:
            groups[cfg.get("name", name)] = json.loads(cfg.get("ranks", "[]"))
        except (ValueError, AttributeError):
            pass
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "now_ns": time.time_ns(),
            "groups": groups, "entries": kept[::-1]}


def _current(entries: list[dict]) -> list[dict]:
    """Only the current process groups' entries. The recorder outlives a group: one destroyed and
    made again under the same name (a heal, a framework's own setup) numbers from 1 again, and its
    older entries are another group's."""
    last_seq: dict[tuple, int] = {}
    start: dict[str, int] = {}  # group -> index of its current generation's first entry
    for i, e in enumerate(entries):
        key = (e["pg"], e["p2p"])
        if key in last_seq and e["seq"] <= last_seq[key]:
            start[e["pg"]] = i
        last_seq[key] = e["seq"]
    return [e for i, e in enumerate(entries) if i >= start.get(e["pg"], 0)]


def _entry(e: dict) -> dict:
    pg = e.get("process_group") or ["", ""]
    return {"seq": e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id"),
            "p2p": bool(e.get("is_p2p")), "pg": pg[1] if len(pg) > 1 else str(pg[0]),
            "op": str(e.get("profiling_name", "?")).split(":")[-1],
            "sizes": e.get("input_sizes") or [], "dtypes": e.get("input_dtypes") or [],
            # gloo retires an entry when its work completes; NCCL also says "completed"
            "done": bool(e.get("retired")) or e.get("state") == "completed",
            "created_ns": e.get("time_created_ns") or 0}


def serve(endpoint, reply_kind: int) -> None:
    """Answers the kernel's collectives requests from now on, on a daemon thread."""
    read_fd, write_fd = os.pipe()
    endpoint.enable_collectives(write_fd)  # it owns write_fd from here
    threading.Thread(target=_answer, args=(endpoint, read_fd, reply_kind), name="ddip-collectives",
                     daemon=True).start()


def _answer(endpoint, read_fd: int, reply_kind: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 8)
        except InterruptedError:
            continue
        except OSError:
            return
        if len(data) < 8:
            return
        (seq,) = struct.unpack("<Q", data)
        try:
            answer = snapshot()
        except Exception as exc:  # a torch without the recorder's reader, say: the kernel is told
            answer = {"off": f"the flight recorder could not be read: {type(exc).__name__}: {exc}"}
        try:
            endpoint.send(reply_kind, seq, json.dumps(answer).encode())
        except Exception:
            return  # the kernel is gone
