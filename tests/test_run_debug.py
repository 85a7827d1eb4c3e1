"""breakpoint() in the ranks of `ddip run`: typed at in a pseudo-terminal as a person would
(pexpect), through a pipe as a program would, with nobody to answer, and through %%diprun in a
real kernel whose client answers the kernel's input requests as JupyterLab does.

Every launcher a test starts is killed by pid if the test fails midway (pexpect's close(force)),
and its ranks die with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pexpect
import pytest

from conftest import DDIP  # noqa: E402
PY = sys.executable
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# Rank 1 stops at breakpoint() with x = 41; rank 0 waits for rank 1 to go on (a FIFO rank 1 writes
# after its prompt), then says whether anything reached its own stdin.
TWO_RANKS = """
    import os, select
    rank = int(os.environ["RANK"])
    x = 40 + rank
    fifo = {fifo!r}
    if rank == 1:
        print("rank 1 stops", flush=True)
        breakpoint()
        print(f"rank 1 goes on with x={{x}}", flush=True)
        with open(fifo, "w") as f:
            f.write("on")
    else:
        with open(fifo) as f:
            f.read()
        ready, _, _ = select.select([0], [], [], 0)
        print("rank 0's stdin: " + (os.read(0, 100).decode() if ready else "nothing"), flush=True)
