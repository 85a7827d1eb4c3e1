"""Debugging a rank through a real Jupyter kernel: %dipdebug (pdb post-mortem in a rank),
%dippdb, and breakpoint() in code a rank runs. The kernel runs with allow_stdin, and the test
answers its input_request messages on the stdin channel, as JupyterLab does (kc.input)."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import re
import time

import pytest

from ddip.errors import strip_ansi
from ddip.magics import DebugMagics
from test_magics import Cell, Kernel, disagreements, running_kernel

GROUP = "%makedip -n 2 --backend none"
PROMPT = re.compile(r"^\[rank (\d+)\] ipdb> $")

FAILS_ON_RANK_1 = """%%dip
import os
RANK = int(os.environ["RANK"])
def inner(a):
    secret = a * 1000 + 7
    if RANK == 1:
        raise ValueError(f"inner failed with {secret}")
    return secret
def outer():
    outer_only = f"outer of rank {RANK}"
    return inner(RANK)
outer()
"""


class Answering(Kernel):
    """A kernel whose cells may ask for input: each input_request is answered by
    answer(prompt) -> the line to type, and every prompt is kept in `prompts`."""

    def run_answering(self, code: str, answer, timeout: float = 60) -> Cell:
        self.prompts = []
        outputs = []
        msg_id = self.kc.execute(code, allow_stdin=True, stop_on_error=False)
        deadline = time.monotonic() + timeout
        idle = False
        while not idle:
            if time.monotonic() > deadline:
                raise AssertionError(f"cell did not finish within {timeout} s; prompts {self.prompts}, "
                                     f"outputs so far: {outputs}")
            self._answer_waiting(msg_id, answer)
            idle = self._take_iopub(msg_id, outputs)
        while True:
            reply = self.kc.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                return Cell(outputs, reply["content"])

    def _answer_waiting(self, msg_id, answer):
        try:
            msg = self.kc.get_stdin_msg(timeout=0.02)
        except queue.Empty:
            return
        if msg["msg_type"] == "input_request" and msg["parent_header"].get("msg_id") == msg_id:
            prompt = msg["content"]["prompt"]
            self.prompts.append(prompt)
            line = answer(prompt)
            if line is not None:  # None: left unanswered
                self.kc.input(line)

    def _take_iopub(self, msg_id, outputs) -> bool:
        try:
            msg = self.kc.get_iopub_msg(timeout=0.02)
        except queue.Empty:
            return False
        if msg["parent_header"].get("msg_id") != msg_id:
            return False
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status":
            return content["execution_state"] == "idle"
        if kind == "stream":
            outputs.append({"type": "stream", "name": content["name"], "text": content["text"]})
        elif kind == "error":
            outputs.append({"type": "error", "ename": content["ename"], "evalue": content["evalue"],
                            "traceback": content["traceback"]})
        return False


def script(*lines):
    """answer() typing `lines` in turn, whatever the prompt."""
    left = list(lines)
    return lambda prompt: left.pop(0)


def per_rank(**scripts):
    """answer() typing, at rank N's prompts, the lines of scripts["rN"] in turn."""
    left = {int(k[1:]): list(v) for k, v in scripts.items()}
    return lambda prompt: left[int(PROMPT.match(prompt).group(1))].pop(0)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with running_kernel(tmp_path_factory.mktemp("jupyter"), wrap=Answering) as k:
        assert k.run(GROUP).ok
        yield k
        k.run("%makedip -k")


def text_of(cell: Cell) -> str:
    return strip_ansi(cell.stream() + cell.stream("stderr")
                      + "".join("\n".join(o["traceback"]) for o in cell.of_type("error")))


def fail_on_rank_1(kernel):
    cell = kernel.run(FAILS_ON_RANK_1)
    assert not cell.ok and "inner failed with 1007" in text_of(cell), cell.outputs


