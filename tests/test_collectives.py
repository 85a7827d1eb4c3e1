"""A hang named by its collective: torch's flight recorder, on in every rank ddip starts, read
from each rank while it waits (rank/collectives.py) and put together in the kernel
(kernel/collectives.py): who has not entered the collective the others wait in, who disagrees
about it. Real ranks with gloo; the magics' side through a real Jupyter kernel."""

from __future__ import annotations

import re

import pytest

import ddip
from conftest import wait_until
from ddip.errors import strip_ansi
from test_magics import running_kernel

SETUP = "import time, torch, torch.distributed as dist\nt = torch.ones(1024)\ndist.all_reduce(t)"
# Rank 0 enters the next all_reduce at once; rank 1 is elsewhere (asleep) and joins it later.
LATE = """
def late(seconds):
    if dist.get_rank() == 1:
        time.sleep(seconds)
    dist.all_reduce(t)
"""


@pytest.fixture(scope="module")
def g():
    with ddip.Group(n=2, backend="gloo") as group:
        group.run(SETUP)
        yield group


def _waiting(g, rank):
    return rank in g.collectives(timeout=2.0).waiting


def _settled(g):
    """The picture once no rank reads as waiting. Gloo retires a flight-recorder entry on its own
    thread just after the caller's wait has returned, so a collective that has just completed can
    read as pending for a moment (measured: 1 snapshot in 8 taken right after all_reduce
    returned)."""
    assert wait_until(lambda: not g.collectives().waiting, 10), g.collectives().describe()
    return g.collectives()


def test_stacks_lead_with_the_rank_that_never_joined_the_collective(g):
    g.run(LATE)
    pending = g.apply_async(lambda s: __import__("__main__").late(s), 6)
    assert wait_until(lambda: _waiting(g, 0), 30)
    stacks = g.stacks()
    picture = stacks.collectives
    assert set(picture.waiting) == {0} and set(picture.missing) == {1}
    assert picture.findings[0].startswith("rank 1 has not entered all_reduce #2 (float32[1024]), which "
                                          "rank 0 has waited in for ")
    # Where rank 1 is instead: the cell's function it runs, and the call it is in there.
    assert picture.findings[0].endswith("; its last collective was all_reduce #1; it is in late() at cell "
                                        "line 3, in time.sleep"), picture.findings[0]
    text = str(stacks)
    assert text.startswith("collectives (torch's flight recorder):\n  rank 0: waiting ")
    assert "  rank 1: in no collective; last completed: all_reduce #1; in late() at cell line 3, in time.sleep\n" in text
    assert text.index("=> rank 1 has not entered") < text.index("[rank 0]\n") < text.index("[rank 1]\n")
    assert " in late\n" in stacks[1], stacks[1]  # the stacks follow, as before
    pending.result()  # rank 1 wakes and joins: #2 completes on both
    picture = _settled(g)
    assert picture.findings == [] and picture.waiting == {}


def test_a_timed_out_request_names_the_ranks_that_disagree_about_a_collective(g):
    with pytest.raises(TimeoutError) as e:
        g.run("dist.all_reduce(torch.ones(1024)) if dist.get_rank() == 0 else dist.broadcast(torch.ones(512), 0)",
              timeout=1.0)
    message = str(e.value)
    assert "did not stop and are still busy" in message
    picture = e.value.collectives
    assert picture.mismatched == {0, 1}
    assert ("=> ranks disagree about collective #" in message
            and "rank 0: all_reduce float32[1024]; rank 1: broadcast float32[512]" in message), message
    # Heal rebuilds the group, whose collectives number from #1 again: only the new ones count.
    assert g.heal().ok
    g.run("dist.all_reduce(t)")
    picture = _settled(g)
    assert picture.findings == [] and picture.waiting == {}
    assert all(line.endswith("last completed: all_reduce #1") for line in picture.rank_lines())


def test_a_rank_that_raised_before_a_collective_is_healed_at_once_with_the_picture(g):
    with pytest.raises(ddip.RemoteError) as e:
        g.run("if dist.get_rank() == 1: raise ValueError('bad batch')\ndist.all_reduce(t)")
    err = e.value
    assert (err.failures[0].rank, err.failures[0].ename) == (1, "ValueError")
    # The heal started from what the flight recorder showed: rank 0 waiting in the collective
    # rank 1 never entered (not after a fixed grace: the picture is what the heal acted on).
    assert err.collectives is not None and set(err.collectives.missing) == {1}
    assert set(err.collectives.waiting) == {0}
    assert err.heal is not None and err.heal.ok and err.heal.failed == [1] and err.heal.released == [0]
    assert str(err).index("=> rank 1 has not entered all_reduce") < str(err).index("--- rank 1: ValueError")
    values = [r.value for r in g.run("dist.all_reduce(t); int(t[0])")]
    assert values[0] == values[1]  # the rebuilt group runs collectives again


