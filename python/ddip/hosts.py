"""Groups that span hosts: which ranks run where, how their hosts are reached, and what each
rank's environment says.

    Group(hosts={"node1": 4, "node2": 4})            4 CPU ranks on each host
    Group(hosts="node1:4,node2:4")                   the same, as %makedip --hosts takes it
    Group(hosts="node1[0,1] node2[2,3]")             one rank per listed GPU on each host

Ranks are numbered host by host, in the order given. The notebook's own host ("localhost",
"127.0.0.1" or its hostname) may be one of them: its ranks start here as in a one-host group.
Every other host is reached by a launcher that runs ``python -m ddip.remote`` there (see
ddip/remote.py), which connects back to the notebook over TCP, authenticated with the group's
key, and starts that host's ranks.

Launchers: "ssh" (the default; ``ssh -o BatchMode=yes HOST ...`` with the user's ssh config and
keys; words after "ssh" are passed to ssh, e.g. "ssh -F ./ssh_config -p 2222"), "slurm" (``srun``
inside an allocation; words after "slurm" are passed to srun), or a template with {host} and
{command}, run by /bin/sh, e.g. "docker exec -i {host} {command}". The key reaches the remote
side on the launcher's stdin, never on a command line.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass

# When rank 0 runs on another host, ddip cannot see which ports are free there.
REMOTE_MASTER_PORTS = (29500, 30499)
_ITEM = re.compile(r"^\s*([A-Za-z0-9_.:\-]+?)\s*(?::\s*(\d+)|\[\s*([^\]]*)\])\s*$")


@dataclass
class Host:
    name: str
    ranks: int
    gpus: list[str] | None  # CUDA_VISIBLE_DEVICES entries for its ranks, or None: CPU ranks
    local: bool  # the notebook's own host


def is_local(name: str) -> bool:
    if name in ("localhost", "127.0.0.1", "::1"):
        return True
    try:
        return name in (socket.gethostname(), socket.getfqdn())
    except OSError:
        return False


def _split_items(text: str) -> list[str]:
    """Commas and whitespace separate hosts, except inside [...]."""
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth == 0 and (ch == "," or ch.isspace()):
            if cur.strip():
                items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        items.append(cur.strip())
    return items


def _gpu_list(host: str, text: str) -> list[str]:
    ids = [g.strip() for g in text.split(",") if g.strip()]
    if not ids or not all(re.fullmatch(r"\d+|GPU-[0-9A-Fa-f\-]+|MIG-[0-9A-Za-z\-/]+", g) for g in ids):
        raise ValueError(f"host {host!r}: GPUs must be ids or UUIDs like {host}[0,1], got [{text}]")
    if len(set(ids)) != len(ids):
        raise ValueError(f"host {host!r} lists a GPU twice: [{text}]")
    return ids


def parse_hosts(hosts) -> list[Host]:
    """'node1:4,node2:4', 'node1[0,1] node2[2,3]', {'node1': 4, 'node2': [2, 3]} -> Hosts."""
    pairs = []
    if isinstance(hosts, str):
        items = _split_items(hosts)
        if not items:
            raise ValueError("hosts is empty: give hosts like 'node1:4,node2:4'")
        for item in items:
            m = _ITEM.match(item)
            if not m:
                raise ValueError(f"can't read host {item!r}: write NAME:RANKS (node1:4) or "
                                 f"NAME[GPUS] (node1[0,1])")
            name, count, gpus = m.groups()
            pairs.append((name, int(count) if count is not None else None,
                          _gpu_list(name, gpus) if gpus is not None else None))
    elif isinstance(hosts, dict):
        if not hosts:
            raise ValueError("hosts is empty: give hosts like {'node1': 4, 'node2': 4}")
        for name, what in hosts.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"host names must be strings, got {name!r}")
            if isinstance(what, int) and not isinstance(what, bool):
                pairs.append((name, what, None))
            elif isinstance(what, (list, tuple)):
                pairs.append((name, None, _gpu_list(name, ",".join(str(g) for g in what))))
            else:
                raise ValueError(f"host {name!r}: give a number of ranks or a list of GPU ids, got {what!r}")
    else:
        raise ValueError(f"hosts must be a string like 'node1:4,node2:4' or a dict, got {type(hosts).__name__}")
    out, seen = [], set()
    for name, count, gpus in pairs:
        if count is not None and count < 1:
            raise ValueError(f"host {name!r} needs at least one rank, got {count}")
        if name in seen:
            raise ValueError(f"host {name!r} is listed twice")
        seen.add(name)
        out.append(Host(name, count if gpus is None else len(gpus), gpus, is_local(name)))
    if sum(h.local for h in out) > 1:
        raise ValueError("the notebook's host is listed twice (as localhost and by name)")
    return out


def host_qualified(gpus) -> bool:
    """-g 'node1:0,1 node2:2,3': GPUs named per host (GPU and MIG ids have no ':')."""
    return isinstance(gpus, str) and ":" in gpus


def with_gpus(hosts, gpus) -> str:
    """--hosts plus -g, as one host list ('node1[0,1] node2[0,1]'):

        hosts='node1,node2', gpus='0,1' (or [0, 1])       the same GPUs on every host
        hosts='node1,node2', gpus='node1:0,1 node2:2,3'   each host's own
        hosts=None,          gpus='node1:0,1 node2:2,3'   the hosts are the ones -g names

    GPU numbers on another host are its own indices (ddip can't see its CUDA_VISIBLE_DEVICES)."""
    names = None
    if hosts is not None:
        if not isinstance(hosts, str):
            raise ValueError("with gpus=, give hosts= as names ('node1,node2'); a dict says each host's "
                             "GPUs itself: {'node1': [0, 1]}")
        names = _split_items(hosts)
        for name in names:
            if not re.fullmatch(r"[A-Za-z0-9_.:\-]+", name) or re.search(r":\d+$", name):
                raise ValueError(f"with -g, list the hosts by name only (node1,node2), got {name!r}; "
                                 f"-g says their GPUs")
        if not names:
            raise ValueError("hosts is empty: give hosts like 'node1,node2'")
    if host_qualified(gpus):
        per_host = {}
        for item in re.split(r"[\s;]+", gpus.strip()):
            name, _, ids = item.rpartition(":")
            if not name or not ids:
                raise ValueError(f"can't read -g {item!r}: write HOST:GPUS for each host, e.g. "
                                 f"'node1:0,1 node2:2,3'")
            if name in per_host:
                raise ValueError(f"-g names host {name!r} twice")
            per_host[name] = _gpu_list(name, ids)
        if names is not None and sorted(per_host) != sorted(names):
            raise ValueError(f"-g names the hosts {', '.join(per_host)} but --hosts lists {', '.join(names)}; "
                             f"give each host's GPUs once")
        order = names if names is not None else list(per_host)
        return " ".join(f"{name}[{','.join(per_host[name])}]" for name in order)
    if names is None:
        raise ValueError("gpus= without hosts= is one host's; for several, write -g 'node1:0,1 node2:2,3'")
    if isinstance(gpus, str):
        text = gpus
    elif isinstance(gpus, (list, tuple)) and gpus:
        text = ",".join(str(g) for g in gpus)
    else:
        raise ValueError(f"gpus must be a list of GPU ids like 0,1, got {gpus!r}")
    if text.strip() == "all":
        raise ValueError("-g all can't count the GPUs of other hosts from here; list them, e.g. -g 0,1,2,3")
    ids = _gpu_list(names[0], text)
    return " ".join(f"{name}[{','.join(ids)}]" for name in names)


def source_address(host: str) -> str:
    """The address of this machine that routes to `host`: a UDP connect() sends nothing, but
    makes the kernel choose the route and so the source address."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise ValueError(f"can't resolve host {host!r} ({exc}); check the name, or give its address") from None
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(addr)
                return s.getsockname()[0]
            except OSError:
                continue
    raise ValueError(f"no route to host {host!r}; pass bind= (--bind) with this machine's address on "
                     f"the network the hosts share")


def check_bind(address: str) -> str:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in address else socket.AF_INET, address)
    except OSError:
        raise ValueError(f"bind must be an IP address of this machine, got {address!r}") from None
    return address


def agent_command(python: str) -> list[str]:
    return [python, "-m", "ddip.remote"]


def launcher_argv(launcher: str | None, host: str, python: str) -> list[str]:
    """The command, run here, that starts ddip's agent on `host`."""
    command = agent_command(python)
    launcher = (launcher or "ssh").strip()
    if "{command}" in launcher or "{host}" in launcher:
        if "{command}" not in launcher or "{host}" not in launcher:
            raise ValueError("a launcher template needs both {host} and {command}, e.g. "
                             "'docker exec -i {host} {command}'")
        text = launcher.replace("{host}", shlex.quote(host)).replace("{command}", shlex.join(command))
        return ["/bin/sh", "-c", text]
    words = shlex.split(launcher)
    kind, extra = words[0], words[1:]
    if kind == "ssh":
        # BatchMode: never a password prompt the notebook can't answer. The remote shell runs
        # the command string; exec leaves no shell between sshd and the agent.
        return ["ssh", "-T", "-o", "BatchMode=yes", *extra, host, "exec " + shlex.join(command)]
    if kind in ("slurm", "srun"):
        return srun_argv(host, command, extra)
    raise ValueError(f"launcher must be 'ssh', 'slurm' or a template with {{host}} and {{command}}, "
                     f"got {launcher!r}")


def srun_argv(host: str, command: list[str], extra: list[str] = (), env=None) -> list[str]:
    """One job step on `host` with one task (the agent), allowed to share the allocation with
    the other hosts' steps, with the node's CPUs (the agent's workers run inside the step): the
    CPUs every node of the job has (SLURM_JOB_CPUS_PER_NODE, "8(x2)"), and no count when the
    nodes differ (srun would refuse a step asking a small node for a big node's CPUs)."""
    env = os.environ if env is None else env
    argv = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap",
            "--kill-on-bad-exit=1", "--job-name=ddip"]
    counts = {item.split("(")[0] for item in env.get("SLURM_JOB_CPUS_PER_NODE", "").split(",") if item}
    if len(counts) == 1 and next(iter(counts)).isdigit():
        argv.append(f"--cpus-per-task={next(iter(counts))}")
    return [*argv, *extra, *command]


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
    """Where each rank (slot) runs, and what its environment says about it."""

    hosts: list[Host]
    launcher: str | None
    python: str
    bind: str
    master_addr: str
    slot_host: list[int]  # slot -> index in hosts
    local_rank: list[int]

    @property
    def size(self) -> int:
        return len(self.slot_host)

    def slots_of(self, h: int) -> list[int]:
        return [s for s, hh in enumerate(self.slot_host) if hh == h]

    def remote(self, slot: int) -> bool:
        return not self.hosts[self.slot_host[slot]].local

    def gpus(self, slot: int) -> list[str] | None:
        return self.hosts[self.slot_host[slot]].gpus

    def env(self, slot: int) -> dict:
        host = self.hosts[self.slot_host[slot]]
        env = {"LOCAL_RANK": str(self.local_rank[slot]), "LOCAL_WORLD_SIZE": str(host.ranks),
               "MASTER_ADDR": self.master_addr, "DDIP_HOST": host.name}
        env["CUDA_VISIBLE_DEVICES"] = ",".join(host.gpus) if host.gpus else ""
        return env

    def launchers(self) -> list[tuple[str, list[str], list[int]]]:
        """(host name, launcher argv, slots) for each remote host."""
        return [(h.name, launcher_argv(self.launcher, h.name, self.python), self.slots_of(i))
                for i, h in enumerate(self.hosts) if not h.local]

    def master_port(self, local_free_port) -> int:
        if self.hosts[0].local:
            return local_free_port(self.bind)
        return random.randint(*REMOTE_MASTER_PORTS)


