"""Groups that span hosts: which ranks run where, how their hosts are reached, and what each
rank's environment says.

    Group(hosts={"node1": 4, "node2": 4})            4 CPU ranks on each host
    Group(hosts="node1:4,node2:4")                   the same, as %makedip --hosts takes it
    Group(hosts="node1[0,1] node2[2,3]")             one rank per listed GPU on each host

Ranks are numbered host by host, in the order given. The notebook's own host ("localhost",
"127.0.0.1" or its hostname) may be one of them: its ranks start here as in a one-host group.
Every other host is reached by a launcher that runs ``python -m ddip.remote`` there (see
ddip/hosts/agent.py), which connects back to the notebook over TCP, authenticated with the group's
key, and starts that host's ranks.

Launchers: "ssh" (the default; ``ssh -o BatchMode=yes HOST ...`` with the user's ssh config and
keys; words after "ssh" are passed to ssh, e.g. "ssh -F ./ssh_config -p 2222"), "slurm" (``srun``
inside an allocation; words after "slurm" are passed to srun), or a launcher command with {host} and
{command}, run by /bin/sh, e.g. "docker exec -i {host} {command}". The key reaches the remote
side on the launcher's stdin, never on a command line.

The rules (host lists, GPUs per host, where rank 0 listens, launcher command lines) are the
launch plan's (cpp/ddip/plan.hpp), the one copy `ddip run` uses too; this module takes Python's
forms (dicts, lists) and keeps what a group needs besides: the Python to run on each host.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from .. import _core
from .agent import command as agent_command
from .keeper import release_hosts

_plan = _core.plan
Host = _plan.Host  # name, ranks, gpus (CUDA_VISIBLE_DEVICES entries; [] for CPU ranks), local


def cpu_count() -> int:
    return _core.plan.cpu_count()


def omp_threads(local_ranks: int) -> int:
    """OMP_NUM_THREADS for ranks that did not choose: the launch plan's one rule (this host's
    cores divided among its ranks; see cpp/ddip/plan.hpp)."""
    return _core.plan.omp_threads(cpu_count(), local_ranks)


def is_local(name: str) -> bool:
    return _plan.is_this_host(name)


def _as_text(hosts) -> str:
    """Python's dict form as the plan's text: {'node1': 4, 'node2': [2, 3]} -> 'node1:4 node2[2,3]'."""
    if isinstance(hosts, str):
        return hosts
    if not isinstance(hosts, dict):
        raise ValueError(f"hosts must be a string like 'node1:4,node2:4' or a dict, got {type(hosts).__name__}")
    if not hosts:
        raise ValueError("hosts is empty: give hosts like {'node1': 4, 'node2': 4}")
    items = []
    for name, what in hosts.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"host names must be strings, got {name!r}")
        if isinstance(what, int) and not isinstance(what, bool):
            items.append(f"{name}:{what}")
        elif isinstance(what, (list, tuple)) and what:
            items.append(f"{name}[{','.join(str(g) for g in what)}]")
        else:
            raise ValueError(f"host {name!r}: give a number of ranks or a list of GPU ids, got {what!r}")
    return " ".join(items)


def parse_hosts(hosts) -> list:
    """'node1:4,node2:4', 'node1[0,1] node2[2,3]', {'node1': 4, 'node2': [2, 3]} -> [Host]."""
    return _plan.parse_hosts(_as_text(hosts))


def host_qualified(gpus) -> bool:
    """-g 'node1:0,1 node2:2,3': GPUs named per host (GPU and MIG ids have no ':')."""
    return isinstance(gpus, str) and ":" in gpus


def with_gpus(hosts, gpus) -> str:
    """--hosts plus -g, as one host list ('node1[0,1] node2[0,1]'):

        hosts='node1,node2', gpus='0,1' (or [0, 1])       the same GPUs on every host
        hosts='node1,node2', gpus='node1:0,1 node2:2,3'   each host's own
        hosts=None,          gpus='node1:0,1 node2:2,3'   the hosts are the ones -g names

    GPU numbers on another host are its own indices (ddip can't see its CUDA_VISIBLE_DEVICES)."""
    if hosts is not None and not isinstance(hosts, str):
        raise ValueError("with gpus=, give hosts= as names ('node1,node2'); a dict says each host's "
                         "GPUs itself: {'node1': [0, 1]}")
    if isinstance(gpus, (list, tuple)) and gpus:
        gpus = ",".join(str(g) for g in gpus)
    if not isinstance(gpus, str):
        raise ValueError(f"gpus must be a list of GPU ids like 0,1, got {gpus!r}")
    text = _plan.hosts_with_gpus(hosts, gpus.strip())
    _plan.parse_hosts(text)  # each host's GPUs checked now (a GPU listed twice, say)
    return text


def launcher_argv(launcher: str | None, host: str, python: str, env=None) -> list[str]:
    """The command, run here, that starts ddip's agent on `host` (see plan.hpp's launcher_argv);
    `env`: the launcher's environment (default: ours), where srun's job is."""
    env = os.environ if env is None else env
    cpus = _plan.uniform_cpus(env.get("SLURM_JOB_CPUS_PER_NODE", ""))
    return _plan.launcher_argv(launcher or "ssh", host, agent_command(python), cpus)


def slurm_hosts(env=None) -> list[str]:
    """The allocation's nodes (scontrol show hostnames $SLURM_JOB_NODELIST)."""
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ValueError("launcher='slurm' needs a Slurm allocation (salloc/sbatch): SLURM_JOB_NODELIST "
                         "is not set")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                         timeout=30)
    if out.returncode != 0:
        raise ValueError(f"scontrol show hostnames {nodelist} failed: {out.stderr.strip()}")
    return out.stdout.split()


