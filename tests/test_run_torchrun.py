"""`ddip run` takes torchrun's command line with torchrun's meaning (issue 32, items 1 and 7).

The same command lines run under torch 2.13's own `torchrun` and under `ddip run`, and what each
rank sees (its environment, argv, interpreter), the log files written, and what reaches the
terminal are compared. The forms that stopped torchrun users (the issue's table) each start.
Parsing itself, option by option, is cpp/tests/test_run_args.cpp's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import DDIP, TORCHRUN_IS_THE_REFERENCE  # noqa: E402
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# What a rank reports: its argv, whether Python runs it unbuffered (-u, as torchrun's), which
# environment's Python it is, and torchrun's variables.
ENV_SCRIPT = """
    import json, os, sys
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_SIGNALS_TO_HANDLE"]
    seen = {"argv": sys.argv, "u": "-u" in sys.orig_argv, "prefix": sys.prefix,
            **{k: os.environ.get(k) for k in keys}}
    print("ENV " + json.dumps(seen))
"""

# Where torchrun and ddip run differ on purpose (docs/run.md, "From torchrun"): the port is free
# either way; MASTER_ADDR is 127.0.0.1 for ddip run where torchrun's c10d store says localhost
# (the same machine).
DIFFERENT = {"MASTER_PORT", "MASTER_ADDR"}
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def clean_env(**extra) -> dict:
    """This environment without the user's PET_* (they would change both launchers' meaning)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["OMP_NUM_THREADS"] = "1"  # torchrun's warning about it, otherwise, on every launch
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def both(args: list[str], cwd: Path, env: dict | None = None, timeout=120):
    """`torchrun ARGS` and `ddip run ARGS`, side by side: (torchrun's, ddip run's) completed processes."""
    env = env or clean_env()
    procs = [subprocess.Popen([*launcher, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
             for launcher in ([TORCHRUN], [DDIP, "run"])]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def ddip(args: list[str], cwd: Path, env: dict | None = None, timeout=60):
    return subprocess.run([DDIP, "run", *args], cwd=cwd, env=env or clean_env(), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def ranks_seen(text: str) -> dict[int, dict]:
    """Each rank's ENV record, by RANK, whether labelled ([1] ENV ..., [default1]:ENV ...) or not.
    torchrun's ranks share its stdout, and `python -u` writes a print's text and its line end
    apart: two ranks' records can share a line there ("ENV {...}ENV {...}")."""
    seen = {}
    for record in re.finditer(r"ENV (\{[^{}]*\})", text):
        got = json.loads(record.group(1))
        seen[int(got["RANK"])] = got
    return seen


@pytest.fixture
def work(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(ENV_SCRIPT))
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(textwrap.dedent(ENV_SCRIPT))
    return tmp_path


def same_as_torchrun(torchrun, ours, nranks: int) -> dict[int, dict]:
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    assert ours.returncode == 0, ours.stderr[-3000:]
    want, got = ranks_seen(torchrun.stdout), ranks_seen(ours.stdout)
    assert sorted(want) == sorted(got) == list(range(nranks))
    for r in range(nranks):
        w = {k: v for k, v in want[r].items() if k not in DIFFERENT}
        g = {k: v for k, v in got[r].items() if k not in DIFFERENT}
        # A random run id is random for each: both UUIDs, one per launch. torchrun before 2.13
        # named a run without a rendezvous id "none" where 2.13 (ddip's reference) picks a UUID.
        if not TORCHRUN_IS_THE_REFERENCE and w["TORCHELASTIC_RUN_ID"] == "none":
            w["TORCHELASTIC_RUN_ID"] = g["TORCHELASTIC_RUN_ID"]
        if UUID.match(w["TORCHELASTIC_RUN_ID"] or ""):
            assert UUID.match(g["TORCHELASTIC_RUN_ID"] or ""), g
            w["TORCHELASTIC_RUN_ID"] = g["TORCHELASTIC_RUN_ID"] = "uuid"
        assert g == w, f"rank {r}"
    assert len({got[r]["MASTER_PORT"] for r in got}) == 1
    return got


@pytest.mark.parametrize("args, nranks", [
    # The script without python, underscore spellings, --opt=value: torchrun runs it with Python -u.
    (["--nproc_per_node=2", "train.py", "--lr", "0.1"], 2),
    # --standalone and --nnodes 1: one node, a random run id.
    (["--standalone", "--nnodes", "1", "--nproc-per-node", "2", "train.py"], 2),
    # A module, with torchrun's "--" (dropped), a role and a rendezvous id.
    (["--nnodes=1:1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:{port}", "--rdzv_id", "job7",
      "--role", "trainer", "--nproc-per-node", "1", "-m", "pkg.train", "--", "--depth=24"], 1),
    # A static rendezvous with a port: the run id is torch's "none".
    (["--master_addr", "127.0.0.1", "--master_port", "{port}", "--node_rank", "0", "--nproc-per-node", "1",
      "train.py"], 1),
])
def test_each_rank_sees_what_torchrun_gives_it(work, args, nranks):
    port = str(free_port())
    args = [a.replace("{port}", port) for a in args]
    torchrun, ours = both(args, work)
    got = same_as_torchrun(torchrun, ours, nranks)
    assert got[0]["u"] and got[0]["prefix"] == sys.prefix  # this environment's Python, -u


def test_kubeflows_pet_variables_as_its_trainer_sets_them(work):
    # Kubeflow's trainer puts torchrun's options in every pod's environment; one pod, one node.
    env = clean_env(PET_NNODES="1", PET_NPROC_PER_NODE="2", PET_NODE_RANK="0", PET_MASTER_ADDR="127.0.0.1",
                    PET_MASTER_PORT=str(free_port()))
    torchrun, ours = both(["train.py"], work, env=env)
    got = same_as_torchrun(torchrun, ours, 2)
    assert got[1]["TORCHELASTIC_RUN_ID"] == "none" and got[1]["WORLD_SIZE"] == "2"
    # The command line outranks them, as in torch's env action.
    p = ddip(["--nproc-per-node", "1", "train.py"], work, env=env)
    assert p.returncode == 0 and sorted(ranks_seen(p.stdout)) == [0]


OUTPUT_SCRIPT = """
    import os, sys
    r = os.environ["LOCAL_RANK"]
    print(f"out of {r}")
    print(f"err of {r}", file=sys.stderr)
"""


def terminal_lines(text: str) -> list[str]:
    """The ranks' lines that reached a terminal, without the launcher's label ([1] , [default1]:).
    Found anywhere in the text: torchrun's untouched streams are the ranks' own, shared, and a
    print's line end comes apart from its text (python -u), so two lines can share one there."""
    return sorted(re.findall(r"(?:out|err) of \d+", text))


def log_files(logs: Path) -> dict[str, str]:
    """Every file under a --log-dir, by its path with the job directory's random name replaced."""
    files = {}
    for path in sorted(logs.rglob("*")):
        rel = path.relative_to(logs).as_posix()
        job, _, rest = rel.partition("/")
        assert re.match(r"^.+_[a-z0-9_]{8}$", job), job  # <run id>_<8 random characters>
        files[f"JOB/{rest}" if rest else "JOB"] = path.read_text() if path.is_file() else "<dir>"
    return files


@pytest.mark.parametrize("streams", [
    ["--tee", "3"],  # the pre-training script's: every stream to the terminal and the files
    ["-r", "0:1,1:3", "-t", "1:2", "--local-ranks-filter", "1"],
    ["--redirects=2", "--local_ranks_filter=0"],
])
def test_log_dir_tee_redirects_and_the_filter_as_torchrun(tmp_path, streams):
    (tmp_path / "out.py").write_text(textwrap.dedent(OUTPUT_SCRIPT))
    args = ["--nproc-per-node", "2", *streams, "out.py"]
    procs = [subprocess.Popen([*launcher, "--log-dir", str(tmp_path / name), *args], cwd=tmp_path,
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for launcher, name in (([TORCHRUN], "torchrun"), ([DDIP, "run"], "ddip"))]
    (t_out, t_err), (d_out, d_err) = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], t_err[-2000:] + d_err[-2000:]
    # The same files, with the same contents, in torchrun's layout.
    assert log_files(tmp_path / "ddip") == log_files(tmp_path / "torchrun")
    # The same lines on the terminal.
    assert terminal_lines(d_out + d_err) == terminal_lines(t_out + t_err)
    assert terminal_lines(d_out) == terminal_lines(t_out)


def test_log_dir_alone_keeps_every_stream_where_torchrun_keeps_none(tmp_path):
    # ddip run's own --log-dir meaning, kept: a log directory of empty folders helps nobody.
    (tmp_path / "out.py").write_text(textwrap.dedent(OUTPUT_SCRIPT))
    p = ddip(["--nproc-per-node", "2", "--log-dir", "logs", "out.py"], tmp_path)
    assert p.returncode == 0, p.stderr
    files = log_files(tmp_path / "logs")
    assert files["JOB/attempt_0/1/stdout.log"] == "out of 1\n"
    assert files["JOB/attempt_0/0/stderr.log"] == "err of 0\n"
    assert terminal_lines(p.stdout + p.stderr) == ["err of 0", "err of 1", "out of 0", "out of 1"]


def ddip_gpu_count() -> int:
    import ddip
    return ddip.kernel.group.gpu_count()


# The forms that stopped every one of 50 torchrun command lines (issue 32's table), each of which
# now starts. One launcher per machine (several nodes) is tests/test_run_nodes.py's.
@pytest.mark.parametrize("args, env, nranks", [
    (["--nproc_per_node=2", "train.py"], {}, 2),                                    # no python
    (["--nproc_per_node", "2", "--master_port", "{port}", "--node_rank", "0", "--master_addr",
      "127.0.0.1", "train.py"], {}, 2),                                             # underscores
    (["--nnodes", "1", "--nproc-per-node", "2", "train.py"], {}, 2),                 # --nnodes 1
    (["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:{port}", "--rdzv-id=j1",
      "--nproc-per-node=2", "train.py"], {}, 2),                                    # rendezvous
    (["--standalone", "--nproc-per-node", "2", "train.py"], {}, 2),                  # --standalone
    (["-m", "pkg.train", "--", "--depth=24"], {}, 1),                               # -m module
    (["--max-restarts", "3", "--nproc-per-node", "2", "train.py"], {}, 2),          # --max-restarts
    (["train.py"], {"PET_NPROC_PER_NODE": "2", "PET_NNODES": "1", "PET_NODE_RANK": "0",
                    "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": "{port}"}, 2),  # PET_*
    # auto: as torchrun, the GPUs where there are any, else the CPUs
    (["--nproc-per-node", "auto", "train.py"], {}, ddip_gpu_count() or len(os.sched_getaffinity(0))),
    (["--nproc_per_node", "cpu", "train.py"], {}, len(os.sched_getaffinity(0))),
])
def test_the_blocker_forms_start(work, args, env, nranks):
    port = str(free_port())
    args = [a.replace("{port}", port) for a in args]
    p = ddip(args, work, env=clean_env(**{k: v.replace("{port}", port) for k, v in env.items()}))
    assert p.returncode == 0, p.stderr
    seen = ranks_seen(p.stdout)
    assert sorted(seen) == list(range(nranks))
    assert all(s["WORLD_SIZE"] == str(nranks) and s["u"] for s in seen.values())
    if "-m" in args:
        assert seen[0]["argv"] == [str(work / "pkg" / "train.py"), "--depth=24"]


def test_ddip_runs_habit_of_naming_python_still_works(work):
    p = ddip(["-n", "2", sys.executable, "train.py", "x"], work)
    assert p.returncode == 0, p.stderr
    assert ranks_seen(p.stdout)[1]["argv"] == ["train.py", "x"]
    p = ddip(["-n", "1", "python3", "train.py"], work, env=clean_env(PATH=f"{Path(sys.executable).parent}:"
                                                                     f"{os.environ['PATH']}"))
    assert p.returncode == 0 and ranks_seen(p.stdout)[0]["argv"] == ["train.py"]


def test_an_executable_script_without_a_shebang_is_run_by_python_not_the_shell(work):
    script = work / "train.py"
    script.chmod(0o755)  # no "#!" line: /bin/sh would choke on it
    p = ddip(["-n", "1", "./train.py"], work)
    assert p.returncode == 0, p.stderr
    assert ranks_seen(p.stdout)[0]["argv"] == ["./train.py"]


def test_torch_distributed_launchs_local_rank_argument(work):
    # `python -m torch.distributed.launch` without --use-env passes --local-rank=N to the script.
    p = ddip(["--local-rank-arg", "--nproc-per-node", "2", "train.py", "x"], work)
    assert p.returncode == 0, p.stderr
    assert [ranks_seen(p.stdout)[r]["argv"] for r in (0, 1)] == [
        ["train.py", "--local-rank=0", "x"], ["train.py", "--local-rank=1", "x"]]
    p = ddip(["--use_env", "--nproc-per-node", "1", "train.py"], work)
    assert p.returncode == 0 and ranks_seen(p.stdout)[0]["argv"] == ["train.py"]


def test_a_bad_command_line_names_every_problem_in_order(work):
    p = ddip(["--nnodes", "0", "--bogus", "4", "--nproc_per_node", "0", "--tee", "7", "nothere.py"], work)
    assert p.returncode == 2 and p.stdout == ""
    named = [line.split(":")[0] for line in p.stderr.splitlines()[:5]]
    assert named == ["--nnodes", "--bogus", "--nproc_per_node", "--tee", "COMMAND"], p.stderr


SIGNAL_SCRIPT = """
    import os, signal, sys, time
    def on(sig, frame):
        print(f"rank {os.environ['RANK']} got {signal.Signals(sig).name}", flush=True)
        sys.exit(0)
    for s in (signal.SIGUSR1, signal.SIGQUIT):
        signal.signal(s, on)
    print("ready", flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize("args, sig", [
    (["--signals-to-handle", "SIGTERM,SIGUSR1"], signal.SIGUSR1),  # Slurm's --signal=USR1@90
    ([], signal.SIGQUIT),  # torchrun's default list has it
])
def test_signals_to_handle_are_forwarded_to_every_rank(tmp_path, args, sig):
    (tmp_path / "sig.py").write_text(textwrap.dedent(SIGNAL_SCRIPT))
    # --raw: each rank's "ready" on a line of its own (not "[0,1] ready"), as the readlines wait for
    p = subprocess.Popen([DDIP, "run", "--raw", "-n", "2", *args, "sig.py"], cwd=tmp_path, env=clean_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = [p.stdout.readline() for _ in range(2)]
        assert ready == ["[0] ready\n", "[1] ready\n"] or sorted(ready) == ["[0] ready\n", "[1] ready\n"]
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    name = signal.Signals(sig).name
    assert sorted(line for line in out.splitlines() if "got" in line) == [
        f"[0] rank 0 got {name}", f"[1] rank 1 got {name}"], err
