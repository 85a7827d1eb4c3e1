"""The straggler named (issue 35): who the others waited for in the last collectives, from the
entry times of torch's flight recorder in every rank (rank/collectives.py), put together by the
runtime (cpp/ddip/stragglers.cpp, its arithmetic tested in cpp/tests/test_stragglers.cpp) and
shown by Group.stragglers(), Group.stacks() and %dipstack. Real ranks with gloo; %dipstack through
a real Jupyter kernel."""

from __future__ import annotations

import contextlib
import io

import pytest

import ddip
from ddip.kernel.stragglers import Stragglers
from ddip.magics import render
from test_magics import running_kernel

SETUP = "import time, torch, torch.distributed as dist\nt = torch.ones(1024)\ndist.all_reduce(t)"
# Every rank works `seconds` before each all_reduce, and rank `slow` `extra` seconds more.
STEPS = """
for _ in range({steps}):
    time.sleep({seconds} + ({extra} if dist.get_rank() == {slow} else 0))
    dist.all_reduce(t)
"""


@pytest.fixture(scope="module")
def g():
    with ddip.Group(n=3, backend="gloo") as group:
        group.run(SETUP)
        yield group


def test_the_rank_that_sleeps_before_each_all_reduce_is_named(g):
    g.run(STEPS.format(steps=10, seconds=0, extra=0.1, slow=2))
    s = g.stragglers(last=10)
    assert s.straggler == 2, str(s)
    assert s.window == 10 and s.last == 10
    assert [w.seq for w in s.timeline] == list(range(2, 12))  # #1 was the set-up's: out of the window
    assert {w.op for w in s.timeline} == {"all_reduce"} and {w.pg for w in s.timeline} == {"0"}
    assert s.held_s[2] > 2 * max(s.held_s[0], s.held_s[1])
    assert s.share[2] >= Stragglers.MIN_SHARE and s.ranks == [0, 1, 2] and s.unread == {}
    assert str(s).startswith("rank 2 is the straggler: the others waited for it "), str(s)
    assert " of the time of the last 10 collectives (" in s.headline
    assert "\n  rank 2: the others waited " in str(s) and repr(s) == str(s)
    # Group.stacks() and %dipstack's rendering lead with it, before the collectives and the stacks.
    stacks = g.stacks()
    assert stacks.stragglers.straggler == 2
    assert str(stacks).startswith("rank 2 is the straggler: "), str(stacks)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        render.print_stacks(stacks)
    assert out.getvalue().startswith("rank 2 is the straggler: "), out.getvalue()
    assert out.getvalue().index("is the straggler") < out.getvalue().index("[rank 0]")


def test_the_plot_draws_each_ranks_wait_over_time(g):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    g.run(STEPS.format(steps=4, seconds=0, extra=0.1, slow=1))
    s = g.stragglers(last=4)
    ax = s.plot()
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"rank 0", "rank 1 (the straggler)", "rank 2"}, set(lines)
    # Cumulative: rank 1's line ends at how long the others waited for it in all.
    assert lines["rank 1 (the straggler)"].get_ydata()[-1] == pytest.approx(s.held_s[1])
    assert list(lines["rank 1 (the straggler)"].get_xdata()[1:]) == [w.at_s for w in s.timeline]
    assert ax.get_title().replace("\n", " ") == s.headline
    # Per collective: a point where the rank entered last, at how long the others waited for it.
    per = {line.get_label(): line for line in s.plot(cumulative=False).get_lines()}
    assert list(per["rank 1 (the straggler)"].get_ydata()) == [w.wait_s for w in s.timeline if w.last == 1]
    assert sum(len(line.get_xdata()) for line in per.values()) == 4


def test_the_plot_without_matplotlib_says_what_to_install(g, monkeypatch):
    s = g.stragglers()
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r"draws with matplotlib, which is not installed here: pip install "
                                          r"matplotlib"):
        s.plot()


def test_no_straggler_where_every_rank_does_the_same_work(g):
    g.run(STEPS.format(steps=12, seconds=0.15, extra=0, slow=0))
    s = g.stragglers(last=12)
    assert s.straggler is None, str(s)
    assert s.window == 12
    assert str(s).startswith("no straggler in the last 12 collectives: no rank held the others up for 10% of "
                             "their time and twice as long as any other (the most: rank "), str(s)
    assert not str(g.stacks()).startswith("no straggler")  # %dipstack leads with a straggler only


def test_a_bad_window_is_refused_before_anything_is_asked(g):
    for bad in (0, -1, 2.5, "10", True):
        with pytest.raises(ValueError, match=r"last=.*: give the number of most recent collectives to look "
                                             r"at, a whole number of 1 or more \(default 50\)"):
            g.stragglers(last=bad)


def test_dipstack_leads_with_the_straggler_in_a_notebook(tmp_path_factory):
    with running_kernel(tmp_path_factory.mktemp("jupyter")) as k:
        assert k.run("%makedip -n 3 --backend gloo").ok
        assert k.run("%%dip\n" + SETUP).ok
        assert k.run("%%dip\n" + STEPS.format(steps=5, seconds=0, extra=0.1, slow=1)).ok
        shown = k.run("%dipstack").stream()
        assert shown.startswith("rank 1 is the straggler: the others waited for it "), shown
        assert shown.index("is the straggler") < shown.index("collectives (torch's flight recorder):")
        k.run("%makedip -k")


def test_ranks_without_torch_distributed_say_why():
    with ddip.Group(n=2, backend=None) as group:
        s = group.stragglers()
        assert s.straggler is None and s.window == 0 and s.ranks == []
        assert s.unread == {0: "torch.distributed is not initialized there",
                            1: "torch.distributed is not initialized there"}
        assert str(s) == ("no straggler named: no rank's collectives could be read (rank 0: torch.distributed "
                          "is not initialized there)\n"
                          "  rank 0: not read (torch.distributed is not initialized there)\n"
                          "  rank 1: not read (torch.distributed is not initialized there)")