def test_dipdebug_opens_pdb_in_the_root_cause_rank_with_its_frames_alive(kernel):
    fail_on_rank_1(kernel)
    cell = kernel.run_answering("%dipdebug", script("p secret", "up", "p outer_only", "where", "q"))
    assert cell.ok, cell.outputs
    assert kernel.prompts == ["[rank 1] ipdb> "] * 5
    out = strip_ansi(cell.stream())
    # The failing frame's local, rank 1's own value (rank 0's would be 7); then the caller's.
    assert "[rank 1] 1007" in out, out
    assert "[rank 1] 'outer of rank 1'" in out, out
    where = out.split("'outer of rank 1'", 1)[1]
    assert re.search(r"\[rank 1\] .*\(\d+\)outer\(\)", where) and re.search(r"\[rank 1\] .*\(\d+\)inner\(\)", where), out
    # q left pdb; the rank and the group are as before.
    after = kernel.run("%%dip --see all\nprint('still here', RANK)")
    assert after.ok, after.outputs
    assert "still here 0" in after.stream() and "still here 1" in after.stream(), after.outputs


def test_dipdebug_names_a_rank_without_an_exception_and_a_bad_rank(kernel):
    kernel.run("%makedip -r")  # fresh ranks: none has raised
    cell = kernel.run("%dipdebug -r 0")
    assert not cell.ok and "rank 0 has no exception to debug" in text_of(cell), cell.outputs
    cell = kernel.run("%dipdebug -r 5")
    assert not cell.ok and "the group's ranks are 0, 1" in text_of(cell), cell.outputs


def test_dippdb_on_opens_the_debugger_after_a_failed_cell(kernel):
    assert "is on" in kernel.run("%dippdb on").stream()
    try:
        cell = kernel.run_answering(FAILS_ON_RANK_1, script("p a", "q"))
    finally:
        assert "is off" in kernel.run("%dippdb off").stream()
    assert not cell.ok and kernel.prompts == ["[rank 1] ipdb> "] * 2, (kernel.prompts, cell.outputs)
    out = strip_ansi(cell.stream())
    assert "[rank 1] 1" in out.splitlines(), out
    assert "inner failed with 1007" in text_of(cell)


def test_breakpoint_on_both_ranks_prompts_each_in_turn_and_continues(kernel):
    code = ("%%dip --see all\nimport os\nx = int(os.environ['RANK']) * 10 + 3\nbreakpoint()\n"
            "print('after the breakpoint', x)")
    cell = kernel.run_answering(code, per_rank(r0=["p x", "c"], r1=["p x", "c"]))
    assert cell.ok, (kernel.prompts, cell.outputs)
    assert sorted(kernel.prompts) == ["[rank 0] ipdb> "] * 2 + ["[rank 1] ipdb> "] * 2, kernel.prompts
    # One rank's session at a time: its two prompts follow each other.
    assert kernel.prompts[0] == kernel.prompts[1], kernel.prompts
    out = strip_ansi(cell.stream())
    assert "[rank 0] 3" in out.splitlines() and "[rank 1] 13" in out.splitlines(), out
    assert "after the breakpoint 3" in out and "after the breakpoint 13" in out, out


def test_prompts_come_in_the_order_the_ranks_stopped_not_by_rank(kernel, tmp_path):
    """Rank 1 stops first (rank 0 reaches its breakpoint only once rank 1's prompt was shown): its
    prompt comes first, as debugging.md says (issue 33 row 14)."""
    shown = tmp_path / "rank 1 prompted"
    code = (f"%%dip --see all\nimport os, time\nx = int(os.environ['RANK'])\nif x == 0:\n"
            f"    while not os.path.exists({str(shown)!r}): time.sleep(0.01)\nbreakpoint()\nprint('went on', x)")
    left = {0: ["c"], 1: ["p x", "c"]}

    def answer(prompt):
        rank = int(PROMPT.match(prompt).group(1))
        shown.touch()
        return left[rank].pop(0)

    cell = kernel.run_answering(code, answer)
    assert cell.ok, (kernel.prompts, cell.outputs)
    assert kernel.prompts == ["[rank 1] ipdb> "] * 2 + ["[rank 0] ipdb> "], kernel.prompts


