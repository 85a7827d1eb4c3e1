"""One `ranch()` call as data: what runs, on how many ranks, where, with what environment.

Made once, after every argument was checked and before anything starts (oneshot._spec), and
read, never changed, by the launch that runs it, as torch elastic keeps its `WorkerSpec` apart
from the agent that runs it. Where the ranks run and with what (hosts, GPUs, env, warm) is checked
by ddip.kernel.spec.RanksSpec, the rules Group's arguments go through too, so the same bad input
reads the same from both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True, eq=False)
class LaunchSpec:
    """What one launch runs and where: the rank function and what it takes, the ranks, the
    notebook's place among them, the children's GPUs or hosts and their environment."""

    fn: Callable
    args: tuple
    kwargs: dict
    ctx: object  # a context manager entered around fn in every rank, or None
    nprocs: int  # every rank, the notebook's included
    caller_rank: int | None  # the rank the notebook plays, or None: every rank is a child
    gather: bool = True  # every rank's value in rank order, or only the caller's (or rank 0's)
    needed: dict = field(default_factory=dict)  # notebook globals for each child's __main__
    imports: str = ""  # code each child's __main__ runs first
    selected: list | None = None  # one ddip.gpus.Selected per rank (one host), or None for CPU
    layout: object = None  # ddip.hosts.Layout across hosts (the notebook's rank played here), or None
    warm: bool | None = None  # Group(warm=...) for the children
    env: dict = field(default_factory=dict)  # env= for the children, on top of what they inherit

    @property
    def child_ranks(self) -> list[int]:
        """The ranks that run as child processes: all but the notebook's."""
        return [r for r in range(self.nprocs) if r != self.caller_rank]

    def remote_host(self, rank: int) -> str | None:
        """The host a rank runs on, when that is not this machine."""
        if self.layout is None:
            return None
        host = self.layout.hosts[self.layout.plan.slot_host[rank]]
        return None if host.local else host.name