def layout(hosts, launcher=None, python=None, bind=None) -> Layout:
    """Checks everything (bad input changes nothing) and lays the ranks out host by host."""
    if launcher is not None and not isinstance(launcher, str):
        raise ValueError(f"launcher must be 'ssh', 'slurm' or a template string, got {launcher!r}")
    if hosts is None and launcher is not None and launcher.split()[0] in ("slurm", "srun"):
        raise ValueError("launcher='slurm' needs hosts= too (the ranks per node), e.g. hosts=ddip.hosts."
                         "slurm_hosts() as {name: 4 for name in ...}")
    parsed = parse_hosts(hosts)
    remote = [h for h in parsed if not h.local]
    python = python or sys.executable
    if not isinstance(python, str) or not python:
        raise ValueError(f"python must be the path of the Python to run on the hosts, got {python!r}")
    if bind is not None:
        bind = check_bind(bind)
    elif remote:
        bind = source_address(remote[0].name)
    else:
        bind = "127.0.0.1"
    for h in remote:  # fail now, not once ranks are starting
        launcher_argv(launcher, h.name, python)
    first = parsed[0]
    master_addr = bind if first.local else first.name
    if first.local and not remote:
        master_addr = "127.0.0.1"
    slot_host, local_rank = [], []
    for i, h in enumerate(parsed):
        for r in range(h.ranks):
            slot_host.append(i)
            local_rank.append(r)
    return Layout(parsed, launcher, python, bind, master_addr, slot_host, local_rank)
