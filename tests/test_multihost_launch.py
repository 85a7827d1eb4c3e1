"""`ddip.ranch(..., hosts=...)` and `%%diprun --hosts` across hosts: the notebook (this test
process) is rank 0 here, its children run on the two network-namespace hosts of
tests/test_multihost.py (each with its own sshd), and the cell's script of `%%diprun` travels
with the launch. Also, without root, a "host" reached by a launcher command that runs its
agent right here.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import threading

import cloudpickle
import pytest

import ddip
from conftest import Tee, alive, children_of, wait_until
from ddip.errors import strip_ansi
from test_multihost import hosts, needs_netns  # noqa: F401  (the module's own Hosts fixture)

# Functions here travel by value, as a notebook's do: children never import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

HERE = "exec {command} # {host}"  # a "host" whose agent runs right here, over loopback TCP


def _netns_pids(hosts) -> list[int]:
    """Processes in the test hosts' network namespaces, besides their sshd listeners."""
    inodes = {os.stat(f"/run/netns/{ns}").st_ino for ns in hosts.ns.values()}
    keep = {p.pid for p in hosts.sshd}
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in keep:
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes and alive(int(entry)):
                out.append(int(entry))
        except OSError:
            continue
    return out


def _proc(pid: int) -> tuple[int, bytes, int]:
    """(parent, command line, threads) of `pid`."""
    with open(f"/proc/{pid}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read()
    return ppid, cmd, len(os.listdir(f"/proc/{pid}/task"))


def _ranks_left(hosts) -> list[int]:
    """What _netns_pids finds besides each host's standing agent (docs/warm.md, "Other hosts"),
    which stays after a launch, by design: the agent, the sshd session it runs under, and its
    rank template (single-threaded; a rank forked from it has the same command line, and threads)."""
    left = _netns_pids(hosts)
    info = {}
    for pid in left:
        try:
            info[pid] = _proc(pid)
        except (OSError, ValueError, IndexError):
            pass
    agents = {pid for pid, (_, cmd, _) in info.items() if b"ddip.remote" in cmd}
    standing = set(agents)
    for agent in agents:
        up = info[agent][0]
        while up in info and info[up][1].startswith(b"sshd"):
            standing.add(up)
            up = info[up][0]
    standing |= {pid for pid, (ppid, cmd, threads) in info.items()
                 if ppid in agents and b"ddip.template.main()" in cmd and threads == 1}
    return [pid for pid in left if pid not in standing]


def where_am_i(scale):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(os.environ["RANK"]) + 1])
    dist.all_reduce(t)
    e = os.environ
    print("rank", e["RANK"], "on", e["DDIP_HOST"], flush=True)
    return (int(t.item()) * scale, dist.get_rank(), dist.get_world_size(), e["MASTER_ADDR"], e["LOCAL_RANK"],
            e["LOCAL_WORLD_SIZE"], e["DDIP_HOST"], os.getpid())


@needs_netns
@pytest.mark.timeout(180)
def test_ranch_across_hosts_all_reduces_with_the_notebook_as_rank_0(hosts, monkeypatch):
    a, b = hosts.addr["A"], hosts.addr["B"]
    # gloo's interface: the notebook's namespace reaches the hosts through its own veth.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", hosts.root_if)
    tee = Tee()
    monkeypatch.setattr(sys, "stdout", tee)
    before = children_of(os.getpid())
    res = ddip.ranch(None, where_am_i, 2, ctx=ddip.TorchDDPCtx(), hosts={"localhost": 1, a: 1, b: 2},
                     launcher=hosts.launcher, env={"GLOO_SOCKET_IFNAME": "ddip0"})
    # 1 + 2 + 3 + 4, on every rank; MASTER_ADDR is the address the hosts reach the notebook at.
    assert [r[:7] for r in res] == [(20, 0, 4, hosts.me, "0", "1", "localhost"), (20, 1, 4, hosts.me, "0", "1", a),
                                    (20, 2, 4, hosts.me, "0", "2", b), (20, 3, 4, hosts.me, "1", "2", b)]
    assert res[0][7] == os.getpid()  # the notebook is rank 0
    for r, host in ((1, a), (2, b), (3, b)):
        assert f"[rank {r}] rank {r} on {host}\n" in tee.text, tee.text
    assert "rank 0 on localhost\n" in tee.text
    # No rank left on either host; each keeps its standing agent (and rank template) for the next
    # launch, until the notebook lets the hosts go: then nothing is left, here or there.
    assert wait_until(lambda: not _ranks_left(hosts), 15), _ranks_left(hosts)
    # torchddp_launch takes the same hosts: rank 0's value.
    own = ddip.torchddp_launch(None, where_am_i, 1, hosts=f"localhost:1,{b}:1", launcher=hosts.launcher,
                               env={"GLOO_SOCKET_IFNAME": "ddip0"})
    assert own[:3] == (3, 0, 2) and own[7] == os.getpid()
    assert wait_until(lambda: not _ranks_left(hosts), 15), _ranks_left(hosts)
    assert ddip.hosts.release() == 2
    assert children_of(os.getpid()) <= before
    assert wait_until(lambda: not _netns_pids(hosts), 15), _netns_pids(hosts)