def test_a_rank_at_a_prompt_past_the_heartbeat_timeout_and_the_timeout_goes_on(kernel):
    setup = kernel.run("import ddip, pdb\ng = ddip.Group(n=1, backend=None, heartbeat_timeout=1.0)\n"
                       "def f(v):\n    w = v + 1\n    pdb.set_trace()\n    return w * 2")
    assert setup.ok, setup.outputs

    def slow(prompt):
        time.sleep(2.5)  # the user thinks at the prompt, longer than the heartbeat timeout
        return "c"

    try:
        cell = kernel.run_answering("print('result', g.apply(f, 20))\n"
                                    "r = g.run('v = 5\\nbreakpoint()\\nv * 3', timeout=1.5)\n"
                                    "print('run', r[0].value)", slow)
        assert cell.ok, cell.outputs
        assert kernel.prompts == ["[rank 0] ipdb> "] * 2
        # Neither unresponsive (heartbeats went on) nor timed out (time at a prompt is the user's).
        assert "result [42]" in cell.stream() and "run 15" in cell.stream(), cell.outputs
        status = kernel.run("print([r['state'] for r in g.status()])")
        assert "['idle']" in status.stream(), status.outputs
    finally:
        kernel.run("g.close()")


def test_without_stdin_a_breakpoint_says_so_and_the_rank_continues(kernel):
    msg_id = kernel.kc.execute("%%dip --see all --raw\nx = 2\nbreakpoint()\nprint('went on', x)",  # each rank's line
                               allow_stdin=False, stop_on_error=False)
    outputs = []
    deadline = time.monotonic() + 60
    while not kernel._take_iopub(msg_id, outputs):
        assert time.monotonic() < deadline, outputs
    cell = Cell(outputs, None)
    assert cell.stream().count("went on 2") == 2, outputs
    assert "[rank 1] stopped at a debugger prompt, but this frontend can't take input" in cell.stream("stderr"), outputs


def test_dipdebug_and_dippdb_help_and_docs_agree():
    assert disagreements("dipdebug", DebugMagics.dipdebug) == []
    assert disagreements("dippdb", DebugMagics.dippdb) == []


def test_the_stop_button_at_a_prompt_ends_the_cell_and_leaves_the_group_usable(kernel):
    def stop(prompt):
        kernel.km.interrupt_kernel()  # what the stop button does; the prompt stays unanswered
        return None

    code = "%%dip --see all\nimport os\nx = 1\nif os.environ['RANK'] == '1':\n    breakpoint()\nprint('went on', x)"
    cell = kernel.run_answering(code, stop)
    assert not cell.ok and kernel.prompts == ["[rank 1] ipdb> "], (kernel.prompts, cell.outputs)
    text = text_of(cell)
    assert "KeyboardInterrupt" in text and "went on" in cell.stream(), cell.outputs
    after = kernel.run("%%dip --see all\nprint('still here', os.environ['RANK'])")
    assert after.ok and "still here 0" in after.stream() and "still here 1" in after.stream(), after.outputs


def test_group_debug_from_plain_python_asks_on_its_stdin():
    # Group.debug() outside Jupyter: input() reads the terminal (here a pipe); the default rank
    # is the root cause of the last failed apply.
    script = """
import os, ddip
g = ddip.Group(n=2, backend=None)
for bad in (None, "1", True, 7):  # nothing failed yet, not a rank, not a rank of the group
    try:
        g.debug(bad)
    except (LookupError, TypeError, ValueError) as exc:
        print("refused:", type(exc).__name__, exc)
def f():
    local_of_f = int(os.environ["RANK"]) * 100 + 1
    if local_of_f == 101:
        raise KeyError(local_of_f)
try:
    g.apply(f)
except ddip.RemoteError as exc:
    print("failed on", exc.ranks)
g.debug()
print("after", g.apply(lambda: os.environ["RANK"]))
g.close()
"""
    proc = subprocess.run([sys.executable, "-c", script], input="p local_of_f\nq\n", capture_output=True,
                          text=True, timeout=60)
    out = strip_ansi(proc.stdout)
    assert proc.returncode == 0, (out, proc.stderr)
    assert "failed on [1]" in out and out.count("[rank 1] ipdb> ") == 2, out
    assert "[rank 1] 101" in out and "after ['0', '1']" in out, out
    refused = [line for line in out.splitlines() if line.startswith("refused:")]
    assert refused == ["refused: LookupError nothing to debug: no run or apply of this group has failed since "
                       "it started; give the rank: debug(rank=1)",
                       "refused: TypeError rank must be a rank number, got '1'",
                       "refused: TypeError rank must be a rank number, got True",
                       "refused: ValueError no rank 7 in this group (ranks: [0, 1])"], out