def test_a_rank_that_left_torch_distributed_says_so_and_heal_brings_it_back(g):
    # (Under gloo a peer's collective fails at once when a rank leaves: its connections close. The
    # picture of one that waits for a rank that left is cpp/tests/test_collectives.cpp's.)
    g.run("dist.destroy_process_group()", ranks=[1])
    assert g.collectives().rank_lines()[1] == "rank 1: has left torch.distributed (destroy_process_group)"
    assert g.heal().ok
    assert g.run("dist.all_reduce(t); int(t[0])")[0].value == g.run("int(t[0])")[1].value


def test_a_slow_rank_is_waited_for_and_the_heal_decides_from_the_picture(g):
    # Rank 1 raises; rank 0 reaches the collective only after a while. The picture is read again
    # until rank 0 waits in it; the heal and its summary come from that picture.
    with pytest.raises(ddip.RemoteError) as e:
        g.run("if dist.get_rank() == 1:\n    raise ValueError('bad batch')\ntime.sleep(1.0)\ndist.all_reduce(t)")
    picture = e.value.collectives
    assert picture is not None and set(picture.missing) == {1} and set(picture.waiting) == {0}, picture
    assert "disagree" not in picture.describe()
    assert e.value.heal is not None and e.value.heal.ok and e.value.heal.released == [0]


def test_a_rank_that_answers_slowly_is_waited_for(g):
    # A thread of rank 0 holds the GIL in C code (a regular expression that backtracks for about
    # half a second at a time), so its answers come late: the heal's look waits for them instead
    # of reading rank 0 as silent, and decides from them. The hog ends by itself after a few
    # rounds: while it runs, rank 0 gets the GIL once per round, so leaving the collective and
    # formatting its traceback (hundreds of GIL hand-offs) would take minutes under it.
    g.run("import re, threading\nhogging = True\ndef hog():\n    for _ in range(4):\n"
          "        if not hogging: break\n        re.match(r'(a+)+$', 'a' * 22 + 'b')\n", ranks=[0])
    g.run("threading.Thread(target=hog, daemon=True).start()", ranks=[0])
    try:
        with pytest.raises(ddip.RemoteError) as e:
            g.run("if dist.get_rank() == 1:\n    raise ValueError('bad batch')\ndist.all_reduce(t)")
    finally:
        g.run("hogging = False", ranks=[0])
    picture = e.value.collectives
    assert picture is not None and set(picture.missing) == {1} and set(picture.waiting) == {0}, picture
    assert "did not answer" not in picture.describe()
    assert e.value.heal is not None and e.value.heal.ok


def test_a_rank_dependent_shape_aborts_a_rank_under_gloo_and_the_picture_says_why(g):
    # gloo does not wait for ever here: the rank that receives more than it expects aborts
    # (EnforceNotMet). The survivor's record says what it gave; the dead rank's last words, what
    # gloo found.
    with pytest.raises(ddip.RemoteError) as e:
        g.run("dist.all_reduce(torch.ones(1024 if dist.get_rank() == 0 else 512))")
    err = e.value
    dead = err.failures[0]
    assert dead.died and "SIGABRT" in dead.evalue, dead
    survivor = 1 - dead.rank
    finding = [f for f in err.collectives.findings if f.startswith(f"rank {dead.rank} died")]
    assert finding, err.collectives.describe()
    mine = "1024" if survivor == 0 else "512"
    assert re.search(rf"rank {dead.rank} died \(killed by SIGABRT\); rank {survivor}'s last collective: all_reduce "
                     rf"#\d+ \(float32\[{mine}\]\); rank {dead.rank}'s last words: .*EnforceNotMet.* 1024 vs 512\.",
                     finding[0]), finding[0]
    assert str(err).index("collectives (torch's flight recorder)") < str(err).index(f"--- rank {dead.rank}")
    assert g.heal().ok  # the dead rank is replaced, the group goes on
    g.run(SETUP)


def test_ranks_without_a_flight_recorder_say_why():
    with ddip.Group(n=2, backend=None) as g:  # torch.distributed never set up
        picture = g.collectives()
        assert not picture.known and picture.describe() == ""
        assert picture.rank_lines() == ["rank 0: torch.distributed is not initialized",
                                        "rank 1: torch.distributed is not initialized"]
        assert str(g.stacks()).startswith("[rank 0]\n")  # only the stacks, as before
    with ddip.Group(n=2, backend="gloo", env={"TORCH_FR_BUFFER_SIZE": "0"}) as g:
        g.run(SETUP)
        assert g.run("import os; os.environ['TORCH_FR_BUFFER_SIZE']")[0].value == "0"  # the user's choice
        assert g.collectives().rank_lines()[0] == "rank 0: torch's flight recorder is off (TORCH_FR_BUFFER_SIZE=0)"


