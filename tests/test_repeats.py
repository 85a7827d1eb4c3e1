"""ddip.repeats: lines that several ranks print alike are shown once, with the ranks named as
ranges, and nothing is dropped; the same for RemoteError's tracebacks and ranch's output (the
%%dip side, through a real kernel, is in test_magics.py)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading

import pytest

import ddip
from ddip import _core
from ddip.repeats import Repeats


class Sink:
    """What a Repeats hands on, in order; `wrote` is set at each write."""

    def __init__(self):
        self.got = []
        self.wrote = threading.Event()

    def __call__(self, ranks, stream, text):
        self.got.append((ranks, stream, text))
        self.wrote.set()


def test_rank_ranges_is_the_runtimes_one_spelling():
    assert _core.rank_ranges(list(range(127))) == "0-126"
    assert _core.rank_ranges([7, 0, 2, 4, 5, 6]) == "0,2,4-7"
    assert ddip.labels.rank_label((0, 1, 2, 3)) == "[ranks 0-3]" and ddip.labels.rank_label(5) == "[rank 5]"


def test_a_line_every_rank_prints_comes_once_and_lines_that_differ_keep_rank_order():
    sink = Sink()
    out = Repeats(sink, range(8), window=60)  # complete rounds go at once; none waits for the window
    for r in (3, 0, 7, 1, 2, 4, 6, 5):  # arrival order is not rank order
        out(r, "stdout", "loss 0.31\n")
        out(r, "stdout", "odd one out\n" if r == 5 else "same\n")
        out(r, "stderr", f"warning from {r}\n")
    out.close()
    assert sink.got[:3] == [((0, 1, 2, 3, 4, 5, 6, 7), "stdout", "loss 0.31\n"),
                            ((0, 1, 2, 3, 4, 6, 7), "stdout", "same\n"), (5, "stdout", "odd one out\n")]
    # Lines that differ: each rank's own, in rank order, none dropped.
    assert [g for g in sink.got if g[1] == "stderr"] == [(r, "stderr", f"warning from {r}\n") for r in range(8)]


def test_a_line_the_others_never_print_is_written_without_more_output_or_the_end():
    sink = Sink()
    out = Repeats(sink, range(4), window=0.05)
    out(0, "stdout", "only rank 0 says this\n")
    assert sink.wrote.wait(30), "held for good: the ticker did not write it"
    assert sink.got == [(0, "stdout", "only rank 0 says this\n")]
    # A straggler's same line, after its round went, starts the round again: nothing is lost.
    sink.wrote.clear()
    for r in (1, 2, 3):
        out(r, "stdout", "only rank 0 says this\n")
    assert sink.wrote.wait(30)
    out.close()
    assert sink.got[1:] == [((1, 2, 3), "stdout", "only rank 0 says this\n")]


def test_bars_and_unended_lines_go_as_they_are_after_the_lines_before_them():
    sink = Sink()
    out = Repeats(sink, range(2), window=60)
    out(0, "stdout", "epoch 1\n")
    out(0, "stdout", "10%\r")  # a redrawn bar: live, so rank 0's held line goes first
    out(0, "stdout", "100%\n")
    out(1, "stdout", "loss: ")
    out.close()  # the end: an unended line too
    assert sink.got == [(0, "stdout", "epoch 1\n"), (0, "stdout", "10%\r"), (0, "stdout", "100%\n"),
                        (1, "stdout", "loss: ")]


def test_a_rank_that_is_done_is_not_waited_for():
    sink = Sink()
    out = Repeats(sink, range(3), window=60)
    out.done(2)
    out(0, "stdout", "x\n")
    out(1, "stdout", "x\n")
    assert sink.got == [((0, 1), "stdout", "x\n")]  # before close(): the round was complete
    out.close()


def test_remote_error_names_the_ranks_of_each_traceback_as_ranges():
    with ddip.Group(n=5, backend=None) as g:
        with pytest.raises(ddip.RemoteError) as e:
            g.run("import os\nr = int(os.environ['RANK'])\n"
                  "raise KeyError('four') if r == 4 else ValueError('boom')")
    text = str(e.value)
    assert e.value.headline.startswith("code failed on ranks 0-4; root cause on rank ")
    assert text.count("\n--- ") == 2 and text.count("raise KeyError('four')") == 2  # two tracebacks
    assert "\n--- ranks 0-3: ValueError: boom\n" in text and "\n--- rank 4: KeyError: 'four'\n" in text
    raw = e.value.describe(collapse=False)  # every rank's own, root cause first
    assert raw.count("\n--- ") == 5 and all(f"\n--- rank {r}: " in raw for r in range(5))


RANCH = textwrap.dedent("""
    import ddip, ddip.repeats
    # Every round waits for all its children: what collapses is then fixed, whatever the load.
    ddip.repeats.REPEAT_WINDOW_S = 600
    def fn():
        import os
        r = int(os.environ["RANK"])
        print("same line")
        print("odd one out" if r == 2 else "same again")
        return r
    print(ddip.ranch(4, fn, warm=False))
    print("--- raw")
    print(ddip.ranch(4, fn, warm=False, collapse=False))
""")


def test_ranch_collapses_its_childrens_repeats_and_collapse_false_shows_them_raw():
    run = subprocess.run([sys.executable, "-c", RANCH], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    collapsed, raw = run.stdout.split("--- raw\n")
    lines = collapsed.splitlines()
    # The notebook's own lines (rank 0) stay its own, unlabelled.
    assert sorted(lines) == sorted(["same line", "same again", "[ranks 1-3] same line", "[ranks 1,3] same again",
                                    "[rank 2] odd one out", "[0, 1, 2, 3]"]), collapsed
    assert lines.index("[ranks 1,3] same again") < lines.index("[rank 2] odd one out")
    lines = raw.splitlines()
    for r in (1, 2, 3):
        assert f"[rank {r}] same line" in lines, raw
    assert "[rank 2] odd one out" in lines and "[ranks" not in raw


from conftest import DDIP  # noqa: E402
LINES = ("import os\nr = os.environ['RANK']\nprint('same line')\nprint('odd one out' if r == '2' else 'same again')\n")


def _expanded(out: str) -> list[tuple[int, str]]:
    """ddip run's labelled lines as (rank, text), a collapsed line once for each of its ranks."""
    seen = []
    for line in out.splitlines():
        m = re.fullmatch(r"\[([\d,-]+)\] (.*)", line)
        assert m, line
        for part in m.group(1).split(","):
            first, _, last = part.partition("-")
            seen += [(r, m.group(2)) for r in range(int(first), int(last or first) + 1)]
    return seen


def test_ddip_run_collapses_repeats_and_raw_shows_every_ranks_line(tmp_path):
    script = tmp_path / "lines.py"
    script.write_text(LINES)
    expected = sorted([(r, "same line") for r in range(4)] + [(r, "same again") for r in (0, 1, 3)]
                      + [(2, "odd one out")])
    run = subprocess.run([DDIP, "run", "-n", "4", sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    # Which lines meet in one round depends on when the ranks print (0.2 s apart at most): every
    # rank's line is there, once, under its rank (the rule's own cases: cpp/tests/test_run_output.cpp).
    assert sorted(_expanded(run.stdout)) == expected, run.stdout
    raw = subprocess.run([DDIP, "run", "--raw", "-n", "4", sys.executable, str(script)], capture_output=True,
                         text=True, timeout=120)
    assert raw.returncode == 0, raw.stderr
    assert sorted(_expanded(raw.stdout)) == expected and all(re.match(r"\[\d\] ", l) for l in raw.stdout.splitlines())