def fail_on_rank_3():
    import time

    import torch
    import torch.distributed as dist

    if os.environ["RANK"] == "3":
        time.sleep(0.5)
        raise ValueError("bad batch on rank 3")
    dist.all_reduce(torch.ones(1))  # waits for rank 3 (gloo's own timeout is 30 min)


@needs_netns
@pytest.mark.timeout(180)
def test_ranch_a_remote_rank_failing_is_named_with_its_host_and_stops_every_host(hosts, monkeypatch):
    a, b = hosts.addr["A"], hosts.addr["B"]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", hosts.root_if)
    with pytest.raises(ddip.RemoteError) as ei:
        ddip.ranch(4, fail_on_rank_3, ctx=ddip.TorchDDPCtx(), hosts=f"localhost:1,{a}:1,{b}:2",
                   launcher=hosts.launcher, env={"GLOO_SOCKET_IFNAME": "ddip0"})
    first = ei.value.failures[0]
    assert first.rank == 3 and first.ename == "ValueError", str(ei.value)
    assert first.evalue == f"bad batch on rank 3 (on {b})"
    assert "bad batch on rank 3" in strip_ansi("\n".join(first.traceback)), first.traceback
    assert str(ei.value).splitlines()[0].endswith(f"root cause on rank 3: ValueError: bad batch on rank 3 (on {b})")
    assert sorted(f.rank for f in ei.value.failures) == [0, 1, 2, 3]
    assert wait_until(lambda: not _ranks_left(hosts), 15), _ranks_left(hosts)


def sleep_in_children():
    import time

    if os.environ["RANK"] != "0":
        print("child sleeping", flush=True)
        time.sleep(120)
    return "notebook done"


@needs_netns
@pytest.mark.timeout(120)
def test_ranch_ctrl_c_in_the_notebook_stops_the_children_on_every_host(hosts, monkeypatch):
    a, b = hosts.addr["A"], hosts.addr["B"]
    tee = Tee("[rank 1] child sleeping\n", "[rank 2] child sleeping\n")
    monkeypatch.setattr(sys, "stdout", tee)
    main = threading.get_ident()

    def press_ctrl_c():
        if tee.seen.wait(60):
            signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=press_ctrl_c)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ddip.ranch(3, sleep_in_children, hosts=f"localhost:1,{a}:1,{b}:1", launcher=hosts.launcher,
                       collapse=False)  # each child's line, as the tee waits for it
    finally:
        t.join()
    assert tee.seen.is_set()
    assert wait_until(lambda: not _ranks_left(hosts), 15), _ranks_left(hosts)


def rank_env():
    e = os.environ
    return (e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["WORLD_SIZE"], e["MASTER_ADDR"],
            e.get("DDIP_HOST"), e.get("EXTRA"), os.getpid())


def test_ranch_with_this_machine_and_a_launcher_command_host():
    # Two ranks here (the notebook and a child), two behind a launcher that runs the agent here.
    before = children_of(os.getpid())
    res = ddip.ranch(4, rank_env, hosts={"localhost": 2, "here": 2}, launcher=HERE, bind="127.0.0.1",
                     env={"EXTRA": "x"})
    assert [r[:6] for r in res] == [("0", "0", "2", "4", "127.0.0.1", "localhost"),
                                    ("1", "1", "2", "4", "127.0.0.1", "localhost"),
                                    ("2", "0", "2", "4", "127.0.0.1", "here"),
                                    ("3", "1", "2", "4", "127.0.0.1", "here")]
    assert res[0][7] == os.getpid() and len({r[7] for r in res}) == 4
    assert [r[6] for r in res] == [os.environ.get("EXTRA"), "x", "x", "x"]  # env= is the children's
    assert all(wait_until(lambda p=r[7]: not alive(p), 10) for r in res[1:])
    # That host's standing agent stays for the next launch, until the hosts are let go.
    assert ddip.hosts.release() == 1
    assert children_of(os.getpid()) <= before


def place_env():
    e = os.environ
    return tuple(e.get(k) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                    "ROLE_RANK", "WORLD_SIZE", "DDIP_HOST"))