"""


def script(tmp_path, body: str, name="rank.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def two_ranks(tmp_path) -> str:
    fifo = tmp_path / "rank1-went-on"
    os.mkfifo(fifo)
    return script(tmp_path, TWO_RANKS.format(fifo=str(fifo)))


@pytest.fixture
def terminal():
    """spawn(args) -> `ddip ARGS` on a pseudo-terminal of its own (pexpect); killed at the end."""
    started = []

    def spawn(args, **kw):
        child = pexpect.spawn(DDIP, args, encoding="utf-8", codec_errors="replace", timeout=60,
                              env=dict(os.environ), echo=True, **kw)
        started.append(child)
        return child

    yield spawn
    for child in started:
        child.close(force=True)


def _print_x_and_go_on(t) -> str:
    """At rank 1's prompt: `p x` shows 41 as rank 1's output, `c` lets it go on; what ddip run
    printed from then to its end."""
    t.sendline("p x")
    t.expect(r"\[1\] 41\r?\n")  # rank 1's value, as rank 1's output
    t.expect(r"\[1\] ipdb> ")
    t.sendline("c")
    t.expect(pexpect.EOF)
    return ANSI.sub("", t.before)


def test_breakpoint_prompts_on_the_terminal_and_the_answer_reaches_that_rank_only(terminal, tmp_path):
    t = terminal(["run", "-n", "2", "--", PY, two_ranks(tmp_path)])
    t.expect_exact("[1] rank 1 stops")
    t.expect(r"\[1\] ipdb> ")
    # Where it stopped, labelled, before the prompt.
    assert "breakpoint()" in ANSI.sub("", t.before)
    rest = _print_x_and_go_on(t)
    assert "[1] rank 1 goes on with x=41" in rest
    assert "[0] rank 0's stdin: nothing" in rest  # what was typed reached rank 1 alone
    t.close()
    assert t.exitstatus == 0, rest


def test_pdb_set_trace_prompts_like_breakpoint(terminal, tmp_path):
    # A direct pdb.set_trace() (not breakpoint()): ddip's startup hook in the rank (ddip.rank.run_hook)
    # makes it ddip run's prompt too, stopping in the caller's frame; pdb is not imported before.
    path = script(tmp_path, """
        import os, sys
        rank = int(os.environ["RANK"])
        x = 40 + rank
        assert "pdb" not in sys.modules
        if rank == 1:
            import pdb
            pdb.set_trace()
            print(f"rank 1 goes on with x={x}", flush=True)
    """)
    t = terminal(["run", "-n", "2", "--", PY, path])
    t.expect(r"\[1\] ipdb> ")
    assert "pdb.set_trace()" in ANSI.sub("", t.before)  # where it stopped: the script's own line
    rest = _print_x_and_go_on(t)
    assert "[1] rank 1 goes on with x=41" in rest, rest
    t.close()
    assert t.exitstatus == 0, rest


def test_two_ranks_at_breakpoints_take_turns_each_labelled(terminal, tmp_path):
    path = script(tmp_path, """
        import os
        rank = int(os.environ["RANK"])
        mine = f"rank {rank}'s own"
        breakpoint()
        print(f"rank {rank} done", flush=True)
    """)
    t = terminal(["run", "-n", "2", "--", PY, path])
    asked = []
    for _ in range(2):
        t.expect(r"\[(\d)\] ipdb> ")
        rank = int(t.match.group(1))
        asked.append(rank)
        t.sendline("p mine")
        t.expect(rf"\[{rank}\] \"rank {rank}'s own\"")  # the answer reached the rank that asked
        t.expect(rf"\[{rank}\] ipdb> ")
        t.sendline("c")
    assert sorted(asked) == [0, 1]
    t.expect(pexpect.EOF)
    t.close()
    assert t.exitstatus == 0


def test_ctrl_c_at_a_prompt_stops_the_job(terminal, tmp_path):
    t = terminal(["run", "-n", "2", "--", PY, two_ranks(tmp_path)])
    t.expect(r"\[1\] ipdb> ")
    t.sendintr()  # Ctrl-C, through the terminal: SIGINT to ddip run, which forwards it
    t.expect(pexpect.EOF)
    out = ANSI.sub("", t.before)
    assert "[1] KeyboardInterrupt: interrupted at the debugger's prompt" in out, out
    assert "[0] KeyboardInterrupt" in out  # every rank got it
    assert "(after ddip run forwarded SIGINT)" in out
    assert "rank 1 goes on with x=41" not in out
    # Its prompt ended with it: not shown again after the rank left it.
    assert "ipdb> " not in out.split("interrupted at the debugger's prompt", 1)[1], out
    t.close()
    assert t.exitstatus == 128 + 2


def test_answers_through_a_pipe_are_shown_after_their_prompt(tmp_path):
    p = subprocess.run([DDIP, "run", "-n", "2", "--", PY, two_ranks(tmp_path)], input="p x\nc\n",
                       capture_output=True, text=True, timeout=60)
    out = ANSI.sub("", p.stdout)
    assert p.returncode == 0, p.stderr
    assert "[1] ipdb> p x\n[1] 41\n[1] ipdb> c\n" in out
    assert "[1] rank 1 goes on with x=41" in out and "[0] rank 0's stdin: nothing" in out


def test_with_nobody_to_answer_the_rank_says_so_and_goes_on(tmp_path):
    p = subprocess.run([DDIP, "run", "-n", "2", "--", PY, two_ranks(tmp_path)], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "[1] rank 1 goes on with x=41" in p.stdout
    assert ("[1] ddip: breakpoint() on rank 1 stopped at a debugger prompt, but nobody can answer it"
            in p.stderr)
    assert "BdbQuit" not in p.stderr
    assert "ipdb> " not in p.stdout  # no prompt nobody can answer


def test_pythonbreakpoint_set_by_the_user_is_kept(tmp_path):
    p = subprocess.run([DDIP, "run", "-n", "2", "--env", "PYTHONBREAKPOINT=0", "--", PY, two_ranks(tmp_path)],
                       input="", capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "[1] rank 1 goes on with x=41" in p.stdout
    assert "nobody can answer" not in p.stderr and "ipdb> " not in p.stdout


def test_help_says_how_a_ranks_breakpoint_is_answered():
    out = subprocess.run([DDIP, "run", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "A rank's breakpoint() prompts on ddip run's terminal, labelled with its rank" in out
    assert "PYTHONBREAKPOINT=ddip.rank.run_debug.set_trace" in out
    assert "each rank's stdin is then a pipe of its own" in out


# -- %%diprun through a real kernel: the prompt in the notebook's input box -------------------------


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    from test_debugger import Answering
    from test_magics import running_kernel

    with running_kernel(tmp_path_factory.mktemp("jupyter"), wrap=Answering) as k:
        assert k.run("%load_ext ddip").ok
        yield k


def diprun_cell(tmp_path) -> str:
    fifo = tmp_path / "rank1-went-on"
    os.mkfifo(fifo)
    return "%%diprun -n 2\n" + textwrap.dedent(TWO_RANKS.format(fifo=str(fifo)))


def test_diprun_asks_a_ranks_prompt_in_the_notebook_and_the_answer_reaches_that_rank(kernel, tmp_path):
    answers = ["p x", "c"]
    cell = kernel.run_answering(diprun_cell(tmp_path), lambda prompt: answers.pop(0))
    out = ANSI.sub("", cell.stream())
    assert cell.reply["status"] == "ok", (cell.outputs, cell.reply)
    assert kernel.prompts == ["[rank 1] ipdb> ", "[rank 1] ipdb> "]  # labelled, through input()
    assert "[1] 41\n" in out  # rank 1's value, as rank 1's output
    assert "[1] rank 1 goes on with x=41" in out
    assert "[0] rank 0's stdin: nothing" in out
    assert "\x1e" not in out + cell.stream("stderr")  # no record shown


def test_diprun_without_stdin_the_rank_says_so_and_goes_on(kernel, tmp_path):
    from test_magics import Cell

    msg_id = kernel.kc.execute(diprun_cell(tmp_path), allow_stdin=False, stop_on_error=False)
    outputs = []
    deadline = time.monotonic() + 60
    while not kernel._take_iopub(msg_id, outputs):
        assert time.monotonic() < deadline, outputs
    cell = Cell(outputs, None)
    assert "[1] rank 1 goes on with x=41" in cell.stream(), outputs
    err = cell.stream("stderr")
    assert "[rank 1] stopped at a debugger prompt, but this frontend can't take input" in err
    assert "nobody can answer it" in err and "BdbQuit" not in err


def test_diprun_stop_button_at_a_prompt_ends_the_cell(kernel, tmp_path):
    def interrupt(prompt):
        kernel.km.interrupt_kernel()
        return None  # left unanswered: the stop button instead

    cell = kernel.run_answering(diprun_cell(tmp_path), interrupt)
    assert cell.reply["status"] == "error" and cell.reply["ename"] == "KeyboardInterrupt", cell.reply
    err = ANSI.sub("", cell.stream("stderr"))
    assert "interrupted at the debugger's prompt" in err
    # The rank's traceback starts at the user's line and shows none of pdb's and ddip's frames under it.
    assert "cell.py\", line" in err and not re.search(r"bdb\.py|pdb\.py|ddip/rank", err), err
    # The cell shows a KeyboardInterrupt that says what happened, without the magic's frames, as a
    # %%dip cell does (issue 33 row 16).
    [shown] = cell.of_type("error")
    assert shown["ename"] == "KeyboardInterrupt", shown
    assert "run.py" not in "".join(shown["traceback"]) and "forwarded the stop" in shown["traceback"][-1], shown
    assert kernel.run("print('kernel fine')").stream() == "kernel fine\n"


def test_a_rank_on_another_host_prompts_here_and_gets_its_answer(terminal, tmp_path):
    # Rank 1 runs under that host's own `ddip run --node`, reached by a launcher command that
    # runs it right here: the prompt and the answers travel its control channel.
    t = terminal(["run", "--hosts", "localhost:1,here:1", "--launcher", "exec {command} # {host}",
                  "--master-addr", "127.0.0.1", "--", PY, two_ranks(tmp_path)])
    t.expect(r"\[1\] ipdb> ")
    rest = _print_x_and_go_on(t)
    assert "[1] rank 1 goes on with x=41" in rest
    assert "[0] rank 0's stdin: nothing" in rest
    t.close()
    assert t.exitstatus == 0, rest


def test_ctrl_c_at_a_remote_ranks_prompt_stops_the_job_on_every_host(terminal, tmp_path):
    t = terminal(["run", "--hosts", "localhost:1,here:1", "--launcher", "exec {command} # {host}",
                  "--master-addr", "127.0.0.1", "--", PY, two_ranks(tmp_path)])
    t.expect(r"\[1\] ipdb> ")
    t.sendintr()
    t.expect(pexpect.EOF)
    out = ANSI.sub("", t.before)
    assert "[1] KeyboardInterrupt: interrupted at the debugger's prompt" in out, out
    assert "[0] KeyboardInterrupt" in out
    assert "ipdb> " not in out.split("interrupted at the debugger's prompt", 1)[1], out
    t.close()
    assert t.exitstatus == 128 + 2


def test_q_at_a_prompt_ends_that_rank_as_pdb_does_and_the_report_shows_no_records(tmp_path):
    path = script(tmp_path, """
        import os
        if os.environ["RANK"] == "1":
            breakpoint()
        print("rank", os.environ["RANK"], "done", flush=True)
    """)
    p = subprocess.run([DDIP, "run", "-n", "2", "--", PY, path], input="q\n", capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1
    assert "ddip run: rank 1 failed first: exit code 1" in p.stderr
    assert "  | bdb.BdbQuit" in p.stderr  # its report's tail, as pdb ends a script
    assert "\x1e" not in p.stdout + p.stderr  # no prompt record shown, in the output or the report
    assert "[0] rank 0 done" in p.stdout


def test_diprun_across_hosts_asks_a_remote_ranks_prompt_in_the_notebook(kernel, tmp_path):
    fifo = tmp_path / "rank1-went-on"
    os.mkfifo(fifo)
    # 127.0.0.2: another "host" (not this machine's name) whose launcher command runs it right here.
    cell = ("%%diprun --hosts localhost:1,127.0.0.2:1 --launcher 'exec {command} # {host}'\n"
            + textwrap.dedent(TWO_RANKS.format(fifo=str(fifo))))
    answers = ["p x", "c"]
    cell = kernel.run_answering(cell, lambda prompt: answers.pop(0))
    out = ANSI.sub("", cell.stream())
    assert cell.reply["status"] == "ok", (cell.outputs, cell.reply)
    assert kernel.prompts == ["[rank 1] ipdb> ", "[rank 1] ipdb> "]
    assert "[1] 41\n" in out and "[1] rank 1 goes on with x=41" in out
    assert "[0] rank 0's stdin: nothing" in out


def test_ctrl_d_at_a_prompt_is_pdbs_own_end_of_input_for_that_rank(terminal, tmp_path):
    path = script(tmp_path, """
        import os
        if os.environ["RANK"] == "1":
            breakpoint()
        print("rank", os.environ["RANK"], "done", flush=True)
    """)
    t = terminal(["run", "-n", "2", "--", PY, path])
    t.expect(r"\[1\] ipdb> ")
    t.sendeof()  # Ctrl-D: pdb quits, as it does in a terminal; the terminal itself stays open
    t.expect(pexpect.EOF)
    out = ANSI.sub("", t.before)
    assert "[1] bdb.BdbQuit" in out and "rank 1 failed first: exit code 1" in out, out
    assert "rank 0: exit code 0" in out
    t.close()
    assert t.exitstatus == 1


def test_timeout_does_not_count_the_time_at_a_prompt(terminal, tmp_path):
    t = terminal(["run", "-n", "2", "--timeout", "3", "--", PY, two_ranks(tmp_path)])
    t.expect(r"\[1\] ipdb> ")
    # Longer at the prompt than the whole --timeout: the job is not stopped meanwhile.
    assert t.expect([pexpect.EOF, pexpect.TIMEOUT], timeout=4) == 1, t.before
    t.sendline("c")
    t.expect(pexpect.EOF)
    out = ANSI.sub("", t.before)
    assert "[1] rank 1 goes on with x=41" in out and "timed out" not in out, out
    t.close()
    assert t.exitstatus == 0, out


def test_a_rank_left_out_by_tee_still_shows_its_prompts(tmp_path):
    p = subprocess.run([DDIP, "run", "-n", "2", "--show", "0", "--", PY, two_ranks(tmp_path)], input="p x\nc\n",
                       capture_output=True, text=True, timeout=60)
    out = ANSI.sub("", p.stdout)
    assert p.returncode == 0, p.stderr
    assert "[1] ipdb> p x\n[1] 41\n[1] ipdb> c\n" in out
    # Its own output is still --show's (the source lines its debugger lists are not).
    assert "[1] rank 1 stops\n" not in out and "[1] rank 1 goes on with x=41" not in out
    assert "[0] rank 0's stdin: nothing" in out


def test_a_rank_whose_python_has_no_ddip_is_hooked_and_says_why_it_cannot_stop(tmp_path):
    # ddip installed in one environment (pipx, a base environment), the ranks' Python another
    # without it: ddip run's own hook still starts in each rank (found beside the launcher), and a
    # breakpoint says what is missing and how to fix it, where before it was skipped with only
    # Python's "Ignoring unimportable $PYTHONBREAKPOINT".
    bare = tmp_path / "bare"
    subprocess.run([PY, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    python = str(bare / "bin" / "python")
    rank = script(tmp_path, """
        import json, os, signal, sys
        try:
            import ddip
        except ImportError:
            ddip = None
        breakpoint()
        import pdb
        pdb.set_trace()
        print("went on", json.dumps({
            "ddip": ddip is not None, "hook": os.environ.get("DDIP_RUN_HOOK"),
            "threads": len(os.listdir("/proc/self/task")),
            "sigurg_blocked": signal.SIGURG in signal.pthread_sigmask(signal.SIG_BLOCK, [])}), flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONBREAKPOINT", "DDIP_RUN_HOOK")}
    p = subprocess.run([DDIP, "run", "-n", "2", python, rank], capture_output=True, text=True, env=env,
                       stdin=subprocess.DEVNULL, timeout=120)
    assert p.returncode == 0, p.stderr
    # Each rank: no ddip of its own, and the hook started (its thread, SIGURG blocked, its variable
    # gone). Both ranks' lines are alike, so they may come as one: "[0,1] went on {...}".
    seen = {label: json.loads(rest) for label, rest in
            (line.split(" went on ", 1) for line in p.stdout.splitlines() if " went on " in line)}
    assert set(seen) in ({"[0,1]"}, {"[0]", "[1]"}), p.stdout
    assert all(s == {"ddip": False, "hook": None, "threads": 2, "sigurg_blocked": True} for s in seen.values()), \
        p.stdout
    for r in (0, 1):
        said = [line for line in p.stderr.splitlines() if line.startswith(f"[{r}] ddip run: rank {r} reached")]
        assert len(said) == 2, p.stderr  # breakpoint() and pdb.set_trace()
        assert f"its Python ({python}) cannot import ddip" in said[0]
        assert f"{python} -m pip install ddip" in said[0] and "PYTHONBREAKPOINT=0" in said[0]
    assert "Ignoring unimportable" not in p.stderr