# The set-up: a group that has run no collective yet.
SET_UP = "%%dip\nimport os, time, pathlib, torch, torch.distributed as dist\nrank = int(os.environ['RANK'])"
# Rank 1 skips the group's first collective: it is at line 5 of the cell.
FIRST = "%%dip --timeout 1\nt = torch.ones(16)\nif rank == 0:\n    dist.all_reduce(t)\nelse:\n    time.sleep(60)"
T = r"[0-9]+\.[0-9] s"


def _shown(cell) -> str:
    return strip_ansi(cell.stream() + cell.stream("stderr")
                      + "".join("\n".join(o["traceback"]) for o in cell.of_type("error")))


def test_the_picture_in_a_notebook_for_a_groups_first_collective_after_heals_and_at_the_stop_button(
        tmp_path_factory, tmp_path):
    with running_kernel(tmp_path_factory.mktemp("jupyter")) as k:
        assert k.run("%makedip -n 2").ok
        assert k.run(SET_UP).ok
        # The first collective, timed out: rank 1 is located where it is, from before the interrupt.
        shown = _shown(k.run(FIRST))
        assert re.search(r"\n  rank 0: waiting " + T + r" in all_reduce #1 \(float32\[16\]\)\n"
                         r"  rank 1: in no collective; at cell line 5, in time.sleep\n"
                         r"=> rank 1 has not entered all_reduce #1 \(float32\[16\]\), which rank 0 has waited in "
                         r"for " + T + r"; it has run no collective in this group; it is at cell line 5, in "
                         r"time.sleep\n", shown), shown
        # Only rank 0 did not stop; its stack is the cell's line and torch's frames, ddip's and
        # IPython's folded into one line.
        assert shown.index("=> rank 1 has not entered") < shown.index("[rank 0] did not stop; where it was:"), shown
        assert "[rank 1] did not stop" not in shown
        stack = shown[shown.index("[rank 0] did not stop; where it was:"):]
        assert re.search(r'File "<ipython-input-[^"]*", line 3 in <module>\n *\([0-9]+ frames of ddip and IPython\)',
                         stack), stack
        assert "interactiveshell.py" not in stack and "worker.py" not in stack, stack
        stack = k.run("%dipstack")
        assert stack.ok
        assert re.search(r"=> rank 1 has not entered all_reduce #1 \(float32\[16\]\), which rank 0 has waited in for "
                         + T + "; it has run no collective in this group\n", stack.stream()), stack.stream()
        assert k.run("%makedip --heal").ok
        # A rank raises before the rebuilt group's first collective, three times over: each heal
        # starts from the picture, and records of the groups before each rebuild are history.
        for heals in range(1, 4):
            slow = "if rank == 0:\n    time.sleep(1)\n" if heals == 2 else ""  # rank 0 gets there late
            cell = k.run("%%dip\nt = torch.ones(1024)\nif rank == 1:\n    raise ValueError('bad batch')\n" + slow
                         + "dist.all_reduce(t)")
            shown = _shown(cell)
            assert not cell.ok and "disagree" not in shown, shown
            assert re.search(r"=> rank 1 has not entered all_reduce #1 \(float32\[1024\]\), which rank 0 has waited "
                             r"in for " + T + r"; it has run no collective in this group\n", shown), (heals, shown)
            assert "ddip healed the group" in shown, shown
            assert shown.index("=> rank 1 has not entered") < shown.index("ddip healed the group"), shown
        assert "disagree" not in k.run("%dipstack").stream()
        # The stop button: rank 0 catches every interrupt and goes on, rank 1 stops. The cell ends
        # once rank 0 has had its grace, interrupted once: not waited for a second time.
        count, stop = tmp_path / "interrupts", tmp_path / "stop"
        loop = (f"%%dip\nseen = 0\nprint('running', flush=True)\nif rank == 0:\n"
                f"    while not pathlib.Path({str(stop)!r}).exists():\n        try:\n            time.sleep(0.05)\n"
                f"        except KeyboardInterrupt:\n            seen += 1\n"
                f"            pathlib.Path({str(count)!r}).write_text(str(seen))\nelse:\n    time.sleep(60)")
        sent = []

        def on_output(out):
            if out["type"] == "stream" and "running" in out["text"] and not sent:
                sent.append(True)
                k.km.interrupt_kernel()

        cell = k.run(loop, on_output=on_output)
        shown = _shown(cell)
        assert sent and [e["ename"] for e in cell.of_type("error")] == ["KeyboardInterrupt"], shown
        assert "rank(s) 0 did not stop" in shown and "[rank 0] did not stop; where it was:" in shown, shown
        assert "[rank 1] did not stop" not in shown, shown
        assert count.read_text() == "1"
        stop.write_text("")
        assert k.run("import time\ng = get_ipython().magics_manager.registry['DipMagics'].group\n"
                     "while any(r['state'] == 'busy' for r in g.status()):\n    time.sleep(0.05)").ok
        assert k.run("%%dip\n'after'").ok
        k.run("%makedip -k")
