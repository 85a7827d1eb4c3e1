"""A hang named by its collective: torch's flight recorder, on in every rank ddip starts, read
from each rank while it waits (rank/collectives.py) and put together in the kernel
(kernel/collectives.py): who has not entered the collective the others wait in, who disagrees
about it. Real ranks with gloo; the magics' side through a real Jupyter kernel."""

from __future__ import annotations

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
    assert picture.findings[0].endswith("; its last collective was all_reduce #1")
    text = str(stacks)
    assert text.startswith("collectives (torch's flight recorder):\n  rank 0: waiting ")
    assert "  rank 1: in no collective; last completed: all_reduce #1\n" in text
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


def test_dipstack_and_a_timed_out_cell_lead_with_the_collectives(tmp_path_factory):
    with running_kernel(tmp_path_factory.mktemp("jupyter")) as k:
        assert k.run("%makedip -n 2").ok
        assert k.run("%%dip\n" + SETUP).ok
        cell = k.run("%%dip --timeout 2\nif dist.get_rank() == 0:\n    dist.all_reduce(t)\nelse:\n    time.sleep(60)")
        assert not cell.ok
        shown = strip_ansi(cell.stream() + cell.stream("stderr")
                           + "".join("\n".join(o["traceback"]) for o in cell.of_type("error")))
        assert "rank 1 has not entered all_reduce #2 (float32[1024]), which rank 0 has waited in" in shown, shown
        assert shown.index("=> rank 1 has not entered") < shown.index("did not stop; where it was:"), shown
        stack = k.run("%dipstack")
        assert stack.ok
        text = stack.stream()
        assert text.startswith("collectives (torch's flight recorder):\n  rank 0: waiting "), text
        assert "=> rank 1 has not entered all_reduce #2" in text and text.index("=>") < text.index("[rank 0]")
        k.run("%makedip -k")
