"""`ddip run`, the native launcher: the installed command on real scripts, and %%diprun through a
real kernel.

Every launcher a test starts is waited for and, if a test fails midway, killed by pid; ranks die
with their launcher (PR_SET_PDEATHSIG), and tests that learn the ranks' pids check they are gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import alive, children_of, wait_until
from fake_nvidia_smi import fake_gpus  # noqa: F401  (a fixture)

from conftest import DDIP, TORCHRUN_IS_THE_REFERENCE  # noqa: E402
PY = sys.executable


@pytest.fixture
def launcher():
    """start(args, **popen) -> Popen of `ddip ARGS`; whatever is still running at the end is
    killed by pid."""
    started = []

    def start(args, env=None, **kw):
        full_env = dict(os.environ)
        full_env.update(env or {})
        p = subprocess.Popen([DDIP, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, text=True, env=full_env, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate()


def run(launcher, args, timeout=60, **kw):
    p = launcher(args, **kw)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def rank_log(logs: Path, rank: int, stream: str = "stdout", attempt: int = 0) -> Path:
    """A rank's log file in torchrun's --log-dir layout: <dir>/<run id>_<random>/attempt_<n>/<local rank>/."""
    jobs = list(logs.iterdir())
    assert len(jobs) == 1, jobs
    return jobs[0] / f"attempt_{attempt}" / str(rank) / f"{stream}.log"


def script(tmp_path, body: str, name="rank.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def by_rank(text: str) -> dict[int, list[str]]:
    """Labelled lines grouped by rank, label removed; fails on any unlabelled line. A line several
    ranks printed alike, shown once ("[0-2,5] text", ddip.repeats' rule), counts for each."""
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = re.fullmatch(r"\[([\d,-]+)\] (.*)", line)
        assert m, f"line without a rank label: {line!r}"
        for part in m.group(1).split(","):
            first, _, last = part.partition("-")
            for rank in range(int(first), int(last or first) + 1):
                out.setdefault(rank, []).append(m.group(2))
    return out


ENV_SCRIPT = """
    import json, os
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED", "GROUP_RANK", "ROLE_RANK"]
    env = {k: os.environ.get(k) for k in keys}
    env["elastic"] = sorted(k for k in os.environ if k.startswith("TORCHELASTIC"))
    env["stdin"] = os.readlink("/proc/self/fd/0")
    env["pgid_is_pid"] = os.getpgid(0) == os.getpid()
    print(json.dumps(env))
"""


ELASTIC_VARIABLES = ["TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                     "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
                     "TORCHELASTIC_ERROR_FILE"]


def rank_envs(out: str) -> dict[int, dict]:
    return {r: json.loads(lines[0]) for r, lines in by_rank(out).items()}


def test_environment_per_rank(launcher, tmp_path):
    code, out, err = run(launcher, ["run", "-n", "3", PY, script(tmp_path, ENV_SCRIPT)],
                         env={"TORCHELASTIC_RUN_ID": "outer", "OMP_NUM_THREADS": ""})
    assert code == 0, err
    assert err == ""
    envs = rank_envs(out)
    assert sorted(envs) == [0, 1, 2]
    ports = {e["MASTER_PORT"] for e in envs.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for r, e in envs.items():
        assert e["RANK"] == e["LOCAL_RANK"] == e["ROLE_RANK"] == str(r)
        assert e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == "3"
        assert e["GROUP_RANK"] == "0"
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert e["OMP_NUM_THREADS"] == ""  # set by the user (even empty): left alone
        assert e["PYTHONUNBUFFERED"] == "1"
        # torchrun's, set by ddip run itself (the inherited run id is not this launch's).
        assert e["elastic"] == sorted(ELASTIC_VARIABLES)
        assert e["stdin"] == "/dev/null"
        assert e["pgid_is_pid"]  # each rank leads its own process group


def test_omp_threads_default(launcher, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    path = script(tmp_path, ENV_SCRIPT)
    p = subprocess.run([DDIP, "run", "-n", "2", PY, path], capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    # The one thread rule, as in groups: this host's cores divided among its ranks, at least 1.
    cores = len(os.sched_getaffinity(0))
    assert {e["OMP_NUM_THREADS"] for e in rank_envs(p.stdout).values()} == {str(max(1, cores // 2))}
    assert p.stderr == ""  # and nothing said about it
    p = subprocess.run([DDIP, "run", "-n", "1", PY, path], capture_output=True, text=True, env=env,
                       timeout=60)
    assert rank_envs(p.stdout)[0]["OMP_NUM_THREADS"] == str(cores)


def test_gpus_are_positions_in_the_visible_list(launcher, tmp_path, fake_gpus):
    fake_gpus(8)  # CUDA_VISIBLE_DEVICES can only hide GPUs the machine has
    path = script(tmp_path, ENV_SCRIPT)
    code, out, err = run(launcher, ["run", "--gpus", "2,0", PY, path],
                         env={"CUDA_VISIBLE_DEVICES": "4,6,7"})
    assert code == 0, err
    envs = rank_envs(out)
    assert {r: e["CUDA_VISIBLE_DEVICES"] for r, e in envs.items()} == {0: "7,4", 1: "7,4"}
    assert {e["WORLD_SIZE"] for e in envs.values()} == {"2"}
    code, out, err = run(launcher, ["run", "--gpus", "GPU-8f2e,0", PY, path],
                         env={"CUDA_VISIBLE_DEVICES": "4,GPU-8f2e"})
    assert code == 0, err
    assert rank_envs(out)[1]["CUDA_VISIBLE_DEVICES"] == "GPU-8f2e,4"


def test_gpu_outside_the_visible_list_is_a_clear_error(launcher, tmp_path, fake_gpus):
    fake_gpus(8)
    marker = tmp_path / "started"
    code, out, err = run(launcher, ["run", "--gpus", "0,2", "touch", str(marker)],
                         env={"CUDA_VISIBLE_DEVICES": "4,6"})
    assert code == 2
    assert ("GPU 2 is not visible: ddip run sees 2 GPUs (CUDA_VISIBLE_DEVICES=4,6): give positions "
            "0-1, 'all', or their UUIDs") in err
    assert not marker.exists() and out == ""


@pytest.mark.skipif(Path("/proc/driver/nvidia/gpus").exists(), reason="this machine has NVIDIA GPUs")
def test_gpus_without_any_gpu_is_an_error_as_in_groups(launcher, tmp_path):
    # One answer everywhere: Group, ranch, %makedip -g and ddip run --gpus all say there is no GPU.
    marker = tmp_path / "started"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    p = subprocess.run([DDIP, "run", "--gpus", "0,1", "touch", str(marker)], capture_output=True,
                       text=True, env=env, timeout=60)
    assert p.returncode == 2
    assert "GPU 0 is not visible: this machine has no NVIDIA GPU; for CPU processes, give -n 2" in p.stderr
    assert not marker.exists()


def ddip_plan_gpu_count() -> int:
    from ddip import _core

    return _core.plan.nvidia_device_count()  # what ddip run counts: the driver's list, or nvidia-smi's


@pytest.mark.skipif(ddip_plan_gpu_count() > 0, reason="this machine has NVIDIA GPUs")
def test_gpus_named_by_cuda_visible_devices_on_a_machine_without_any_is_an_error(tmp_path):
    # CUDA_VISIBLE_DEVICES hides GPUs, it can't add them: ddip run says what is visible and how to
    # run on CPU, and starts nothing.
    marker = tmp_path / "started"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"}
    p = subprocess.run([DDIP, "run", "--gpus", "1", "touch", str(marker)], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 2, p.stderr
    assert ("GPU 1 is not visible: ddip run sees no GPU: its CUDA_VISIBLE_DEVICES='0,1' names GPUs, but this "
            "machine has no NVIDIA GPU; for CPU processes, give -n 2 (for example) instead of --gpus") in p.stderr
    assert not marker.exists() and p.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["run", "-n", "2", "--gpus", "0", "true"], "excludes"),
    (["run", "-n", "0", "true"], "not in range"),
    (["run", "-n", "2"], "COMMAND is required"),
    (["run", "--show", "3", "-n", "2", "true"], "there is no rank 3"),
    (["run", "--bogus", "true"], "--bogus"),
])
def test_usage_errors(launcher, args, message):
    code, out, err = run(launcher, args)
    assert code == 2
    assert message in err
    assert "--help" in err


def test_help_documents_every_flag(launcher):
    code, out, _ = run(launcher, ["run", "--help"])
    assert code == 0
    for flag in ("-n,--nproc-per-node", "--gpus", "--show", "-t,--tee", "-r,--redirects", "--log-dir",
                 "--timeout", "--nnodes", "--standalone", "-m,--module", "--no-python", "COMMAND"):
        assert flag in out
    # What reaches the ranks besides their output: the signals forwarded, torchrun's variables.
    assert "Ctrl-C (SIGINT), SIGTERM and SIGHUP (a closed terminal) are forwarded" in out
    assert "TORCHELASTIC_ERROR_FILE" in out


def test_command_that_does_not_exist(launcher):
    # Looked up before any rank starts (issue 32 item 7): a usage error naming the 127 or 126 every
    # rank would have exited with.
    code, out, err = run(launcher, ["run", "-n", "2", "no-such-command-ddip"])
    assert code == 2 and out == ""
    assert "COMMAND: no-such-command-ddip: no such program on PATH and no such file" in err
    assert "127, not found" in err
    code, out, err = run(launcher, ["run", "-n", "2", "--no-python", "/etc/passwd"])  # not executable
    assert code == 2 and "COMMAND: /etc/passwd is not executable; every rank would exit with 126" in err


NOISY = """
    import os, sys
    r = int(os.environ["RANK"])
    for i in range({lines}):
        pad = "x" * (i % 300)
        print(f"rank {{r}} line {{i}} {{pad}}")
        if i % 7 == 0:
            print(f"rank {{r}} err {{i}} {{pad}}", file=sys.stderr)
"""


def check_noisy(text: str, ranks: list[int], lines: int, kind: str, step: int = 1):
    got = by_rank(text)
    assert sorted(got) == ranks
    for r in ranks:
        want = [f"rank {r} {kind} {i} {'x' * (i % 300)}" for i in range(0, lines, step)]
        assert got[r] == want, f"rank {r}: {kind} lines differ"


def test_labelled_output_under_heavy_concurrent_printing(launcher, tmp_path):
    n, lines = 4, 20000
    logs = tmp_path / "logs"
    code, out, err = run(launcher, ["run", "-n", str(n), "--log-dir", str(logs), PY,
                                    script(tmp_path, NOISY.format(lines=lines))], timeout=120)
    assert code == 0, err[-2000:]
    # Every line whole, labelled with the rank that printed it, in that rank's order.
    check_noisy(out, list(range(n)), lines, "line")
    check_noisy(err, list(range(n)), lines, "err", step=7)
    # The log files hold each rank's output exactly as it wrote it, unlabelled.
    for r in range(n):
        stdout = rank_log(logs, r).read_text()
        assert stdout == "".join(f"rank {r} line {i} {'x' * (i % 300)}\n" for i in range(lines))
        stderr = rank_log(logs, r, "stderr").read_text()
        assert stderr == "".join(f"rank {r} err {i} {'x' * (i % 300)}\n" for i in range(0, lines, 7))


def test_show_chooses_ranks_log_dir_keeps_all(launcher, tmp_path):
    logs = tmp_path / "logs"
    path = script(tmp_path, NOISY.format(lines=50))
    code, out, err = run(launcher, ["run", "-n", "3", "--show", "0", "--log-dir", str(logs), PY, path])
    assert code == 0
    check_noisy(out, [0], 50, "line")
    check_noisy(err, [0], 50, "err", step=7)
    for r in range(3):
        assert rank_log(logs, r).read_text().count("\n") == 50
    code, out, err = run(launcher, ["run", "-n", "2", "--show", "none", PY, path])
    assert code == 0 and out == "" and err == ""


def test_rank_not_shown_is_still_reported(launcher, tmp_path):
    path = script(tmp_path, """
        import os, sys
        if os.environ["RANK"] == "1":
            print("hidden reason", file=sys.stderr)
            sys.exit(4)
    """)
    code, out, err = run(launcher, ["run", "-n", "2", "--show", "0", PY, path])
    assert code == 4
    assert "[1]" not in err  # its output itself stays hidden
    assert "rank 1 failed first: exit code 4" in err and "  | hidden reason" in err


def test_reader_going_away_does_not_stop_the_ranks(tmp_path):
    logs = tmp_path / "logs"
    path = script(tmp_path, """
        import time
        for i in range(2000):
            print("line", i)
            if i == 0:
                time.sleep(0.5)
    """)
    p = subprocess.Popen([DDIP, "run", "-n", "1", "--log-dir", str(logs), PY, path],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "[0] line 0\n"
        p.stdout.close()  # like `ddip run ... | head -1`
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err
    assert rank_log(logs, 0).read_text().count("\n") == 2000


def test_partial_lines_and_progress_bars(tmp_path):
    path = script(tmp_path, """
        import sys, time
        sys.stdout.write("10%\\r50%\\r100%\\n")
        sys.stdout.write("no newline at the end")
    """)
    p = subprocess.run([DDIP, "run", "-n", "1", PY, path], capture_output=True, timeout=60)
    assert p.returncode == 0
    assert p.stdout == b"[0] 10%\r[0] 50%\r[0] 100%\n[0] no newline at the end\n"


PIDS_THEN = """
    import os, signal, sys, time
    r = int(os.environ["RANK"])
    print("pid", os.getpid(), flush=True)
    {body}
"""


def rank_pids(out: str) -> list[int]:
    return [int(lines[0].split()[1]) for _, lines in sorted(by_rank(out).items())]


def test_first_failure_is_the_root_cause(launcher, tmp_path):
    path = script(tmp_path, PIDS_THEN.format(body="""
    if r == 1:
        time.sleep(0.5)
        print("something went wrong", file=sys.stderr)
        sys.exit(3)
    time.sleep(600)
    """))
    t0 = time.monotonic()
    code, out, err = run(launcher, ["run", "-n", "3", PY, path])
    assert code == 3
    assert time.monotonic() - t0 < 30
    assert "ddip run: rank 1 failed first: exit code 3" in err
    assert "  | something went wrong" in err
    assert "rank 0: killed by SIGTERM (stopped by ddip run)" in err
    assert "rank 2: killed by SIGTERM (stopped by ddip run)" in err
    assert err.index("rank 1 failed first") < err.index("rank 0: killed")
    assert not any(alive(p) for p in rank_pids(out))


def test_rank_killed_by_a_signal(launcher, tmp_path):
    path = script(tmp_path, PIDS_THEN.format(body="""
    if r == 0:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
    """))
    code, out, err = run(launcher, ["run", "-n", "2", PY, path])
    assert code == 128 + signal.SIGKILL
    assert "rank 0 failed first: killed by SIGKILL" in err
    assert not any(alive(p) for p in rank_pids(out))


ABORT_IN_EXIT_CPP = """
#include <thread>
// Returns with a joinable std::thread: std::terminate, as when one of torch's threads is left
// running as Python shuts down.
int main() { std::thread t([] {}); return 0; }
"""

ABORT_IN_EXIT_RANK = """
import os, sys, time
from pathlib import Path
pid_file, binary, rank0_code = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if os.environ["RANK"] == "1":
    pid_file.write_text(str(os.getpid()))
    os.execv(binary, [binary])
# Rank 0 ends after rank 1 has died, as a peer still in its own exit would.
deadline = time.monotonic() + 30
while not pid_file.exists() or Path("/proc", pid_file.read_text()).exists():
    assert time.monotonic() < deadline, "rank 1 did not die"
    time.sleep(0.05)
sys.exit(rank0_code)
"""


def test_a_rank_that_dies_in_torchs_exit_is_named_so(launcher, tmp_path):
    binary = tmp_path / "abort_in_exit"
    src = tmp_path / "abort_in_exit.cpp"
    src.write_text(ABORT_IN_EXIT_CPP)
    subprocess.run(["c++", "-std=c++17", "-pthread", "-o", str(binary), str(src)], check=True)
    path = tmp_path / "rank.py"
    path.write_text(ABORT_IN_EXIT_RANK)
    code, out, err = run(launcher, ["run", "-n", "2", PY, str(path), str(tmp_path / "pid0"), str(binary), "0"])
    assert code == 128 + signal.SIGABRT, err  # still a failure
    assert "ddip run: rank 1 failed first: killed by SIGABRT" in err
    assert "  | terminate called without an active exception" in err
    assert "  rank 0: exit code 0" in err, "rank 0 ended on its own: not stopped at once"
    assert ("ddip run: rank 1 died in torch's exit after its work was done: every other rank exited 0"
            in err)
    assert "torch.distributed.destroy_process_group()" in err and "accelerator.end_training()" in err
    # A peer that failed too: no evidence the work was done, so no such claim.
    code, out, err = run(launcher, ["run", "-n", "2", PY, str(path), str(tmp_path / "pid1"), str(binary), "1"])
    assert code == 128 + signal.SIGABRT, err
    assert "  rank 0: exit code 1" in err
    assert "died in torch's exit" not in err


# Aborts in Python's teardown, after the script and every atexit handler have run, as torch does
# when one of gloo's threads drops its tensors once Python has begun to shut down (an object of
# __main__ is finalized then). `how` ends the script first.
TEARDOWN_ABORT = """
import os, sys


class AbortsInTeardown:
    def __del__(self):
        os.write(2, b"terminate called without an active exception\\n")
        os.abort()


keep = AbortsInTeardown()
print("work done", flush=True)
how = sys.argv[1] if os.environ["RANK"] == "1" else "end"
if how == "exit":
    sys.exit(3)
if how == "raise":
    raise ValueError("bad batch")
if how == "raise-systemexit":
    raise SystemExit(4)
if how == "crash":
    os.abort()  # before the script's end: a crash
"""


@pytest.mark.parametrize("how,code", [("end", 0), ("exit", 3), ("raise", 1)])
def test_an_abort_in_pythons_teardown_ends_the_rank_as_its_script_ended(launcher, tmp_path, how, code):
    path = script(tmp_path, TEARDOWN_ABORT)
    plain = subprocess.run([PY, path, how], env=dict(os.environ, RANK="1"), capture_output=True)
    assert plain.returncode == -signal.SIGABRT  # as under torchrun: the process aborts
    got, out, err = run(launcher, ["run", "-n", "2", PY, path, how])
    assert got == code, err
    assert by_rank(out)[1] == ["work done"]  # rank 0 may be stopped before it prints
    if code == 0:
        assert "ddip run:" not in err, err
    else:
        assert f"ddip run: rank 1 failed first: exit code {code}" in err
        assert "SIGABRT" not in err
    if how == "raise":
        assert "  | ValueError: bad batch" in err


def test_an_abort_in_pythons_teardown_under_python_m_ends_the_rank_as_its_module_ended(launcher, tmp_path):
    (tmp_path / "teardown_abort.py").write_text(TEARDOWN_ABORT)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    got, out, err = run(launcher, ["run", "-n", "2", PY, "-m", "teardown_abort", "end"], env=env)
    assert got == 0, err
    # With -m, even `raise SystemExit(n)` is seen (runpy runs the module).
    got, out, err = run(launcher, ["run", "-n", "2", PY, "-m", "teardown_abort", "raise-systemexit"], env=env)
    assert got == 4, err
    got, out, err = run(launcher, ["run", "-n", "2", PY, "-m", "teardown_abort", "raise"], env=env)
    assert got == 1, err
    # runpy's frames, as without ddip: none of the hook's.
    assert "  |   File \"<frozen runpy>\", line" in err and "run_hook" not in err


@pytest.mark.parametrize("how", ["crash", "raise-systemexit", "hook-off"])
def test_an_abort_is_still_a_failure_where_the_script_had_not_ended_or_its_status_is_unknown(launcher, tmp_path, how):
    # A crash before the end; `raise SystemExit(n)` in a script run as a file, whose n Python
    # keeps to itself; a rank without ddip's hook.
    path = script(tmp_path, TEARDOWN_ABORT)
    env = {"DDIP_RUN_HOOK": "0"} if how == "hook-off" else {}
    got, out, err = run(launcher, ["run", "-n", "2", PY, path, "end" if how == "hook-off" else how], env=env)
    assert got == 128 + signal.SIGABRT, err
    # Without the hook both ranks abort, and either may be first.
    assert re.search(rf"^ddip run: rank {'[01]' if how == 'hook-off' else '1'} failed first: killed by SIGABRT$",
                     err, re.M), err


@pytest.mark.timeout(900)
def test_a_ddp_script_always_exits_0(launcher, tmp_path):
    # A real gloo DDP model: its threads can outlive destroy_process_group() and abort the rank
    # in Python's teardown, more often on a loaded machine; the script's status is what counts.
    path = script(tmp_path, """
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    dist.destroy_process_group()
    print("done")
    """)
    for _ in range(3):
        got, out, err = run(launcher, ["run", "-n", "2", PY, path], timeout=280)
        assert got == 0, err
        assert by_rank(out) == {0: ["done"], 1: ["done"]}


STORE_EARLY = """
import os, socket, sys, time
from pathlib import Path

flag = Path(sys.argv[1])
port = int(os.environ["MASTER_PORT"])
assert "DDIP_STORE_FD" not in os.environ
if os.environ["RANK"] == "1":
    # Before rank 0 has made any store: the port listens already, or this is refused.
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        flag.write_text("listened")
    except ConnectionRefusedError:
        flag.write_text("refused")
else:
    while not flag.exists():
        time.sleep(0.01)
import torch, torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(t)
print(flag.read_text(), int(t.item()))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("hook", ["1", "0"])
def test_rank_0s_store_listens_before_any_rank_starts(launcher, tmp_path, hook):
    # A store client that connects before rank 0's server is up is refused and backs off (half a
    # second); with ddip's hook, rank 0's TCPStore serves on a socket ddip run made listen first.
    path = script(tmp_path, STORE_EARLY)
    got, out, err = run(launcher, ["run", "-n", "2", PY, path, str(tmp_path / "flag")],
                        env={"DDIP_RUN_HOOK": hook}, timeout=120)
    assert got == 0, err
    seen = "listened" if hook == "1" else "refused"
    assert by_rank(out) == {0: [f"{seen} 3"], 1: [f"{seen} 3"]}


def test_rank_that_ignores_sigterm_is_killed_after_the_grace(launcher, tmp_path):
    path = script(tmp_path, PIDS_THEN.format(body="""
    if r == 0:
        time.sleep(0.3)
        sys.exit(1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
    """))
    code, out, err = run(launcher, ["run", "-n", "2", PY, path])
    assert code == 1
    assert "rank 1: killed by SIGKILL (stopped by ddip run)" in err
    assert not any(alive(p) for p in rank_pids(out))


def test_timeout(launcher, tmp_path):
    path = script(tmp_path, PIDS_THEN.format(body="time.sleep(600)"))
    t0 = time.monotonic()
    code, out, err = run(launcher, ["run", "-n", "2", "--timeout", "1.5", PY, path])
    took = time.monotonic() - t0
    assert code == 124
    assert 1.5 <= took < 20
    assert "ddip run: timed out after 1.5 s" in err
    assert "rank 0: killed by SIGTERM (stopped by ddip run)" in err
    assert not any(alive(p) for p in rank_pids(out))


INTERRUPTIBLE = """
    import os, sys, time
    r = int(os.environ["RANK"])
    try:
        print("ready", flush=True)  # inside: the interrupt may come as soon as it is written
        time.sleep(600)
    except KeyboardInterrupt:
        print(f"rank {{r}} got KeyboardInterrupt", flush=True)
        {then}
"""


def wait_for_lines(p, count: int, timeout=60) -> list[str]:
    """`count` ranks' lines of ddip run's stdout, "[r] text" each: a line several ranks printed
    alike, shown once ("[0,1] ready", ddip.repeats' rule), is each of theirs."""
    lines, deadline = [], time.monotonic() + timeout
    while len(lines) < count and time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        lines += [f"[{r}] {text}\n" for r, texts in by_rank(line).items() for text in texts] or [line]
    return lines


def test_sigint_is_forwarded_to_every_rank(launcher, tmp_path):
    p = launcher(["run", "-n", "2", PY, script(tmp_path, INTERRUPTIBLE.format(then="sys.exit(0)"))])
    assert len(wait_for_lines(p, 2)) == 2  # both ranks ready
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert "[0] rank 0 got KeyboardInterrupt" in out
    assert "[1] rank 1 got KeyboardInterrupt" in out
    assert p.returncode == 128 + signal.SIGINT  # interrupted, though every rank exited 0
    assert "forwarded SIGINT to every rank" in err


def test_sighup_is_forwarded_to_every_rank(launcher, tmp_path):
    # A closed terminal: ddip run's SIGHUP reaches every rank, as Ctrl-C does.
    path = script(tmp_path, """
        import os, signal, sys, time
        r = int(os.environ["RANK"])
        def hup(*_):
            print(f"rank {r} got SIGHUP", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGHUP, hup)
        print("ready", flush=True)
        time.sleep(600)
    """)
    p = launcher(["run", "-n", "2", PY, path])
    assert len(wait_for_lines(p, 2)) == 2  # both ranks ready
    p.send_signal(signal.SIGHUP)
    out, err = p.communicate(timeout=30)
    assert "[0] rank 0 got SIGHUP" in out and "[1] rank 1 got SIGHUP" in out
    assert p.returncode == 128 + signal.SIGHUP, err
    assert "ddip run: forwarded SIGHUP to every rank; ranks:\n" in err


def test_second_sigint_kills(launcher, tmp_path):
    # The ranks catch the interrupt and carry on; the second Ctrl-C does not ask again.
    p = launcher(["run", "-n", "2", PY, script(tmp_path, INTERRUPTIBLE.format(then="time.sleep(600)"))])
    assert len(wait_for_lines(p, 2)) == 2
    p.send_signal(signal.SIGINT)
    assert len(wait_for_lines(p, 2)) == 2
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGKILL
    assert "killing every rank" in err
    assert "failed first: killed by SIGKILL" in err


# Ranks that ignore SIGINT and SIGTERM, each with a child (`sleep`, which inherits the ignored
# signals) in its process group: every pid is printed, so the test can check none is left.
IGNORES_SIGNALS = """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "600"])
    print("pids", os.getpid(), child.pid, flush=True)
    time.sleep(600)
"""


def ignoring_pids(lines: list[str]) -> list[int]:
    return [int(x) for l in lines for x in re.fullmatch(r"\[\d+\] pids (\d+) (\d+)\n", l).groups()]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_forwarded_signal_escalates_to_sigkill_after_the_grace(launcher, tmp_path, sig):
    p = launcher(["run", "-n", "2", PY, script(tmp_path, IGNORES_SIGNALS)])
    pids = ignoring_pids(wait_for_lines(p, 2))
    assert len(pids) == 4
    t0 = time.monotonic()
    p.send_signal(sig)
    out, err = p.communicate(timeout=30)
    took = time.monotonic() - t0
    name = signal.Signals(sig).name
    assert p.returncode == 128 + sig, err  # interrupted; the ranks did not fail of their own
    assert 4.5 <= took < 20  # the 5 s grace, then SIGKILL
    assert (f"ddip run: forwarded {name} to every rank, then SIGKILL to those still running "
            "after 5 s; ranks:\n") in err
    assert "  rank 0: killed by SIGKILL (stopped by ddip run)\n" in err
    assert "  rank 1: killed by SIGKILL (stopped by ddip run)\n" in err
    assert f"ddip run: exit code {128 + sig}\n" in err
    assert wait_until(lambda: not any(alive(x) for x in pids), 10), "a rank or its child outlived ddip run"


def test_forwarded_signal_escalates_on_another_hosts_ddip_run(launcher, tmp_path):
    # One rank here, one behind a launcher command that runs that host's ddip run right here:
    # both ignore the forwarded SIGTERM and are killed after the grace.
    p = launcher(["run", "--hosts", "localhost:1,here:1", "--launcher", "exec {command} # {host}",
                  "--master-addr", "127.0.0.1", PY, script(tmp_path, IGNORES_SIGNALS)])
    pids = ignoring_pids(wait_for_lines(p, 2))
    assert len(pids) == 4
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "  rank 0: killed by SIGKILL (stopped by ddip run)\n" in err
    assert "  rank 1 (on here): killed by SIGKILL (stopped by ddip run)\n" in err
    assert wait_until(lambda: not any(alive(x) for x in pids), 10), "a rank or its child outlived ddip run"


def test_a_hosts_ddip_run_escalates_a_forwarded_signal_by_itself(tmp_path):
    # A host's ddip run (--node) told to forward SIGTERM over its control channel, and then
    # nothing more (no "kill" follows, the channel stays open): it kills its ranks after the grace.
    p = subprocess.Popen([DDIP, "run", "--node", "0,1,0,1", "--node-name", "here", "--master-addr",
                          "127.0.0.1", "-n", "1", PY, script(tmp_path, IGNORES_SIGNALS)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = ignoring_pids(wait_for_lines(p, 1))
        assert len(pids) == 2
        t0 = time.monotonic()
        p.stdin.write(CONTROL_SIGTERM)
        p.stdin.flush()
        assert wait_until(lambda: p.poll() is not None, 20), "the host's ddip run never killed its rank"
        assert 4.5 <= time.monotonic() - t0
        assert p.returncode == 128 + signal.SIGTERM
        err = p.stderr.read()
        # Its one record for the ddip run that started it: rank 0's end (spaces escaped).
        assert err == "\x1eddip done 1 0 killed\\sby\\sSIGKILL\\s(stopped\\sby\\sddip\\srun)\n", err
        assert wait_until(lambda: not any(alive(x) for x in pids), 10), "a rank or its child outlived ddip run"
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()


# What the ddip run that starts a host's ddip run writes on its control channel to forward SIGTERM.
CONTROL_SIGTERM = f"\x1eddip signal {int(signal.SIGTERM)}\n"


def test_a_hosts_ddip_run_stops_on_a_control_message_it_cannot_read(tmp_path):
    # Garbage on the control channel (another ddip version, a launcher writing to it): the link
    # can't be trusted, so the host's ddip run stops its ranks and says what it got.
    p = subprocess.Popen([DDIP, "run", "--node", "0,1,0,1", "--node-name", "here", "--master-addr",
                          "127.0.0.1", "-n", "1", PY, script(tmp_path, PIDS_THEN.format(body="time.sleep(600)"))],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = int(wait_for_lines(p, 1)[0].split()[2])
        p.stdin.write("\x1eddip halt\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=30)
        assert p.returncode == 1
        assert ('ddip run on here: the ddip run that started it sent a malformed ddip record "\\x1eddip halt": '
                'unknown kind "halt" (expected ping, signal, stop, kill, answer or collect); is the ddip program on both hosts '
                "the same version? (--ddip); stopped its ranks\n") in err, err
        assert err.endswith("\x1eddip done 1 0 killed\\sby\\sSIGTERM\\s(stopped\\sby\\sddip\\srun)\n"), err
        assert wait_until(lambda: not alive(pid), 10)
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()


def test_a_report_a_host_sends_that_cannot_be_read_is_named(launcher, tmp_path):
    # The launcher itself writes a broken record before the host's ddip run starts.
    bad = "printf '\\036ddip failed 1 x\\n' >&2; exec {command} # {host}"
    code, out, err = run(launcher, ["run", "--hosts", "here:1", "--launcher", bad, "--master-addr",
                                    "127.0.0.1", PY, "-c", "print('hi')"])
    assert code == 0, err
    assert out == "[0] hi\n"
    assert err == ('ddip run: host here sent a malformed ddip record "\\x1eddip failed 1 x": '
                   'its exit code "x" is not a number\n')


def test_die_with_parent(tmp_path):
    # A program drives ddip run and dies without a word: the launcher and its ranks go with it.
    ranks = script(tmp_path, PIDS_THEN.format(body="time.sleep(600)"))
    driver = script(tmp_path, f"""
        import subprocess, sys, time
        p = subprocess.Popen([{DDIP!r}, "run", "--die-with-parent", "-n", "2", {PY!r}, {ranks!r}],
                             start_new_session=True)
        print(p.pid, flush=True)
        time.sleep(600)
    """, name="driver.py")
    d = subprocess.Popen([PY, driver], stdout=subprocess.PIPE, text=True)
    try:
        launcher_pid = int(d.stdout.readline())
        assert wait_until(lambda: len(children_of(launcher_pid)) == 2, 30)
        rank_pids = children_of(launcher_pid)
        d.kill()
        d.wait()
        assert wait_until(lambda: not alive(launcher_pid) and not any(alive(p) for p in rank_pids), 10)
    finally:
        if d.poll() is None:
            d.kill()
            d.wait()
        d.stdout.close()


TORCHRUN_SCRIPT = """
    # Written for torchrun: everything comes from env://.
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert rank == int(os.environ["RANK"]) and dist.get_world_size() == int(os.environ["WORLD_SIZE"])
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"sum {t.item():g} world {dist.get_world_size()}")
    dist.destroy_process_group()
"""


def test_torch_gloo_all_reduce_written_for_torchrun(launcher, tmp_path):
    code, out, err = run(launcher, ["run", "-n", "3", PY, script(tmp_path, TORCHRUN_SCRIPT)],
                         timeout=180)
    assert code == 0, err
    assert by_rank(out) == {r: ["sum 6 world 3"] for r in range(3)}


# -- torchrun's elastic contract ------------------------------------------------------------------

# In the spirit of torch's own elastic test script (test/distributed/launcher/bin/test_script.py):
# it reads, by name, every variable torchrun's agent sets, and fails on one that is missing.
ELASTIC_SCRIPT = """
    import json, os
    import torch
    import torch.distributed as dist

    names = ["LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
             "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
             "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
             "TORCHELASTIC_ERROR_FILE"]
    env = {n: os.environ[n] for n in names}
    env["launched"] = dist.is_torchelastic_launched()
    # TORCHELASTIC_USE_AGENT_STORE=False: rank 0 serves the store at MASTER_ADDR:MASTER_PORT.
    dist.init_process_group("gloo")
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    env["sum"] = t.item()
    env["error_dir"] = os.path.isdir(os.path.dirname(env["TORCHELASTIC_ERROR_FILE"]))
    dist.destroy_process_group()
    print(json.dumps(env))
"""

UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def fresh_tmpdir(tmp_path) -> Path:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp


def test_torchelastic_environment(launcher, tmp_path):
    tmp = fresh_tmpdir(tmp_path)
    path = script(tmp_path, ELASTIC_SCRIPT)
    ids = []
    for _ in range(2):
        code, out, err = run(launcher, ["run", "-n", "2", PY, path], env={"TMPDIR": str(tmp)},
                             timeout=180)
        assert code == 0, err
        envs = rank_envs(out)
        assert sorted(envs) == [0, 1]
        for r, e in envs.items():
            assert e["launched"] is True  # torch.distributed.is_torchelastic_launched()
            assert e["TORCHELASTIC_RESTART_COUNT"] == "0"
            assert e["TORCHELASTIC_MAX_RESTARTS"] == "0"  # ddip run never restarts
            assert e["TORCHELASTIC_USE_AGENT_STORE"] == "False"
            assert e["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default
            assert (e["GROUP_RANK"], e["GROUP_WORLD_SIZE"], e["ROLE_NAME"]) == ("0", "1", "default")
            assert e["ROLE_RANK"] == e["RANK"] == e["LOCAL_RANK"] == str(r)
            assert e["ROLE_WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == e["WORLD_SIZE"] == "2"
            assert e["sum"] == 2.0
            assert e["error_dir"]
            assert Path(e["TORCHELASTIC_ERROR_FILE"]).parent.parent == tmp  # under $TMPDIR
        assert envs[0]["TORCHELASTIC_ERROR_FILE"] != envs[1]["TORCHELASTIC_ERROR_FILE"]
        run_ids = {e["TORCHELASTIC_RUN_ID"] for e in envs.values()}
        assert len(run_ids) == 1 and UUID4.fullmatch(next(iter(run_ids)))
        ids.append(run_ids.pop())
        assert list(tmp.iterdir()) == []  # the error files' directory went with the launch
    assert ids[0] != ids[1]  # one id per launch


def test_torchelastic_run_id_is_the_same_on_every_host(launcher, tmp_path):
    # One rank here, one behind a launcher command that runs that host's ddip run right here.
    code, out, err = run(launcher, ["run", "--hosts", "localhost:1,here:1", "--launcher",
                                    "exec {command} # {host}", "--master-addr", "127.0.0.1", PY,
                                    script(tmp_path, ELASTIC_SCRIPT)], timeout=180)
    assert code == 0, err
    envs = rank_envs(out)
    assert envs[0]["TORCHELASTIC_RUN_ID"] == envs[1]["TORCHELASTIC_RUN_ID"]
    assert [envs[r]["GROUP_RANK"] for r in (0, 1)] == ["0", "1"]
    assert {e["launched"] for e in envs.values()} == {True}
    # Each host's ddip run has its own error files, on its host.
    assert (Path(envs[0]["TORCHELASTIC_ERROR_FILE"]).parent
            != Path(envs[1]["TORCHELASTIC_ERROR_FILE"]).parent)


RECORD_SCRIPT = """
    import os, time
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        if os.environ["RANK"] == "1":
            raise ValueError("bad batch 7 on rank 1")
        time.sleep(600)

    main()
"""


def record_lines(path: str) -> list[str]:
    """The report's lines for RECORD_SCRIPT's traceback, from the error file."""
    lineno = Path(path).read_text().splitlines().index(
        '        raise ValueError("bad batch 7 on rank 1")') + 1
    return ["its error file (TORCHELASTIC_ERROR_FILE, written by torch's @record) says: "
            "ValueError: bad batch 7 on rank 1",
            "  | Traceback (most recent call last):",
            f'  |   File "{path}", line {lineno}, in main',
            '  |     raise ValueError("bad batch 7 on rank 1")',
            "  | ValueError: bad batch 7 on rank 1"]


def test_a_rank_failing_under_record_is_reported_with_its_error_file(launcher, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    tmp = fresh_tmpdir(tmp_path)
    parent = tmp_path / "parent.json"
    parent.write_text("stale")  # replaced, as torchrun replaces it
    path = script(tmp_path, RECORD_SCRIPT)
    code, out, err = run(launcher, ["run", "-n", "2", PY, path], timeout=120,
                         env={"TMPDIR": str(tmp), "TORCHELASTIC_ERROR_FILE": str(parent)})
    assert code == 1, err
    report = err[err.index("ddip run: rank 1 failed first"):].splitlines()
    assert report[0] == "ddip run: rank 1 failed first: exit code 1"
    assert report[1] == record_lines(path)[0]
    assert report[2] == record_lines(path)[1]
    assert record_lines(path)[2] in report and report[report.index(record_lines(path)[2]) + 1:][:2] \
        == record_lines(path)[3:]
    assert "last lines of its stderr:" not in report  # the traceback once, from the file
    assert "  rank 0: killed by SIGTERM (stopped by ddip run)" in report
    # As torchrun's own: the root cause's error file, with how it ended, where ddip run's
    # TORCHELASTIC_ERROR_FILE says; torch reads it back.
    data = json.loads(parent.read_text())
    assert data["message"]["errorCode"] == 1
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(parent))
    assert failure.message["message"] == "ValueError: bad batch 7 on rank 1"
    assert 'raise ValueError("bad batch 7 on rank 1")' in failure.message["extraInfo"]["py_callstack"]
    assert list(tmp.iterdir()) == []


def test_with_a_log_dir_the_error_file_is_in_torchruns_layout_beside_the_logs(launcher, tmp_path):
    # torchrun --log-dir puts each rank's error file at <dir>/<run id>_<random>/attempt_0/<local
    # rank>/error.json; run the same command line under both and compare what each wrote there.
    path = script(tmp_path, RECORD_SCRIPT.replace("time.sleep(600)", "time.sleep(2)"))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    written = {}
    for name, argv in (("ddip", [DDIP, "run"]), ("torchrun", [torchrun])):
        logs = tmp_path / f"logs-{name}"
        p = subprocess.run([*argv, "--nproc-per-node", "2", "--log-dir", str(logs), "-t", "3", path],
                           capture_output=True, text=True,
                           timeout=120, env={k: v for k, v in os.environ.items()
                                             if not k.startswith(("PET_", "TORCHELASTIC_"))})
        assert p.returncode != 0, p.stderr
        (job,) = logs.iterdir()
        # One node, no port: a random run id (a UUID), as torch 2.13's run() picks (before 2.13,
        # torchrun's was "none").
        if name == "ddip" or TORCHRUN_IS_THE_REFERENCE:
            assert re.fullmatch(r"[0-9a-f-]{36}_\w{8}", job.name), job.name
        written[name] = sorted(str(f.relative_to(job)) for f in job.rglob("*") if f.is_file())
        error = json.loads((job / "attempt_0" / "1" / "error.json").read_text())
        assert "bad batch 7 on rank 1" in json.dumps(error)
        if name == "ddip":  # and the report reads it from there
            assert record_lines(path)[0] in p.stderr.splitlines(), p.stderr
    assert written["ddip"] == written["torchrun"]
    assert "attempt_0/1/error.json" in written["ddip"]


def test_a_rank_failing_under_record_on_another_host_is_reported_with_its_error_file(launcher, tmp_path):
    path = script(tmp_path, RECORD_SCRIPT)
    code, out, err = run(launcher, ["run", "--hosts", "localhost:1,here:1", "--launcher",
                                    "exec {command} # {host}", "--master-addr", "127.0.0.1", PY,
                                    path], timeout=120)
    assert code == 1, err
    report = err[err.index("ddip run: rank 1 (on here) failed first"):].splitlines()
    assert report[0] == "ddip run: rank 1 (on here) failed first: exit code 1"
    assert report[1:3] == record_lines(path)[:2]
    assert record_lines(path)[-1] in report


def test_a_rank_that_fails_by_itself_is_not_said_to_be_stopped(launcher, tmp_path):
    # Rank 1 fails first; rank 2 is taken down by ddip run's SIGTERM; rank 0 fails by itself once
    # its peer is gone. Rank 0 ignores SIGTERM: it stands for a rank that was already in its own
    # exit when the SIGTERM came (what torch ranks failing together do; a race no test can
    # schedule): either way the signal is not what ended it, and it ends with its own exit code.
    peer, deaf = tmp_path / "rank1.pid", tmp_path / "rank0.ignores"
    path = script(tmp_path, PIDS_THEN.format(body=f"""
    if r == 1:
        while not os.path.exists({str(deaf)!r}):  # rank 0 ignores SIGTERM by now
            time.sleep(0.05)
        open({str(peer)!r} + ".tmp", "w").write(str(os.getpid()))
        os.rename({str(peer)!r} + ".tmp", {str(peer)!r})
        sys.exit(3)
    if r == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(deaf)!r}, "w").close()
        while not os.path.exists({str(peer)!r}) or os.path.exists("/proc/" + open({str(peer)!r}).read()):
            time.sleep(0.05)
        print("peer gone", file=sys.stderr)
        sys.exit(1)
    time.sleep(600)
    """))
    code, out, err = run(launcher, ["run", "-n", "3", PY, path])
    assert code == 3, err
    assert "ddip run: rank 1 failed first: exit code 3\n" in err
    assert "  rank 0: exit code 1\n" in err
    assert "  rank 2: killed by SIGTERM (stopped by ddip run)\n" in err


def test_lightning_picks_torchelastic_under_ddip_run(launcher, tmp_path):
    pytest.importorskip("lightning")
    # As under torchrun: TorchElasticEnvironment, so devices=1 in two ranks is torchrun's clear
    # error (under another environment it was an IndexError deep inside Lightning).
    # Each rank says which environment it got, then waits for the other's word before launching:
    # the first rank to fail stops the other, which may not have printed yet (lightning's import
    # takes seconds).
    said = tmp_path / "said"
    said.mkdir()
    path = script(tmp_path, f"""
        import os, pathlib, time
        import lightning as L
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy="ddp", logger=False,
                            enable_progress_bar=False, enable_checkpointing=False)
        print(type(trainer._accelerator_connector.cluster_environment).__name__, flush=True)
        said = pathlib.Path({str(said)!r})
        (said / os.environ["RANK"]).touch()
        while len(list(said.iterdir())) < 2:
            time.sleep(0.01)
        trainer.strategy.launcher.launch(print)
    """)
    code, out, err = run(launcher, ["run", "-n", "2", PY, path], timeout=180)
    assert code == 1, err
    seen = by_rank(out)
    assert all(seen.get(r, [None])[0] == "TorchElasticEnvironment" for r in (0, 1)), (out, err)  # each rank's
    assert "but the product (1 * 1) does not match the world size (2)" in err


# -- %%diprun through a real kernel -----------------------------------------------------------


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    from test_magics import running_kernel

    with running_kernel(tmp_path_factory.mktemp("jupyter")) as k:
        yield k


def test_diprun_shows_labelled_output_live(kernel):
    arrivals = []
    cell = kernel.run(textwrap.dedent("""\
        %%diprun -n 2
        import os, time
        r = int(os.environ["RANK"])
        print(f"first from {r} of {os.environ['WORLD_SIZE']}")
        time.sleep(1.5)
        print(f"second from {r}")
        """), on_output=lambda o: arrivals.append((time.monotonic(), o)))
    assert cell.ok, cell.outputs
    lines = sorted(cell.stream().splitlines())
    assert lines == ["[0] first from 0 of 2", "[0] second from 0", "[1] first from 1 of 2",
                     "[1] second from 1"]
    # Live: the first lines reached the notebook well before the cell ended.
    first = next(t for t, o in arrivals if "first from" in o.get("text", ""))
    last = max(t for t, o in arrivals if "second from" in o.get("text", ""))
    assert last - first > 1.0


def test_diprun_torch_gloo(kernel):
    cell = kernel.run("%%diprun -n 2\n" + textwrap.dedent(TORCHRUN_SCRIPT), timeout=180)
    assert cell.ok, cell.outputs
    assert sorted(cell.stream().splitlines()) == ["[0] sum 3 world 2", "[1] sum 3 world 2"]


def test_diprun_failure_fails_the_cell(kernel):
    cell = kernel.run(textwrap.dedent("""\
        %%diprun -n 2
        import os, sys
        if os.environ["RANK"] == "1":
            raise ValueError("bad batch")
        """))
    assert not cell.ok
    err = cell.stream("stderr")
    assert "ValueError: bad batch" in err
    assert "rank 1 failed first: exit code 1" in err
    assert cell.reply["ename"] == "DipRunError"
    # The cell fails with the message alone: no traceback of the magic's own frames (issue 33 row 16).
    [shown] = cell.of_type("error")
    assert "magics/run.py" not in "".join(shown["traceback"]) and "ddip run exited with code 1" in \
        shown["traceback"][-1], shown


def test_diprun_bad_flags(kernel):
    for line, message in (("%%diprun -n 2 --gpus 0", "-n excludes --gpus"),
                          ("%%diprun --bogus", "unrecognized"), ("%%diprun -n x", "invalid int")):
        cell = kernel.run(line + "\nprint('never')")
        assert not cell.ok
        assert cell.reply["ename"] == "UsageError"
        assert message in cell.reply["evalue"] and "usage: %diprun" in cell.reply["evalue"]
        assert "never" not in cell.stream()


@pytest.mark.parametrize("flags, message", [
    ("-n 2 --show 5", "--show: there is no rank 5: ranks are 0-1"),
    ("--gpus 0,0", "--gpus: GPUs 0,0 list GPU 0 more than once; each rank needs its own GPU"),
    ("-n 0", "-n: Value 0 not in range 1 to 1024"),
    ("--timeout -1", "--timeout: give a positive number of seconds, got -1"),
])
def test_diprun_values_ddip_run_rejects_are_usage_errors_in_its_words(kernel, flags, message, fake_gpus):
    # Two GPUs as far as the GPU rules can tell (no GPU is touched: nothing starts).
    smi = fake_gpus(2)
    assert kernel.run(f"import os\nos.environ['CUDA_VISIBLE_DEVICES'] = '0,1'\n_path = os.environ['PATH']\n"
                      f"os.environ['PATH'] = {smi!r} + os.pathsep + _path").ok
    try:
        cell = kernel.run(f"%%diprun {flags}\nprint('never')")
    finally:
        assert kernel.run("del os.environ['CUDA_VISIBLE_DEVICES']\nos.environ['PATH'] = _path").ok
    assert not cell.ok and cell.reply["ename"] == "UsageError"
    assert cell.reply["evalue"] == f"{message}\nusage: %diprun [-n N] [-g GPUS] [--show RANKS] [--log-dir DIR] " \
                                   f"[--timeout SECONDS] [--hosts HOSTS] [--launcher LAUNCHER] [--ddip PATH]"
    # As IPython shows a UsageError: its message alone, no traceback, and no ddip run --help hint.
    assert cell.stream("stderr") == f"UsageError: {cell.reply['evalue']}\n"
    assert not cell.of_type("error") and "never" not in cell.stream()


def test_diprun_interrupt_reaches_the_ranks(kernel):
    pids_file = Path(kernel.km.connection_file).with_name(f"diprun-pids-{os.getpid()}")
    pids_file.unlink(missing_ok=True)
    outputs = []

    def on_output(o):
        outputs.append(o)
        if sum(o.get("text", "").count("ready") for o in outputs) == 2 and not interrupted:
            interrupted.append(True)
            kernel.km.interrupt_kernel()

    interrupted = []
    cell = kernel.run(textwrap.dedent(f"""\
        %%diprun -n 2
        import os, time
        with open({str(pids_file)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        try:
            print("ready", flush=True)
            time.sleep(600)
        except KeyboardInterrupt:
            print(f"rank {{os.environ['RANK']}} interrupted", flush=True)
        """), on_output=on_output, timeout=60)
    assert interrupted
    assert not cell.ok and cell.reply["ename"] == "KeyboardInterrupt"
    text = cell.stream()
    assert "[0] rank 0 interrupted" in text and "[1] rank 1 interrupted" in text, cell.stream("stderr")
    pids = [int(x) for x in pids_file.read_text().split()]
    assert len(pids) == 2 and wait_until(lambda: not any(alive(p) for p in pids), 10)
    assert kernel.run("print('kernel fine')").stream() == "kernel fine\n"
