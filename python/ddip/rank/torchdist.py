"""torch.distributed set-up and teardown, shared by group ranks and one-shot launches.

The rendezvous is bounded on its own (default 60 s), apart from the collectives' timeout
(torch's default: 30 minutes): a rank that dies before it arrives must not leave its peers, or
the notebook as rank 0, waiting half an hour. Every rank waits for the others in Python, in
short polls of the TCPStore, so Ctrl-C works, an abort hook is honoured, and the rank that
never arrived is named.

A launcher that plays rank 0 itself opens rank 0's store with serve() before it lets the other
ranks start connecting, and brings it to init(). A peer whose store client connects while the
port does not listen yet would sleep torch's connect backoff, 250 to 750 ms, before it tries
again: the other ranks wait for rank 0's port to listen first, trying every few milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from datetime import timedelta

RENDEZVOUS_TIMEOUT_S = 60.0
# Polls start at 1 ms (a warm launch's peers arrive within milliseconds) and back off to 50 ms.
_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.05


class RendezvousError(RuntimeError):
    """torch.distributed's rendezvous did not complete: names the ranks that never arrived."""


def rendezvous(rank: int, world: int, addr: str, port: int, timeout: float = RENDEZVOUS_TIMEOUT_S,
               abort=None, store=None):
    """A TCPStore on which every rank has arrived (rank 0 hosts it, or brings it as `store`).
    abort(), polled while waiting, returns a reason to give up (e.g. "rank 2 died") or None."""
    from torch.distributed import TCPStore

    deadline = time.monotonic() + timeout
    poll = _POLL_FIRST_S
    if store is None and rank == 0:
        store = serve(addr, port, world, timeout)
    elif store is None:
        _wait_listening(rank, addr, port, deadline, abort)
        store = TCPStore(addr, port, world, False, timedelta(seconds=timeout), wait_for_workers=False)
    store.set(f"ddip/arrived/{rank}", "1")
    while True:
        if store.check(["ddip/abort"]):
            raise RendezvousError(f"rank {rank}: the rendezvous was abandoned: {store.get('ddip/abort').decode()}")
        if rank == 0:
            missing = [r for r in range(world) if not store.check([f"ddip/arrived/{r}"])]
            if not missing:
                store.set("ddip/go", "1")
                return store
        elif store.check(["ddip/go"]):
            return store
        why = abort() if abort is not None else None
        if why is None and time.monotonic() >= deadline:
            if rank == 0:
                why = (f"rank(s) {', '.join(map(str, missing))} never arrived within {timeout:g} s "
                       f"(crashed before init_process_group, or MASTER_ADDR/MASTER_PORT differ?)")
            else:
                why = f"rank 0 did not complete the rendezvous within {timeout:g} s"
        if why is not None:
            try:
                store.set("ddip/abort", why)  # the others stop waiting too
            except Exception:
                pass
            raise RendezvousError(f"torch.distributed rendezvous failed on rank {rank}: {why}")
        time.sleep(poll)
        poll = min(poll * 2, _POLL_MAX_S)


def _wait_listening(rank: int, addr: str, port: int, deadline: float, abort) -> None:
    """Returns once rank 0's store server listens at addr:port (or what refuses is not a refusal).
    torch's client, refused, sleeps its connect backoff (250 to 750 ms) before it tries again; this
    tries again after 1 to 10 ms, so the client connects on its first try."""
    poll = _POLL_FIRST_S
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.05, deadline - time.monotonic())).close()
            return
        except ConnectionRefusedError:
            pass
        except OSError:
            return  # unreachable, say: torch's own client says so, as before
        why = abort() if abort is not None else None
        if why is None and time.monotonic() >= deadline:
            return  # torch's client then names the timeout
        if why is not None:
            raise RendezvousError(f"torch.distributed rendezvous failed on rank {rank}: {why}")
        time.sleep(poll)
        poll = min(poll * 2, 0.01)


# (rank, world size) of this process's last init(): what a heal rebuilds, whatever code ran since
# did to the environment (Lightning's teardown deletes WORLD_SIZE).
joined: tuple[int, int] | None = None


def serve(addr: str, port: int, world: int, timeout: float = RENDEZVOUS_TIMEOUT_S):
    """Rank 0's TCPStore: its server listens on `port` once this returns (for rendezvous(store=))."""
    from torch.distributed import TCPStore

    return TCPStore(addr, port, world, True, timedelta(seconds=timeout), wait_for_workers=False)


