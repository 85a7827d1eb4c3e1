"""Groups that span hosts: `hosts=` as the launch plan places ranks on them (placement), the agent each other
host runs (agent, `python -m ddip.remote`), and the kernel's standing agents (keeper).

`ddip.hosts.release()` and the layout's names are public here, as they were when this was one
module (docs/warm.md, docs/multihost.md)."""

from .. import _lazy
from .placement import (Host, Layout, agent_command, cpu_count, host_qualified, is_local, launcher_argv, layout,
                     omp_threads, parse_hosts, release, slurm_hosts, with_gpus)

__all__ = ["Host", "Layout", "agent_command", "cpu_count", "host_qualified", "is_local", "launcher_argv", "layout",
           "omp_threads", "parse_hosts", "release", "slurm_hosts", "with_gpus"]

__getattr__ = _lazy.submodules(__name__)  # ddip.hosts.<module> reached after `import ddip`
