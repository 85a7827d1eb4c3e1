"""A rank's collectives as torch's flight recorder keeps them (the rank's side of "which rank
never joined which collective"). The kernel asks through the rank's endpoint; the answer is made
on a thread of its own, since the main thread may be the one waiting in the collective (that wait
lets go of the GIL). The flight recorder is on in every rank ddip starts (TORCH_FR_BUFFER_SIZE,
set by the launch plan); torch keeps it, this only reads it."""

from __future__ import annotations

import json
import linecache
import os
import struct
import sys
import sysconfig
import threading
import time

# Completed collectives kept per process group in an answer: the picture needs the last only.
KEEP_DONE = 3


def snapshot(entered: bool = False) -> dict:
    """This rank's collectives: {"rank", "world", "now_ns", "groups": {name: {"ranks", "issued"}},
    "entries": [...]}, where "issued" is how many collectives the live group has issued, so the
    runtime's picture tells its records from those of an earlier group of the same name (a heal, a
    framework's own set-up); or {"outside": "left" | "uninitialized"} from a rank that is in no
    collective of any group; or {"off": why} where there is nothing to read. With `entered` (the
    kernel's answers, not ddip run's records on stderr), "entered" too: when this rank entered
    each collective the recorder holds. Never imports torch itself."""
    at = where()  # first: the main thread goes on while the recorder is read
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return {"outside": "uninitialized", "where": at}
    from torch._C._distributed_c10d import _dump_fr_trace_json

    raw = json.loads(_dump_fr_trace_json(includeCollectives=True, onlyActive=False))
    entries = [_entry(e) for e in raw.get("entries") or []]
    if not dist.is_initialized():
        # The recorder outlives the groups: records there mean this rank had a group and left it.
        return {"outside": "left" if entries else "uninitialized", "where": at}
    if not entries and os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")) == "0":
        return {"off": "torch's flight recorder is off (TORCH_FR_BUFFER_SIZE=0)"}
    groups = _live_groups(dist)  # after the dump: a collective issued in between reads as issued
    kept, done_seen = [], {}
    for e in reversed(entries):  # newest first: the last completed ones of each group
        if e["done"]:
            done_seen[e["pg"]] = done_seen.get(e["pg"], 0) + 1
            if done_seen[e["pg"]] > KEEP_DONE:
                continue
        kept.append(e)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "now_ns": time.time_ns(),
            "groups": groups, "entries": kept[::-1], "where": at,
            **({"entered": _entered(entries)} if entered else {})}


# Where code that is not the user's lives: ddip, IPython, the standard library, installed packages.
_NOT_USERS = tuple({os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep}
                   | {os.path.realpath(p) + os.sep for p in (sysconfig.get_paths().get(k) for k in
                                                             ("stdlib", "platstdlib", "purelib", "platlib")) if p})


def where() -> dict | None:
    """Where the main thread is in the user's code: the innermost frame that is the user's (a
    cell, a script), its line, and the call it is in there ("time.sleep"), read from the source
    the call's instruction spans. None when no user frame is on the stack (the rank is idle)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    try:
        while frame is not None and not _users(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None:
            return None
        return {"file": frame.f_code.co_filename, "line": frame.f_lineno,
                "function": frame.f_code.co_name, "call": _call_at(frame)}
    finally:
        del frame


def _users(filename: str) -> bool:
    if filename.startswith("<"):
        return filename.startswith("<ipython-input-")  # a cell; <string>, <frozen ...> are not
    return not os.path.realpath(filename).startswith(_NOT_USERS)


def _call_at(frame) -> str | None:
    """The callee of the call the frame is in, as written: its instruction's span in the source,
    up to the first "(" (CPython 3.11+; None before, or where the source is not at hand)."""
    positions = getattr(frame.f_code, "co_positions", None)
    if positions is None or frame.f_lasti < 0:
        return None
    try:
        line, end_line, col, end_col = list(positions())[frame.f_lasti // 2]
    except (IndexError, ValueError):
        return None
    if line is None or line != end_line or col is None or end_col is None:
        return None
    text = linecache.getline(frame.f_code.co_filename, line, frame.f_globals)[col:end_col]
    callee = text.split("(", 1)[0].strip()
    return callee if "(" in text and callee.replace(".", "").replace("_", "").isalnum() else None


def _live_groups(dist) -> dict:
    """The process groups this rank is in now: name -> {"ranks": their global ranks, "issued": how
    many collectives it has issued (None where its backend does not count them)}."""
    world = dist.distributed_c10d._world
    groups = {}
    for pg, name in list(world.pg_names.items()):
        try:
            issued = pg._get_sequence_number_for_group()
        except Exception:  # a backend without sequence numbers
            issued = None
        groups[str(name)] = {"ranks": sorted(world.pg_group_ranks.get(pg, {})), "issued": issued}
    return groups


def _entry(e: dict) -> dict:
    pg = e.get("process_group") or ["", ""]
    return {"seq": e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id"),
            "p2p": bool(e.get("is_p2p")), "pg": str(pg[0]), "gen": e.get("pg_id") or 0,
            "op": str(e.get("profiling_name", "?")).split(":")[-1],
            "sizes": e.get("input_sizes") or [], "dtypes": e.get("input_dtypes") or [],
            # gloo retires an entry when its work completes; NCCL also says "completed"
            "done": bool(e.get("retired")) or e.get("state") == "completed",
            "created_ns": e.get("time_created_ns") or 0}


def _entered(entries: list[dict]) -> list[list]:
    """When this rank entered each collective the recorder holds (its last TORCH_FR_BUFFER_SIZE,
    256 by default, where `entries` keeps a few), for the runtime's Stragglers
    (cpp/ddip/stragglers.hpp): [pg, gen, seq, op, created_ns], a list each to keep the answer
    small. The recorder's time_created_ns is when the rank's code called the collective: the one
    time gloo records. Point-to-point operations are left out: only two ranks wait in them."""
    return [[e["pg"], e["gen"], e["seq"], e["op"], e["created_ns"]]
            for e in entries if not e["p2p"] and e["created_ns"]]


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
            answer = snapshot(entered=True)
        except Exception as exc:  # a torch without the recorder's reader, say: the kernel is told
            answer = {"off": f"the flight recorder could not be read: {type(exc).__name__}: {exc}"}
        try:
            endpoint.send(reply_kind, seq, json.dumps(answer).encode())
        except Exception:
            return  # the kernel is gone