def test_the_stop_button_at_a_post_mortem_prompt_keeps_the_exception_to_debug_again(kernel):
    fail_on_rank_1(kernel)

    def stop(prompt):
        kernel.km.interrupt_kernel()
        return None

    cell = kernel.run_answering("%dipdebug", stop)
    assert not cell.ok and kernel.prompts == ["[rank 1] ipdb> "], (kernel.prompts, cell.outputs)
    assert "KeyboardInterrupt" in text_of(cell), cell.outputs
    cell = kernel.run_answering("%dipdebug", script("p secret", "q"))
    assert cell.ok and "[rank 1] 1007" in strip_ansi(cell.stream()), cell.outputs


def test_a_breakpoint_that_cannot_prompt_is_skipped_with_a_note_and_pythonbreakpoint_0_is_kept(kernel):
    # In a thread of the rank's own: nobody waits for its prompt, so it says so and goes on.
    cell = kernel.run("%%dip\nimport threading\nt = threading.Thread(target=breakpoint, name='work')\nt.start()\n"
                      "t.join()\nprint('joined')")
    assert cell.ok and "joined" in cell.stream(), cell.outputs
    # The true reason: the cell runs, but the breakpoint is in another thread (row 9 of issue 33).
    assert ("breakpoint() on rank 0 was skipped: it is in thread 'work', and only the thread that runs "
            "the cell") in cell.stream("stderr"), cell.outputs
    assert "no request is running" not in cell.stream("stderr")
    cell = kernel.run("%%dip\nimport os\nos.environ['PYTHONBREAKPOINT'] = '0'\ntry:\n    breakpoint()\n"
                      "finally:\n    del os.environ['PYTHONBREAKPOINT']\nprint('not stopped')")
    assert cell.ok and "not stopped" in cell.stream() and not cell.stream("stderr"), cell.outputs


RANCH_BREAKPOINT = """import ddip
def fn():
    import os, torch, torch.distributed as dist
    x = int(os.environ["RANK"]) * 10 + 1
    if dist.get_rank() == 1:
        breakpoint()
    t = torch.tensor([float(x)])
    dist.all_reduce(t)  # the notebook's rank 0 waits here while rank 1 is at its prompt
    return int(t.item())
print("ranch", ddip.ranch(2, fn, ctx=ddip.TorchDDPCtx()))
"""


def test_a_ranch_childs_breakpoint_prompts_in_the_notebook_while_its_rank_0_waits(kernel):
    cell = kernel.run_answering(RANCH_BREAKPOINT, script("p x", "c"), timeout=90)
    assert cell.ok, (kernel.prompts, cell.outputs)
    assert kernel.prompts == ["[rank 1] ipdb> "] * 2, kernel.prompts
    out = strip_ansi(cell.stream())
    assert "[rank 1] 11" in out.splitlines() and "ranch [12, 12]" in out, out


def test_a_ranch_childs_breakpoint_in_a_script_whose_stdin_ended_goes_on(tmp_path):
    path = tmp_path / "launch.py"
    path.write_text(RANCH_BREAKPOINT)
    p = subprocess.run([sys.executable, str(path)], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=90)
    assert p.returncode == 0, p.stderr
    assert "ranch [12, 12]" in p.stdout  # no BdbQuit: the rank went on
    assert ("ddip: [rank 1] stopped at a debugger prompt, but this process's stdin is at its end (not a "
            "terminal); it continues") in p.stderr, p.stderr


