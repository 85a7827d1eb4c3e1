"""`ddip run --timeout` and a Ctrl-C'd `ddip run` print the collective picture (who never joined
which collective, from torch's flight recorder in each rank) and each rank's Python stack before
they stop the ranks (cpp/tools/run_collectives.hpp; each rank answers through ddip's startup hook,
python/ddip/rank/run_hook.py). Real `ddip run`, real gloo, 2 CPU ranks; Ctrl-C through a
pseudo-terminal, as a person types it.

Every launcher a test starts is killed by pid if the test fails midway; its ranks die with it
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap

import pexpect
import pytest

from conftest import DDIP  # noqa: E402
PY = sys.executable

# Rank 1 skips the second all_reduce, which rank 0 waits in. `{issue}` issues rank 0's
# all_reduce; `{wait}` waits for it. Each rank says where it is once it is there.
SKIPS = """
    import os, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 0:
        {issue}
        print("rank 0 waits in its second all_reduce", flush=True)
        {wait}
    else:
        print("rank 1 skips it", flush=True)
        time.sleep(600)  # rank 1 is here
"""
# The same, where the all_reduce rank 1 skips is the group's first collective.
FIRST = SKIPS.replace("    dist.all_reduce(t)\n    if rank", "    if rank")
# Issued, and so in rank 0's flight recorder, before rank 0 says so: a Ctrl-C that follows the
# line finds it there.
ASYNC = dict(issue="work = dist.all_reduce(t, async_op=True)", wait="work.wait()")
PLAIN = dict(issue="pass", wait="dist.all_reduce(t)")


def script(tmp_path, body: str, name="rank.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


from test_run import launcher, wait_for_lines  # noqa: E402,F401  (the fixture: `ddip` started, killed at the end)


@pytest.fixture
def terminal():
    """spawn(args) -> `ddip ARGS` on a pseudo-terminal of its own (pexpect); killed at the end."""
    started = []

    def spawn(args):
        child = pexpect.spawn(DDIP, args, encoding="utf-8", codec_errors="replace", timeout=90,
                              env=dict(os.environ), echo=False)
        started.append(child)
        return child

    yield spawn
    for child in started:
        child.close(force=True)


def check_picture(text: str, missing: int = 1, waiting: int = 0, first: bool = False) -> None:
    """The picture names `missing` as not having entered the all_reduce `waiting` waits in (the
    group's first collective, or its second), and where it is instead; each rank's stack follows
    it: the waiting one in the all_reduce, the missing one at the line of the script where it is."""
    assert "ddip run: collectives (torch's flight recorder):\n" in text, text
    line = 15 if first else 16  # rank.py's `time.sleep(600)  # rank 1 is here`
    at = f"at rank.py:{line}, in time.sleep"
    before = "it has run no collective in this group" if first else r"its last collective was all_reduce #(\d+)"
    m = re.search(rf"=> rank {missing} has not entered all_reduce #(\d+) \(float32\[4\]\), which "
                  rf"rank {waiting} has waited in for [0-9.]+ s; {before}; it is {at}\n", text)
    assert m, text
    n = int(m.group(1))
    assert n == 1 if first else int(m.group(2)) == n - 1
    assert re.search(rf"  rank {waiting}: waiting [0-9.]+ s in all_reduce #{n} \(float32\[4\]\)", text), text
    done = "" if first else f"; last completed: all_reduce #{n - 1}"
    assert f"  rank {missing}: in no collective{done}; {at}\n" in text, text
    stacks = text[m.end():]
    mine = re.search(rf"\[rank {missing}\]\n(.*?)(?=\n\[rank |\nddip run: |\Z)", stacks, re.S)
    theirs = re.search(rf"\[rank {waiting}\]\n(.*?)(?=\n\[rank |\nddip run: |\Z)", stacks, re.S)
    assert mine and theirs, text
    assert 'rank.py", line' in mine.group(1) and "time.sleep(600)  # rank 1 is here" in mine.group(1), text
    assert 'rank.py", line' in theirs.group(1) and "wait" in theirs.group(1), text
    assert "\x1e" not in text, "a record shown as text"


def test_timeout_prints_who_never_joined_the_all_reduce_then_each_ranks_stack(launcher, tmp_path):
    # The issue's case: a plain all_reduce that rank 1 skips, the group's first (10 s: two ranks
    # import torch on two busy cores before they get there).
    p = launcher(["run", "-n", "2", "--timeout", "10", PY, script(tmp_path, FIRST.format(**PLAIN))])
    out, err = p.communicate(timeout=120)
    assert p.returncode == 124, err
    check_picture(err, first=True)
    assert err.index("collectives (torch's flight recorder)") < err.index("timed out after 10 s"), err
    # Then exactly as before: the ranks stopped, the report.
    assert "  rank 1: killed by SIGTERM (stopped by ddip run)\n" in err
    assert "[1] rank 1 skips it" in out and "\x1e" not in out


def _interrupted(t) -> str:
    """Ctrl-C once both ranks are where SKIPS puts them; what ddip run printed from then on."""
    said = set()
    while len(said) < 2:  # in whichever order they come
        said.add(t.expect_exact(["rank 0 waits in its second all_reduce", "rank 1 skips it"]))
    t.sendintr()
    t.expect(pexpect.EOF)
    return t.before.replace("\r\n", "\n")


def test_ctrl_c_prints_the_same_and_the_job_stops(terminal, tmp_path):
    t = terminal(["run", "-n", "2", PY, script(tmp_path, FIRST.format(**ASYNC))])
    text = _interrupted(t)
    check_picture(text, first=True)
    assert "forwarded SIGINT" in text, text  # then as before: the interrupt reaches the ranks
    t.close()
    assert t.exitstatus == 128 + 2, text


def test_a_remote_ranks_answer_comes_through_its_hosts_ddip_run(terminal, tmp_path):
    # Rank 1 runs under that host's own `ddip run --node`, reached by a launcher command that
    # runs it right here: Collect goes down its control channel, its answer comes back up.
    t = terminal(["run", "--hosts", "localhost:1,here:1", "--launcher", "exec {command} # {host}",
                  "--master-addr", "127.0.0.1", PY, script(tmp_path, SKIPS.format(**ASYNC))])
    check_picture(_interrupted(t))


def test_the_hook_leaves_the_ranks_environment_as_the_user_gave_it_and_its_children_unhooked(launcher, tmp_path):
    probe = textwrap.dedent("""
        import json, os, signal, sys
        print(sys.argv[1], json.dumps({
            "hook": os.environ.get("DDIP_RUN_HOOK"), "pythonpath": os.environ.get("PYTHONPATH"),
            "on_path": [p for p in sys.path if "ddip-run-" in p],
            "threads": len(os.listdir("/proc/self/task")),
            "sigurg_blocked": signal.SIGURG in signal.pthread_sigmask(signal.SIG_BLOCK, [])}), flush=True)
    """)
    (tmp_path / "probe.py").write_text(probe)
    rank = script(tmp_path, f"""
        import subprocess, sys
        exec(open({str(tmp_path / "probe.py")!r}).read().replace("sys.argv[1]", "'rank'"))
        subprocess.run([sys.executable, {str(tmp_path / "probe.py")!r}, "child"], check=True)
    """)
    # The user's own entry, then where this Python finds ddip when that is PYTHONPATH (an install
    # with pip's --target): the hook is ddip's, found as the rank finds ddip.
    own = os.pathsep.join(filter(None, ["/the/users/own", os.environ.get("PYTHONPATH")]))
    p = launcher(["run", "-n", "1", PY, rank], env={"PYTHONPATH": own})
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    seen = {line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2]) for line in out.splitlines()}
    # The rank: its own thread waits for SIGURG; nothing of the hook shows in what it reads.
    assert seen["rank"] == {"hook": None, "pythonpath": own, "on_path": [], "threads": 2,
                            "sigurg_blocked": True}, out
    # Its child: no hook, no thread of it; SIGURG blocked as inherited, and never sent to it.
    assert seen["child"]["hook"] is None and seen["child"]["pythonpath"] == own, out
    assert seen["child"]["threads"] == 1, out


def test_ddip_run_hook_0_turns_it_off(launcher, tmp_path):
    probe = script(tmp_path, """
        import os, signal
        print("hook", os.environ.get("DDIP_RUN_HOOK"), len(os.listdir("/proc/self/task")),
              signal.SIGURG in signal.pthread_sigmask(signal.SIG_BLOCK, []), flush=True)
    """, name="probe.py")
    p = launcher(["run", "-n", "1", PY, probe], env={"DDIP_RUN_HOOK": "0"})
    out, err = p.communicate(timeout=60)
    assert out == "[0] hook 0 1 False\n", (out, err)


def test_ddip_run_hook_0_gives_no_picture_at_ctrl_c(terminal, tmp_path):
    # With the skipped all_reduce: Ctrl-C interrupts the ranks as it did before the hook.
    t = terminal(["run", "-n", "2", "--env", "DDIP_RUN_HOOK=0", PY, script(tmp_path, SKIPS.format(**ASYNC))])
    text = _interrupted(t)
    assert "collectives" not in text and "no answer" not in text and "forwarded SIGINT" in text, text


def test_nothing_is_printed_when_no_rank_uses_torch_distributed(launcher, tmp_path):
    path = script(tmp_path, """
        import time
        print("ready", flush=True)
        time.sleep(600)
    """)
    p = launcher(["run", "-n", "2", "--timeout", "3", PY, path])
    out, err = p.communicate(timeout=60)
    assert p.returncode == 124, err
    assert err.startswith("ddip run: timed out after 3 s"), err
    assert "collectives" not in err and "[rank " not in err and "no answer" not in err, err


def test_a_rank_that_answered_ends_as_it_would_have(launcher, tmp_path):
    # Asked at Ctrl-C, then interrupted: each rank catches the interrupt and exits 0 at once. The
    # thread that answered must not hold up the rank's exit (a module that imports threading,
    # imported first on that thread, would make Python wait for it at exit until the SIGKILL).
    path = script(tmp_path, """
        import os, sys, time
        try:
            print("ready", flush=True)
            time.sleep(600)
        except KeyboardInterrupt:
            print("rank", os.environ["RANK"], "leaves", flush=True)
            sys.exit(0)
    """)
    p = launcher(["run", "-n", "2", PY, path])
    assert [line.split(" ", 1)[1] for line in wait_for_lines(p, 2)] == ["ready\n"] * 2  # both ranks'
    p.send_signal(2)
    out, err = p.communicate(timeout=60)
    assert "[0] rank 0 leaves" in out and "[1] rank 1 leaves" in out, (out, err)
    assert "SIGKILL" not in err, err
    assert p.returncode == 128 + 2, err
