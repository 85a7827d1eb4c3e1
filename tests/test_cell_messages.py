"""What a failed cell says names the true cause and every way on, through a real kernel (issue 33):
a rank killed mid-cell is the cause its peers were interrupted for, its stderr is the cell's,
%dipdebug is not offered a dead rank, and a cell refused after a death or left busy names
%makedip --heal beside %makedip -r. One kernel, one gloo group, reused."""

from __future__ import annotations

import pytest

from ddip.errors import strip_ansi
from test_magics import running_kernel

pytest.importorskip("torch")

SET_UP = """%%dip
import os, sys, time, signal, torch, torch.distributed as dist
rank = int(os.environ["RANK"])
print("a line of an earlier cell", file=sys.stderr)
"""


def errors_of(cell) -> str:
    return strip_ansi("\n".join("\n".join(o["traceback"]) for o in cell.of_type("error")))


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with running_kernel(tmp_path_factory.mktemp("jupyter")) as k:
        assert k.run("%makedip -n 2").ok
        assert k.run(SET_UP).ok
        yield k
        k.run("%makedip -k")


def test_a_death_is_named_as_the_cause_and_heal_as_the_way_on(kernel):
    cell = kernel.run("%%dip\nprint('the dying cell speaks', file=sys.stderr)\n"
                      "if rank == 1: os.kill(os.getpid(), 9)\ntime.sleep(10)")
    text = errors_of(cell)
    assert not cell.ok and "RankDied: killed by SIGKILL" in text, cell.outputs
    # The dead rank's stderr is the cell's it died in, not the earlier cell's (row 12).
    tail = text.split("last lines of its stderr:\n", 1)[1]
    assert tail.startswith("the dying cell speaks\n") and "earlier cell" not in text, text
    # Rank 0 was interrupted because rank 1 died, and says so: nobody pressed stop (row 11).
    assert "KeyboardInterrupt: interrupted by ddip because rank 1 died (killed by SIGKILL)" in text, text
    assert "interrupted from the notebook" not in text
    # %dipdebug is not sent to the dead rank (row 13).
    cell = kernel.run("%dipdebug")
    text = errors_of(cell) + strip_ansi(str(cell.outputs))
    assert not cell.ok and "a dead rank has no frames left to debug" in text, cell.outputs
    assert "%dipdebug -r 0" in text and "%dipdebug -r 1" not in text, text
    # A cell refused after the death names heal beside restart (row 10).
    cell = kernel.run("%%dip\nprint('ran')")
    text = errors_of(cell)
    assert not cell.ok and "rank 1 is dead (killed by SIGKILL); run %makedip --heal to replace it" in text, text
    assert "or run %makedip -r to start the group again" in text
    assert kernel.run("%makedip --heal").ok
    assert kernel.run(SET_UP).ok


def test_a_rank_left_busy_names_heal_beside_restart(kernel):
    cell = kernel.run("%%dip --timeout 1\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)")
    text = errors_of(cell)
    assert not cell.ok and "did not stop and are still busy" in text, text
    assert "%makedip --heal (g.heal()) frees ranks stuck in a broken collective" in text, text
    cell = kernel.run("%%dip\nprint('ran')")
    text = errors_of(cell)
    assert not cell.ok and "RankBusyError" in text and "run %makedip --heal if it waits in a broken collective" \
        in text and "run %makedip -r" in text, text
    # (Last in this file: the fixture's %makedip -k ends the busy ranks.)