def test_the_notebook_on_the_second_host_gets_its_place_there_from_the_plan():
    # The notebook plays rank 1, the first rank of the second host: its environment is that
    # host's (GROUP_RANK 1, LOCAL_RANK 0), as the children's are, and is put back afterwards.
    saved = dict(os.environ)
    res = ddip.ranch(3, place_env, caller_rank=1, hosts="here:1,localhost:2", launcher=HERE, bind="127.0.0.1")
    assert res == [("0", "0", "1", "0", "2", "0", "3", "here"),
                   ("1", "0", "2", "1", "2", "1", "3", "localhost"),
                   ("2", "1", "2", "1", "2", "2", "3", "localhost")]
    assert dict(os.environ) == saved
    assert ddip.hosts.release() == 1


def gloo_sum():
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(os.environ["RANK"]) + 1])
    dist.all_reduce(t)
    return int(t.item())


def test_torchddp_launch_with_a_launcher_command_host_and_caller_rank_none():
    assert ddip.torchddp_launch(None, gloo_sum, hosts="localhost:1,here:1", launcher=HERE, bind="127.0.0.1") == 3
    # Every rank a child: the host list need not start with this machine. (MASTER_ADDR is then
    # rank 0's host as written: a loopback address that is not this machine's name.)
    assert ddip.ranch(None, gloo_sum, caller_rank=None, ctx=ddip.TorchDDPCtx(), hosts="127.0.0.2:2",
                      launcher=HERE, bind="127.0.0.1") == [3, 3]


def raise_on_rank_1():
    if os.environ["RANK"] == "1":
        raise KeyError("missing on rank 1")
    import time

    time.sleep(60)


@pytest.mark.timeout(60)
def test_ranch_names_the_host_of_a_failing_child_behind_a_launcher():
    with pytest.raises(ddip.RemoteError) as ei:
        ddip.ranch(2, raise_on_rank_1, hosts="localhost:1,here:1", launcher=HERE, bind="127.0.0.1")
    first = ei.value.failures[0]
    assert first.rank == 1 and first.ename == "KeyError" and first.evalue == "'missing on rank 1' (on here)"
    assert ei.value.failures[1].rank == 0 and ei.value.failures[1].ename == "Stopped"
    assert ei.value.failures[1].kind == ddip.FailureKind.STOPPED


def test_ranch_across_hosts_bad_input_starts_nothing():
    before = children_of(os.getpid())
    cases = [
        (dict(nprocs=3, hosts="localhost:1,here:1"), "nprocs=3, but hosts= lists 2 ranks"),
        (dict(nprocs=None, hosts="here:1,localhost:1"), "list this machine first"),
        (dict(nprocs=None, hosts="localhost:1,here:1", caller_rank=1), "puts rank 1 on here"),
        (dict(nprocs=2, launcher="ssh"), "give hosts= too"),
        (dict(nprocs=None, hosts="localhost:1,here:1", env={"A": 1}), "env must be a dict of strings"),
        (dict(nprocs=None, hosts={"localhost": 1, "here": 0}), "here"),
        (dict(nprocs=None, hosts="localhost,here", ctx=ddip.TorchDDPCtx(), gpus=[0]), "TorchDDPCtx across hosts"),
        (dict(nprocs=None, hosts="localhost:1,here:1", gpus=[0]), "list the hosts by name only"),
    ]
    for kwargs, words in cases:
        nprocs = kwargs.pop("nprocs")
        with pytest.raises(ValueError) as ei:
            ddip.ranch(nprocs, rank_env, launcher=kwargs.pop("launcher", HERE), bind="127.0.0.1", **kwargs) \
                if "hosts" in kwargs else ddip.ranch(nprocs, rank_env, **kwargs)
        assert words in str(ei.value), (kwargs, str(ei.value))
    assert children_of(os.getpid()) == before


# -- files that travel with the launch: `ddip run --ship`, `%%diprun --hosts` ----------------------

DDIP = os.path.join(os.path.dirname(sys.executable), "ddip")

SHIPPED = """
import hashlib, os, sys
data = open(sys.argv[1], "rb").read()
print("rank", os.environ["RANK"], "file", __file__, "data", sys.argv[1], hashlib.sha256(data).hexdigest(), flush=True)
"""


def _lines(out: str) -> list[str]:
    return sorted(l for l in out.splitlines() if l.strip())


