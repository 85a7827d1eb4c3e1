"""The notebook's environment while it plays a rank of a one-shot launch: the variables its
children get by the launch plan, set in the notebook's own `os.environ` while fn runs there, and
then exactly what was there before put back, whatever fn or ctx did to it.
"""

from __future__ import annotations

import os

from .. import _core
from .spec import LaunchSpec


class NotebookRankEnv:
    """for_rank() computes the environment, enter() sets it, restore() puts the notebook's back
    (once; restoring again, or without entering, does nothing)."""

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self._saved: dict[str, str] | None = None

    def for_rank(self, rank: int, port: int) -> dict:
        """The notebook's environment as rank `rank`: the variable set its children get (the launch
        plan's), on top of its own environment; OMP_NUM_THREADS is not its to change now."""
        base = [f"{k}={v}" for k, v in os.environ.items()]
        layout = self.spec.layout
        if layout is None:
            env = _core.plan.rank_environment(base, rank, world_size=self.spec.nprocs, master_port=port,
                                              cpu_ranks=self.spec.selected is None)
        else:
            # Its place on this host among the host list's ranks; MASTER_ADDR is the address the
            # other hosts reach this machine at (the plan's), as for every child.
            plan = layout.plan
            host = plan.hosts[plan.slot_host[rank]]
            env = _core.plan.rank_environment(
                base + [f"DDIP_HOST={host.name}"], plan.local_rank[rank], world_size=self.spec.nprocs,
                master_addr=plan.master_addr, master_port=port, cpu_ranks=not host.gpus,
                **layout.launch_env(rank=rank))
        return dict(e.split("=", 1) for e in env)

    def enter(self, new: dict):
        """os.environ becomes `new` exactly (what is not in it is removed); the old one is kept."""
        self._saved = dict(os.environ)
        for k in [k for k in os.environ if k not in new]:
            del os.environ[k]
        os.environ.update(new)

    def restore(self):
        saved, self._saved = self._saved, None
        if saved is None:
            return
        for k in [k for k in os.environ if k not in saved]:
            del os.environ[k]
        for k, v in saved.items():
            if os.environ.get(k) != v:
                os.environ[k] = v