@dataclass
class Layout:
    """Where each rank (slot) runs (the plan's layout), and how other hosts are reached."""

    plan: object  # _core.plan.Layout
    launcher: str | None
    python: str
    # Ranks of the plan that no process is started for: the notebook plays them (ranch). The
    # group's slots are the other ranks, in order; each keeps its place on its host.
    played_here: tuple = ()
    # The launchers' environment where it is not the notebook's: a Slurm job asked for from the
    # notebook (ddip/hosts/allocation.py) is that job's, not ours.
    env: dict | None = None

    def __post_init__(self):
        # The plan's lists, read once: each read of a _core.plan.Layout property builds a new Python
        # list (of Host objects), and a launch looks them up per slot (128 slots: 40-65 ms).
        self._hosts = list(self.plan.hosts)
        self._plan_local_rank = list(self.plan.local_rank)
        self._plan_slot_host = list(self.plan.slot_host)
        self._first_rank = list(self.plan.first_rank)
        self._by_played = {}  # played_here -> (rank_ids, slot_host, local_rank); ranch sets it later

    def _slots(self) -> tuple[list[int], list[int], list[int]]:
        got = self._by_played.get(self.played_here)
        if got is None:
            ids = [r for r in range(self.plan.size) if r not in self.played_here]
            got = (ids, [self._plan_slot_host[r] for r in ids], [self._plan_local_rank[r] for r in ids])
            self._by_played[self.played_here] = got
        return got

    @property
    def rank_ids(self) -> list[int]:
        return list(self._slots()[0])

    @property
    def world_size(self) -> int:
        return self.plan.size

    @property
    def hosts(self) -> list:
        return list(self._hosts)

    @property
    def size(self) -> int:
        return self.plan.size - len(self.played_here)

    @property
    def bind(self) -> str:
        return self.plan.bind

    @property
    def master_addr(self) -> str:
        return self.plan.master_addr

    @property
    def local_rank(self) -> list[int]:
        return list(self._slots()[2])

    @property
    def slot_host(self) -> list[int]:
        return list(self._slots()[1])

    def host(self, slot: int):
        return self._hosts[self._slots()[1][slot]]

    def slots_of(self, h: int) -> list[int]:
        return [s for s, hh in enumerate(self._slots()[1]) if hh == h]

    def remote(self, slot: int) -> bool:
        return not self.host(slot).local

    def gpus(self, slot: int) -> list[str] | None:
        return self.host(slot).gpus or None

    def launch_env(self, slot: int | None = None, *, rank: int | None = None) -> dict:
        """The plan's per-host part of rank `slot`'s environment (rank_environment's arguments);
        or, with rank=, of the plan's rank `rank` (one the notebook plays has no slot)."""
        h = self._slots()[1][slot] if rank is None else self._plan_slot_host[rank]
        return dict(local_world_size=self._hosts[h].ranks, rank_offset=self._first_rank[h],
                    group_rank=h, group_world_size=len(self._hosts))

    def launchers(self) -> list[tuple[str, list[str], list[int]]]:
        """(host name, launcher argv, slots) for each remote host that has ranks to start."""
        return [(h.name, launcher_argv(self.launcher, h.name, self.python, self.env), self.slots_of(i))
                for i, h in enumerate(self._hosts) if not h.local and self.slots_of(i)]

    def master_port(self) -> int:
        return _plan.master_port(self._hosts[0].local, self.plan.bind)


def layout(hosts, launcher=None, python=None, bind=None, env=None) -> Layout:
    """Checks everything (bad input changes nothing) and lays the ranks out host by host.
    A Layout already made (ranch's, without the notebook's rank) is taken as it is. `env`: the
    launchers' environment, if not the notebook's."""
    if isinstance(hosts, Layout):
        if launcher is not None or python is not None or bind is not None:
            raise ValueError("a laid-out host list already says its launcher, python and bind")
        return hosts
    if launcher is not None and not isinstance(launcher, str):
        raise ValueError(f"launcher must be 'ssh', 'slurm' or a launcher command with {{host}} and {{command}}, "
                         f"got {launcher!r}")
    if hosts is None and launcher is not None and launcher.split()[:1] in (["slurm"], ["srun"]):
        raise ValueError("launcher='slurm' needs hosts= too (the ranks per node), e.g. hosts=ddip.hosts."
                         "slurm_hosts() as {name: 4 for name in ...}")
    parsed = parse_hosts(hosts)
    python = python or sys.executable
    if not isinstance(python, str) or not python:
        raise ValueError(f"python must be the path of the Python to run on the hosts, got {python!r}")
    if bind is not None and not isinstance(bind, str):
        raise ValueError(f"bind must be an IP address of this machine, got {bind!r}")
    plan = _plan.lay_out(parsed, "", bind or "")
    out = Layout(plan, launcher, python, env=env)
    out.launchers()  # fail now, not once ranks are starting
    return out


def release(timeout: float = 5.0) -> int:
    """Lets the other hosts go: their standing agents (kept between groups, with each host's warm
    rank template) stop and exit; a group serving there lets its agent go when it ends. The next
    group on a host starts a new one. Returns how many agents were idle (see docs/warm.md)."""
    return release_hosts(timeout)