def init(backend: str, rank: int, world: int, *, collective_timeout: float | None = None,
         rendezvous_timeout: float = RENDEZVOUS_TIMEOUT_S, abort=None, store=None):
    """init_process_group after a bounded rendezvous, on MASTER_ADDR/MASTER_PORT (rank 0 may
    bring its store server already open, as a heal does)."""
    import torch.distributed as dist

    store = rendezvous(rank, world, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                       int(os.environ["MASTER_PORT"]), rendezvous_timeout, abort, store)
    kw = {}
    if collective_timeout is not None:
        kw["timeout"] = timedelta(seconds=collective_timeout)
    if not dist.is_initialized():
        # torch names the default group by a per-process count that only destroy_process_group()
        # resets: an init that failed past naming its group (a peer died in connectFullMesh) left
        # it at 1, and this init would then wait forever for its peers' keys under another name.
        dist.distributed_c10d._world.group_count = 0
    with tracking_sockets():  # a heal may have to close them under a model still holding them
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kw)
    store.set(f"ddip/built/{rank}", "1")
    global _kept, joined
    joined = (rank, world)
    # Rank 0 hosts the store, and its fn may end (tearing its process group down) while a peer is
    # still building its own on the store: the store outlives the process group, until
    # release() (ranch calls it once every child has exited) or the next init.
    _kept = (store, world, rendezvous_timeout)


_kept = None  # (store, world, rendezvous timeout) of the last init


def wait_for_peers(abort=None) -> None:
    """Returns once every rank of the last init has built its process group (or a peer is known
    lost: abort() gave a reason, or the rendezvous timeout passed). A rank whose work needed no
    collective must not tear its group down before then: gloo's connectFullMesh in a peer still
    connecting to it fails with "Connection closed by peer"."""
    if _kept is None:
        return
    store, world, timeout = _kept
    deadline = time.monotonic() + timeout
    poll = _POLL_FIRST_S
    keys = [f"ddip/built/{r}" for r in range(world)]
    try:
        while not store.check(keys):
            if store.check(["ddip/abort"]) or (abort is not None and abort() is not None) \
                    or time.monotonic() >= deadline:
                return  # that peer failed, and is reported as such; no use waiting for it
            time.sleep(poll)
            poll = min(poll * 2, _POLL_MAX_S)
    except Exception:
        return  # the store's server (rank 0) is gone: there is no one left to wait for


def release():
    """Drops the store kept by the last init (its server, in rank 0)."""
    global _kept
    _kept = None


def shutdown():
    """Tears torch.distributed down, if it was set up, and gives cached GPU memory back."""
    if "torch.distributed" not in sys.modules:
        return
    import torch
    import torch.distributed as dist

    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def process_groups() -> frozenset:
    """The process groups that exist in this process now (the default one among them); empty
    where torch.distributed was never imported, or isn't built in."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return frozenset()
    return frozenset(dist.distributed_c10d._world.pg_map)


def destroy_since(before: frozenset) -> list:
    """Destroys every process group created since `before` = process_groups() was taken: all of
    them at once when the default group is new (as destroy_process_group() does), else one by
    one, leaving the groups of `before` (a default group the caller had already) untouched.
    Returns the errors met, as (group, exception); a group that fails still goes on to the next."""
    new = process_groups() - before
    if not new:
        return []
    import torch.distributed as dist

    default = dist.distributed_c10d.GroupMember.WORLD
    if default is not None and default in new:
        try:
            dist.destroy_process_group()
        except Exception as exc:
            return [(default, exc)]
        return []
    errors = []
    for pg in new:
        try:
            dist.destroy_process_group(pg)
        except Exception as exc:
            errors.append((pg, exc))
    return errors


_sockets: set[tuple[int, str]] = set()  # (fd, "socket:[inode]") opened by the last init


def _open_sockets() -> set[tuple[int, str]]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (listdir's own fd, say)
            continue
        if target.startswith("socket:"):
            found.add((int(name), target))
    return found


@contextlib.contextmanager
def tracking_sockets():
    """Remembers the sockets opened inside (init_process_group's: gloo's connections to its peers),
    so that a heal (ddip.rank.heal.release) can close them even while a model still holds the process group."""
    global _sockets
    before = _open_sockets()
    try:
        yield
    finally:
        _sockets = _open_sockets() - before


def shutdown_sockets():
    """Shuts down the last init's sockets that are still open (the same socket, by inode): a peer
    blocked on one of them gets 'Connection closed by peer' at once."""
    global _sockets
    for fd, target in _sockets:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != target:
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            # Connections only: gloo's listener must stay (its thread aborts the process when its
            # accept() fails), and nobody waits on it.
            if s.family in (socket.AF_INET, socket.AF_INET6) and \
                    not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                s.shutdown(socket.SHUT_RDWR)  # acts on the socket itself, not only on our dup
        except OSError:  # not connected: nobody waits on it
            pass
        finally:
            s.close()
    _sockets = set()