def test_ddip_run_ships_files_to_another_host_and_removes_them(tmp_path):
    import hashlib

    here = tmp_path / "here"
    here.mkdir()
    (here / "script.py").write_text(SHIPPED)
    data = os.urandom(3 << 20)  # far more than a pipe or a command line holds
    (here / "data.bin").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    host_tmp = tmp_path / "host-tmp"  # the other host's TMPDIR, where its ddip run puts the copies
    host_tmp.mkdir()
    p = subprocess.run([DDIP, "run", "--hosts", "localhost:1,here:2", "--launcher", HERE, "--master-addr", "127.0.0.1",
                        "--ship", "script.py", "--ship", str(here / "data.bin"), "--",
                        sys.executable, "script.py", str(here / "data.bin")],
                       cwd=here, capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(host_tmp)})
    assert p.returncode == 0, p.stderr
    lines = _lines(p.stdout)
    assert lines[0] == f"[0] rank 0 file {here}/script.py data {here}/data.bin {digest}", p.stdout
    copies = {l.split()[4].rsplit("/", 1)[0] for l in lines[1:]}
    assert len(copies) == 1 and copies.pop().startswith(f"{host_tmp}/ddip-run-"), lines
    for r, line in ((1, lines[1]), (2, lines[2])):
        _, _, rank, _, file, _, data_path, got = line.split()
        assert (rank, os.path.basename(file), os.path.basename(data_path), got) == (str(r), "script.py", "data.bin", digest)
    assert os.listdir(host_tmp) == []  # the copies went with the host's ranks


def test_ddip_run_ship_bad_input_is_a_usage_error(tmp_path):
    (tmp_path / "a.py").write_text("pass\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.py").write_text("pass\n")
    for args, words in ((["--hosts", "localhost:1,here:1", "--ship", "missing.py"], "can't ship missing.py: No such file"),
                        (["--hosts", "localhost:1,here:1", "--ship", "a.py", "--ship", "sub/a.py"], "two files named a.py"),
                        (["-n", "1", "--ship", "a.py"], "--ship: requires --hosts")):
        p = subprocess.run([DDIP, "run", "--check", *args, "--launcher", HERE, "--", sys.executable, "a.py"]
                           if "--hosts" in args else [DDIP, "run", *args, "--", sys.executable, "a.py"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and words in p.stderr, (args, p.stderr)


def _mount_ns(pid) -> int:
    return os.stat(f"/proc/{pid}/ns/mnt").st_ino


@needs_netns
@pytest.mark.timeout(300)
def test_diprun_hosts_ships_the_cell_to_hosts_that_cannot_see_it(hosts, tmp_path, monkeypatch):
    from test_magics import running_kernel

    a, b = hosts.addr["A"], hosts.addr["B"]
    # The kernel's temporary files (the cell's script among them) go to a directory that the
    # hosts see empty: a tmpfs over it in their sshd's own mount namespace (ip netns exec makes
    # one), so nothing a rank there runs can come from this machine's copy.
    private = tmp_path / "kernel-tmp"
    private.mkdir()
    if any(_mount_ns(p.pid) == _mount_ns("self") for p in hosts.sshd):
        pytest.skip("the hosts' sshd shares this mount namespace")
    hidden = []
    try:
        for p in hosts.sshd:
            subprocess.run(["nsenter", "-t", str(p.pid), "-m", "mount", "-t", "tmpfs", "-o", "size=1m", "ddip-test",
                            str(private)], check=True, capture_output=True)
            hidden.append(p.pid)
        monkeypatch.setenv("TMPDIR", str(private))
        with running_kernel(tmp_path / "jupyter") as kernel:
            cell = kernel.run(textwrap.dedent(f"""\
                %%diprun --hosts {a}:1,{b}:2 --launcher "{hosts.launcher}"
                import os
                print("rank", os.environ["RANK"], "group", os.environ["GROUP_RANK"], "sees", os.listdir({str(private)!r}),
                      "file", __file__, flush=True)
                """), timeout=180)
            assert cell.ok, cell.outputs
            lines = _lines(cell.stream())
            assert [l.split(" file ")[0] for l in lines] == ["[0] rank 0 group 0 sees []", "[1] rank 1 group 1 sees []",
                                                             "[2] rank 2 group 1 sees []"], cell.outputs
            copies = {l.split(" file ")[1] for l in lines}
            assert all(c.startswith("/tmp/ddip-run-") and c.endswith("/cell.py") for c in copies), copies
            assert len(copies) == 2  # one private directory per host
            assert os.listdir(private) == []  # the magic's own file is gone too
        assert not any(os.path.exists(os.path.dirname(c)) for c in copies)  # nothing left on the hosts
        assert wait_until(lambda: not _netns_pids(hosts), 15), _netns_pids(hosts)
    finally:
        for pid in hidden:
            subprocess.run(["nsenter", "-t", str(pid), "-m", "umount", str(private)], capture_output=True)