def test_a_breakpoint_on_a_rank_of_another_host_prompts_here(tmp_path):
    # A "host" whose agent runs right here over loopback TCP (as in test_multihost_launch.py):
    # the prompt and the answers travel the host's link like the rank's other frames.
    path = tmp_path / "hosts.py"
    path.write_text(
        "import ddip\n"
        "g = ddip.Group(hosts='localhost:1,here:1', launcher='exec {command} # {host}', bind='127.0.0.1',\n"
        "               backend=None)\n"
        "r = g.run(\"import os\\nx = int(os.environ['RANK']) * 10 + 1\\nif os.environ['RANK'] == '1':\\n\"\n"
        "          \"    breakpoint()\\nx\")\n"
        "print('values', [v.value for v in r])\n"
        "g.close()\n"
        "ddip.hosts.release()\n")
    p = subprocess.run([sys.executable, str(path)], input="p x\nc\n", capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stderr
    out = strip_ansi(p.stdout)
    assert "[rank 1] ipdb> [rank 1] 11\n" in out and "values [1, 11]" in out, out


def test_dip_ranks_runs_a_cell_on_the_chosen_ranks_only(kernel):
    assert kernel.run("%%dip\nimport os\nmine = 'rank ' + os.environ['RANK']").ok
    patched = kernel.run("%%dip --ranks 1  # patch one rank's state\nmine = mine + ' patched'\nmine")
    assert patched.ok, patched.outputs
    assert "Out[1:" in patched.plain[0] and "'rank 1 patched'" in patched.plain[0], patched.outputs
    cell = kernel.run("%%dip --see all\nmine")
    assert [p.split(": ", 1)[1] for p in cell.plain] == ["'rank 0'", "'rank 1 patched'"], cell.outputs
    bad = kernel.run("%%dip --ranks 1 --see 0\nmine")
    assert not bad.ok and "--see 0 names rank(s) 0, which --ranks 1 leaves out" in bad.stream("stderr") + str(
        bad.outputs), bad.outputs
    assert not kernel.run("%%dip --ranks 5\nmine").ok


def test_a_kernel_that_dies_while_ranks_wait_at_prompts_takes_them_along(tmp_path_factory):
    from conftest import alive, wait_until

    with running_kernel(tmp_path_factory.mktemp("jupyter"), wrap=Answering) as k:
        assert k.run(GROUP).ok
        cell = k.run("%%dip --see all\nimport os\nos.getpid()")
        pids = [int(p.rsplit(": ", 1)[1]) for p in cell.plain]
        assert len(pids) == 2 and all(alive(p) for p in pids), cell.plain
        msg_id = k.kc.execute("%%dip\nbreakpoint()\n'never'", allow_stdin=True, stop_on_error=False)
        deadline = time.monotonic() + 60
        while True:  # the first prompt is up: both ranks are paused (one at it, one queued)
            assert time.monotonic() < deadline, "no prompt came"
            try:
                msg = k.kc.get_stdin_msg(timeout=0.1)
            except queue.Empty:
                continue
            if msg["msg_type"] == "input_request" and msg["parent_header"].get("msg_id") == msg_id:
                break
        k.km.signal_kernel(signal.SIGKILL)  # no clean-up code of the kernel runs
        # The ranks, paused at their prompts, go with it (the runtime's kernel-death handling).
        assert wait_until(lambda: not any(alive(p) for p in pids), 30), [p for p in pids if alive(p)]


def test_a_ranch_breakpoint_prompts_on_rank_0_the_notebook_too(kernel):
    """The notebook plays rank 0: its breakpoint() prompts as the child's does, labelled, one
    prompt at a time (issue 33 row 8); not the kernel's own hook, which is silent outside
    JupyterLab's debugger."""
    answers = {"[rank 0] ipdb> ": ["p x * 2", "c"], "[rank 1] ipdb> ": ["p x * 2", "c"]}
    # The child's prompt shows fn's lines as the notebook has them, not "<dynamic-code>" alone.
    cell = kernel.run_answering("import ddip, os\ndef fn2():\n    x = int(os.environ['RANK']) * 7 + 1\n"
                                "    breakpoint()\n    return x\nprint('ranch', ddip.ranch(2, fn2))",
                                lambda prompt: answers[prompt].pop(0), timeout=90)
    assert cell.ok, (kernel.prompts, cell.outputs)
    assert sorted(kernel.prompts) == ["[rank 0] ipdb> "] * 2 + ["[rank 1] ipdb> "] * 2, kernel.prompts
    # One rank's session at a time: its two prompts come one after the other.
    assert kernel.prompts[0] == kernel.prompts[1] and kernel.prompts[2] == kernel.prompts[3], kernel.prompts
    out = strip_ansi(cell.stream())
    assert "\n2\n" in "\n" + out and "[rank 1] 16" in out and "ranch [1, 8]" in out, out
    assert re.search(r"\[rank 1\] -+> 5 +return x", out) and "dynamic-code" not in out, out
