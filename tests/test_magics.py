"""The notebook magics, driven through a real ipykernel with jupyter_client.

One kernel (and, mostly, one 3-rank group with backend none) is shared by the whole module;
tests that change the group's life cycle come last and leave a group behind for nobody.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
import unittest.mock as mock
from pathlib import Path

import pytest
from jupyter_client import KernelManager

from conftest import alive as _alive
from conftest import wait_until
from ddip.errors import strip_ansi
from ddip.magics import CellMagics, DataMagics, DipMagics, DipRunMagics, PanelMagics
from ddip.magics.flags import without_comment

KERNEL_NAME = "ddip-test"
GROUP = "%makedip -n 3 --backend none"


def install_kernelspec(root) -> str:
    """A kernelspec for this interpreter (the .venv's), under root/kernels; returns JUPYTER_PATH."""
    spec = root / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "ddip test", "language": "python"}))
    return str(root)


class Cell:
    """What one execute_request produced: outputs in arrival order, and the execute_reply."""

    def __init__(self, outputs, reply):
        self.outputs = outputs
        self.reply = reply

    def stream(self, name="stdout") -> str:
        return "".join(o["text"] for o in self.outputs if o["type"] == "stream" and o["name"] == name)

    def of_type(self, kind) -> list:
        return [o for o in self.outputs if o["type"] == kind]

    @property
    def plain(self) -> list[str]:
        return [o["data"].get("text/plain", "") for o in self.outputs if o["type"] in ("display_data", "execute_result")]

    @property
    def ok(self) -> bool:
        return self.reply["status"] == "ok"


class Kernel:
    def __init__(self, km, kc):
        self.km, self.kc = km, kc

    def execute(self, code: str, timeout: float, on_message, so_far) -> dict:
        """Executes code; on_message(kind, content) is called for each of the cell's iopub
        messages but status ones, as they arrive. Returns the execute reply's content; a cell
        still running after `timeout` fails the test, showing `so_far`."""
        # stop_on_error=False: after a failed cell ipykernel aborts the requests that reach it before
        # it stops aborting, and the next cell a test sends right after the reply could be one.
        msg_id = self.kc.execute(code, stop_on_error=False)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"cell did not finish within {timeout} s; outputs so far: {so_far}")
            try:
                msg = self.kc.get_iopub_msg(timeout=left)
            except Exception:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status":
                if content["execution_state"] == "idle":
                    break
                continue
            on_message(kind, content)
        while True:
            reply = self.kc.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"]

    def run(self, code: str, timeout: float = 120, on_output=None) -> Cell:
        """Executes code; on_output(output) is called as each output arrives (mid-cell)."""
        outputs = []

        def collect(kind, content):
            if kind == "stream":
                out = {"type": "stream", "name": content["name"], "text": content["text"]}
            elif kind in ("display_data", "execute_result", "update_display_data"):
                out = {"type": kind, "data": content["data"], "metadata": content.get("metadata", {})}
            elif kind == "error":
                out = {"type": "error", "ename": content["ename"], "evalue": content["evalue"],
                       "traceback": content["traceback"]}
            elif kind == "clear_output":
                out = {"type": "clear_output"}
            else:
                return
            outputs.append(out)
            if on_output is not None:
                on_output(out)

        reply = self.execute(code, timeout, collect, outputs)
        return Cell(outputs, reply)

    def pids(self) -> list[int]:
        cell = self.run("print(get_ipython().magics_manager.registry['DipMagics'].group.pids)")
        return json.loads(cell.stream())


@contextlib.contextmanager
def running_kernel(root, cwd=None, wrap=None):
    """A real ipykernel (this interpreter's) with %load_ext ddip done, as wrap(km, kc) (a
    Kernel by default); shut down on exit."""
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = install_kernelspec(root)
    km = KernelManager(kernel_name=KERNEL_NAME)
    try:
        km.start_kernel(cwd=str(cwd or root))
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        k = (wrap or Kernel)(km, kc)
        assert k.run("%load_ext ddip").ok
        try:
            yield k
        finally:
            kc.stop_channels()
    finally:
        try:
            km.shutdown_kernel(now=True)
        except Exception:
            pass  # killed by the test itself
        if old is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = old


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with running_kernel(tmp_path_factory.mktemp("jupyter")) as k:
        yield k
        k.run("%makedip -k")


@pytest.fixture
def k(kernel):
    """The shared kernel with the shared 3-rank group running (started once, reused)."""
    cell = kernel.run(GROUP)
    if not cell.ok and "already running" in cell.stream("stderr"):  # a test resized it
        cell = kernel.run(GROUP.replace("%makedip", "%makedip -r"))
    assert cell.ok, cell.outputs
    return kernel


def usage_error(cell: Cell) -> str:
    assert not cell.ok, cell.outputs
    err = cell.stream("stderr")
    assert "UsageError" in err, cell.outputs
    return err


# -- the magics' help and docs/magics.md agree (no kernel) ---------------------------------------

ROOT = Path(__file__).resolve().parent.parent
DOC_OF = {"diprun": "docs/run.md"}  # %%diprun is documented beside `ddip run`; the others in magics.md
FLAG = r"(?<![\w-])--?[A-Za-z][\w-]*"  # -n, --see; not the -node of --nproc-per-node
STATES = ["idle", "busy", "dead", "unresponsive"]  # every state Group.status() gives a running group


def every_magic() -> dict:
    """Every magic `%load_ext ddip` registers: name -> its function (whose .parser is its help)."""
    magics = {}
    for cls in (DipMagics, PanelMagics, CellMagics, DataMagics, DipRunMagics):
        for kind in ("line", "cell"):
            for name, attr in cls.magics[kind].items():
                magics[name] = getattr(cls, attr)
    return magics


def docs_section(name: str) -> tuple[str, str]:
    """The doc's `## ` section whose heading names %name or %%name: (file, text)."""
    doc = DOC_OF.get(name, "docs/magics.md")
    sections = re.split(r"(?m)^(?=## )", (ROOT / doc).read_text())
    found = [sec for sec in sections if re.match(rf"## [^\n]*`%%?{name}`", sec)]
    assert len(found) == 1, f"{doc} has no section headed `%{name}`"
    return doc, found[0]


def synopsis(name: str, section: str) -> str:
    """The magic's usage line(s): those of the fenced block right under the section's heading
    that start with %name (and their indented continuations); or, for a section that lists the
    flags in prose, its sentence `Flags: ...;`."""
    lines = section.splitlines()[1:]
    while lines and not lines[0].strip():
        lines.pop(0)
    if lines and lines[0].startswith("```"):
        usage, taking = [], False
        for line in lines[1:lines.index("```", 1)]:
            taking = bool(re.match(rf"%%?{name}(\s|$)", line)) or (taking and line[:1].isspace())
            if taking:
                usage.append(line)
        return "\n".join(usage)
    m = re.search(r"Flags:(.*?);", section, re.S)
    return m.group(1) if m else ""


def flag_table(section: str) -> list[str]:
    """The first cells of the section's `| flag | meaning |` table, in order."""
    lines = section.splitlines()
    if "| flag | meaning |" not in lines:
        return []
    rows = []
    for line in lines[lines.index("| flag | meaning |") + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split(" | ")[0])
    return rows


def first_mention(text: str, names) -> int | None:
    spots = [m.start() for n in names for m in re.finditer(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]
    return min(spots, default=None)


def disagreements(name: str, fn) -> list[str]:
    """Where the magic's help (its magic_arguments parser) and its docs section differ: a flag
    missing from the synopsis or the flag table, listed in another order, or one the docs name
    that the magic doesn't take."""
    doc, section = docs_section(name)
    usage, table = synopsis(name, section), flag_table(section)
    flags = [a for a in fn.parser._actions if a.option_strings]
    known = {o for a in flags for o in a.option_strings}
    out = []
    for a in fn.parser._actions:
        if not a.option_strings:  # a positional: its choices, or its metavar, in the synopsis
            missing = [w for w in (a.choices or [a.metavar or a.dest]) if first_mention(usage, [w]) is None]
            out += [f"%{name}: {doc}'s synopsis lacks {w!r}" for w in missing]
    for where, spots in (("synopsis", [first_mention(usage, a.option_strings) for a in flags]),
                         ("flag table", [next((i for i, row in enumerate(table)
                                               if first_mention(row, a.option_strings) is not None), None)
                                         for a in flags] if table else None)):
        if spots is None:
            continue
        out += [f"%{name}: {doc}'s {where} lacks {a.option_strings[0]}" for a, at in zip(flags, spots) if at is None]
        listed = [a.option_strings[0] for a, at in sorted(zip(flags, spots), key=lambda p: p[1] or 0) if at is not None]
        if listed != [a.option_strings[0] for a, at in zip(flags, spots) if at is not None]:
            out.append(f"%{name}: {doc}'s {where} lists {' '.join(listed)}; %{name}? lists "
                       f"{' '.join(a.option_strings[0] for a in flags)}")
        text = usage if where == "synopsis" else "\n".join(table)
        out += [f"%{name}: {doc}'s {where} names {f}, which %{name} doesn't take"
                for f in sorted(set(re.findall(FLAG, text)) - known)]
    return out


def test_every_magic_has_help_that_its_docs_agree_with():
    magics = every_magic()
    assert {"makedip", "dip", "autodip", "dipush", "dipull", "dipstatus", "dipstack", "diprun"} <= set(magics)
    problems = []
    for name, fn in magics.items():
        if not hasattr(fn, "parser"):
            problems.append(f"%{name} has no magic_arguments parser: `%{name}?` shows no usage line")
            continue
        problems += disagreements(name, fn)
    assert not problems, "\n".join(problems)


def test_the_agreement_check_finds_a_missing_flag_and_another_order():
    # The check above, on docs made to differ from the help: it must say where and how.
    fn = every_magic()["dipstack"]
    doc, section = docs_section("dipstack")
    assert disagreements("dipstack", fn) == []
    swapped = section.replace("[-r RANKS] [-t SECONDS]", "[-t SECONDS] [-r RANKS] [--all]")
    dropped = section.replace(" [-t SECONDS]", "")
    for text, want in ((swapped, ["synopsis lists -t -r; %dipstack? lists -r -t",
                                  "synopsis names --all, which %dipstack doesn't take"]),
                       (dropped, ["synopsis lacks -t"])):
        with mock.patch(f"{__name__}.docs_section", return_value=(doc, text)):
            found = disagreements("dipstack", fn)
        assert [p.split(f"{doc}'s ")[1] for p in found] == want, found


def test_dipstatus_help_and_docs_name_every_state():
    help_text = " ".join(every_magic()["dipstatus"].__doc__.split())
    _, section = docs_section("dipstatus")
    for text in (help_text, " ".join(section.split())):
        spots = [first_mention(text, [s]) for s in STATES]
        assert None not in spots and spots == sorted(spots), (STATES, text)


@pytest.mark.parametrize("line, meant", [
    ("-n 2   # 2 CPU ranks, -g all for GPUs", "-n 2"),
    ("-n 2 #-g all", "-n 2"),
    ("# only a comment -g all", ""),
    ("--see '#1'", "--see '#1'"),                      # quoted: a value
    ("--log-dir a#b -n 2", "--log-dir a#b -n 2"),      # inside a word: a value
    ('-a "--see all  # all"  # every rank', '-a "--see all  # all"'),
    ("-n 2  # don't mind the quote", "-n 2"),           # the comment's quote opens nothing
    ("-a 'left # open", "-a 'left # open"),            # quoted to the end: parse() reports it
    ("", ""),
])
def test_a_trailing_comment_is_cut_where_a_shell_would(line, meant):
    assert without_comment(line) == meant


# -- before any group --------------------------------------------------------------------------

def test_magics_without_a_group_say_how_to_make_one(kernel):
    for code in ["%%dip\nprint('ran')", "%dipush x", "%dipull x", "%dipstatus", "%autodip on"]:
        kernel.run("x = 1")
        cell = kernel.run(code)
        assert "no group: run %makedip -n 2 (or -g all) first" in usage_error(cell), code
        assert "ran" not in cell.stream()


def test_makedip_needs_a_size(kernel):
    err = usage_error(kernel.run("%makedip --backend none"))
    assert "-n N" in err and "usage: %makedip" in err


def test_restart_keeps_a_group_handle_taken_earlier_and_a_new_group_says_so(kernel):
    take = "g = get_ipython().magics_manager.registry['DipMagics'].group"
    assert kernel.run("%makedip -n 2 --backend none").ok
    assert kernel.run(take + "\nold_pids = g.pids").ok
    cell = kernel.run("%makedip -r\nprint(g is get_ipython().magics_manager.registry['DipMagics'].group, "
                      "g.pids != old_pids, [r.value for r in g.run('1 + 1')])")
    assert cell.ok, cell.outputs
    assert cell.stream().splitlines()[-1] == "True True [2, 2]"
    cell = kernel.run("%makedip -r -n 3 --backend none\nprint(g.closed)")
    assert cell.ok, cell.outputs
    assert "a Group object taken earlier" in cell.stream() and cell.stream().splitlines()[-1] == "True"
    kernel.run("%makedip -k")


def test_a_trailing_comment_is_no_flag(kernel):
    # A line as the docs print them: the -g all inside the comment is no flag (without a GPU it
    # would fail; with one, -n 2 and -g all would disagree).
    cell = kernel.run("%makedip -n 2 --backend none   # 2 CPU ranks, -g all for GPUs")
    assert cell.ok, cell.outputs
    assert "2 CPU rank(s) ready" in cell.stream()
    info = kernel.run("%makedip -i  # describe it")
    assert info.ok, info.outputs
    text = info.stream()
    assert "group: -n 2 --backend none" in text
    assert [line.strip() for line in text.splitlines() if "->" in line] == ["rank 0 -> cpu", "rank 1 -> cpu"]
    cell = kernel.run("%makedip -k   # -n 3 would be no flag either")
    assert cell.ok and "killed the group" in cell.stream(), cell.outputs


def test_an_unknown_app_is_named_with_the_known_ones_even_without_a_size(kernel):
    for line in ("%makedip -a nosuchapp", "%makedip -n 2 -a nosuchapp"):
        err = usage_error(kernel.run(line))
        assert "-a nosuchapp: no such app; known apps: fastai" in err, err
        assert "-n N" not in err.split("usage:")[0]


# -- running cells -----------------------------------------------------------------------------

def test_makedip_starts_three_ranks_and_info_describes_them(k):
    cell = k.run("%makedip -i")
    text = cell.stream()
    assert "backend: none" in text and "app: none" in text
    for rank in range(3):
        assert f"rank {rank} -> cpu" in text
    assert "autodip is off" in text
    assert len(k.pids()) == 3
    # The same command again is harmless: it says the group is there.
    assert "already running" in k.run(GROUP).stream()


def test_output_streams_live_while_the_cell_runs(k, tmp_path):
    gate = tmp_path / "gate"
    seen = []

    def on_output(out):
        seen.append(out)
        if out["type"] == "stream" and "first" in out["text"]:
            gate.touch()  # only now may the rank go on to print "second"

    code = (f"%%dip\nimport os, time\nprint('first', flush=True)\n"
            f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)\nprint('second')")
    cell = k.run(code, timeout=60, on_output=on_output)
    assert cell.ok
    streams = [o["text"] for o in cell.of_type("stream")]
    assert any("first" in s and "second" not in s for s in streams), streams
    assert "second" in cell.stream()


def test_only_rank_0_is_shown_by_default(k):
    cell = k.run("%%dip\nimport os\nprint('hello from', os.environ['RANK'])")
    assert cell.stream() == "hello from 0\n"


def test_see_all_labels_each_rank(k):
    cell = k.run("%%dip --see all\nimport os, time\nr = int(os.environ['RANK'])\n"
                 "time.sleep(0.2 * r)\nprint('hello from', r)")
    text = cell.stream()
    for r in range(3):
        assert f"[rank {r}]\nhello from {r}\n" in text, text


def test_see_some_ranks_and_quiet(k):
    cell = k.run("%%dip -S 0,2\nimport os\nprint('hello from', os.environ['RANK'])\n1")
    text = cell.stream()
    assert "hello from 0" in text and "hello from 2" in text and "hello from 1" not in text
    assert "[rank 2]" in text
    assert len(cell.plain) == 2
    quiet = k.run("%%dip -q\nprint('hello')\n1")
    assert quiet.ok and quiet.stream() == "" and quiet.plain == []
    none = k.run("%%dip --see none\nprint('hello')")
    assert none.ok and none.stream() == ""


def test_last_value_is_shown_as_out_rank_count(k):
    first = k.run("%%dip\n40 + 2")
    [text] = first.plain
    m = re.fullmatch(r"Out\[0:(\d+)\]: 42", text)
    assert m, text
    second = k.run("%%dip --see all\nimport os\nint(os.environ['RANK']) * 10")
    n = int(m.group(1)) + 1
    assert second.plain == [f"Out[0:{n}]: 0", f"Out[1:{n}]: 10", f"Out[2:{n}]: 20"]
    assert k.run("%%dip\nx = 1").plain == []  # no value, no Out


def test_rich_values_keep_their_mime_types(k):
    cell = k.run("%%dip\nfrom IPython.display import HTML\nHTML('<b>bold</b>')")
    [label, value] = cell.of_type("display_data")
    assert re.fullmatch(r"Out\[0:\d+\]:", label["data"]["text/plain"])
    assert value["data"]["text/html"] == "<b>bold</b>"


def test_display_html_reaches_the_notebook(k):
    cell = k.run("%%dip\nfrom IPython.display import HTML, display\nprint('before')\n"
                 "display(HTML('<i>rich</i>'))\nprint('after')")
    assert cell.stream() == "before\nafter\n"
    [shown] = cell.of_type("display_data")
    assert shown["data"]["text/html"] == "<i>rich</i>"


def test_display_keeps_its_place_among_prints(k):
    for _ in range(5):
        cell = k.run("%%dip\nfrom IPython.display import HTML, display\nprint('before')\n"
                     "display(HTML('<i>rich</i>'))\nprint('after')")
        assert [o["type"] for o in cell.outputs] == ["stream", "display_data", "stream"], cell.outputs


def test_matplotlib_figure_arrives_as_png(k):
    cell = k.run("%%dip\n%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 3, 2]);")
    assert cell.ok, cell.outputs
    pngs = [o for o in cell.of_type("display_data") if "image/png" in o["data"]]
    assert len(pngs) == 1, cell.outputs


def test_identical_tracebacks_are_merged_with_their_ranks(k):
    cell = k.run("%%dip\ndef f():\n    raise ValueError('boom')\nf()")
    assert not cell.ok and cell.reply["evalue"]
    [err] = cell.of_type("error")
    text = strip_ansi("\n".join(err["traceback"]))
    assert "ranks 0-2 (the same traceback on each)" in text
    assert "ValueError" in text and "boom" in text and "raise ValueError" in text
    assert err["ename"] == "ValueError"
    # Nothing about the magic's own frames in the notebook.
    everything = json.dumps(cell.outputs)
    assert "ddip/magics" not in everything and "run_cell_magic" not in everything


def test_different_tracebacks_are_shown_per_rank(k):
    cell = k.run("%%dip\nimport os\nr = int(os.environ['RANK'])\nif r > 0:\n    raise KeyError(f'rank{r}')\nr")
    errors = cell.of_type("error")
    # Root cause first: the order the failures arrived in, which two ranks failing at once don't fix.
    assert sorted(e["evalue"] for e in errors) == ["'rank1'", "'rank2'"]
    for e in errors:
        assert f"[rank {e['evalue'][-2]}]" in e["traceback"][0]
    assert cell.plain and cell.plain[0].endswith(": 0")  # rank 0 succeeded: its Out is shown
    assert k.run("%%dip\n'still usable'").ok


REPEATS = ("import os\nr = int(os.environ['RANK'])\nprint('loss 0.31')\nprint('odd one out' if r == 5 else 'same')\n"
           "raise KeyError('seven') if r == 7 else ValueError('boom')")


def test_repeats_from_8_ranks_collapse_with_the_ranks_named_and_raw_shows_them_all(kernel):
    assert kernel.run("%makedip -r -n 8 --backend none").ok
    # Every round waits for all 8 ranks' line (not the 0.2 s window): what collapses is then fixed
    # whatever the machine's load.
    assert kernel.run("import ddip.repeats; _window, ddip.repeats.REPEAT_WINDOW_S = ddip.repeats.REPEAT_WINDOW_S, 600").ok
    try:
        cell = kernel.run("%%dip --see all\n" + REPEATS)
        assert cell.stream() == "[ranks 0-7]\nloss 0.31\n[ranks 0-4,6,7]\nsame\n[rank 5]\nodd one out\n"
        errors = {e["ename"]: strip_ansi("\n".join(e["traceback"])) for e in cell.of_type("error")}
        assert set(errors) == {"ValueError", "KeyError"}
        assert "[ranks 0-6 (the same traceback on each)]" in errors["ValueError"] and "boom" in errors["ValueError"]
        assert errors["KeyError"].startswith("[rank 7]")
        raw = kernel.run("%%dip --see all --raw\n" + REPEATS)
        text = raw.stream()
        assert "[ranks" not in text and text.count("loss 0.31") == 8 and text.count("same\n") == 7
        assert all(f"[rank {r}]" in text for r in range(8))
        assert len(raw.of_type("error")) == 8
    finally:
        kernel.run("ddip.repeats.REPEAT_WINDOW_S = _window")
        kernel.run(GROUP.replace("%makedip", "%makedip -r"))


def test_interrupt_stops_every_rank_and_the_group_stays_usable(k):
    started = []

    def on_output(out):
        if out["type"] == "stream" and "sleeping" in out["text"] and not started:
            started.append(True)
            k.km.interrupt_kernel()

    cell = k.run("%%dip\nimport time\nprint('sleeping', flush=True)\ntime.sleep(60)", timeout=50,
                 on_output=on_output)
    assert started and not cell.ok
    [err] = cell.of_type("error")
    assert err["ename"] == "KeyboardInterrupt" and "0, 1, 2" in err["evalue"]
    after = k.run("%%dip --see all\n'after'")
    assert after.ok and len(after.plain) == 3


def test_interrupt_while_output_floods_in(k):
    # The Ctrl-C may land while the magic is writing a rank's output rather than waiting for it.
    for _ in range(3):
        sent = []

        def on_output(out):
            if out["type"] == "stream" and not sent:
                sent.append(True)
                k.km.interrupt_kernel()

        cell = k.run("%%dip --see all\nwhile True:\n    print('x' * 200)", timeout=60, on_output=on_output)
        assert sent and not cell.ok
        assert [e["ename"] for e in cell.of_type("error")] == ["KeyboardInterrupt"]
        after = k.run("%%dip --see all\n'after'", timeout=60)
        assert after.ok and len(after.plain) == 3, after.outputs



def test_timeout_interrupts_the_ranks(k):
    cell = k.run("%%dip --timeout 0.5\nimport time\ntime.sleep(60)", timeout=50)
    [err] = cell.of_type("error")
    assert err["ename"] == "TimeoutError"
    assert k.run("%%dip\n1").ok


def test_local_and_everywhere(k):
    assert k.run("%%dip local\nonly_here = 1").ok
    assert k.run("only_here").ok
    assert k.run("%%dip\n'only_here' in globals()").plain[0].endswith(": False")
    cell = k.run("%%dip everywhere\nboth = 2\nprint('ran')")
    assert cell.stream() == "ran\nran\n"  # the notebook's, then rank 0's
    assert k.run("%%dip ranks\nboth").plain[0].endswith(": 2")
    assert k.run("%%dip --to remote\nboth").plain[0].endswith(": 2")  # `remote`: the earlier name of `ranks`
    assert k.run("%%dip remote --to ranks\nboth").ok  # the same place, by either name
    assert k.run("both").ok
    assert k.run("%%dip --to both\nboth += 1").ok
    assert k.run("print(both)").stream() == "3\n"


def test_local_failure_does_not_run_remotely(k):
    cell = k.run("%%dip everywhere\nmarker = 'set'\n1/0")
    assert not cell.ok
    assert cell.of_type("error")[0]["ename"] == "ZeroDivisionError"
    assert k.run("%%dip\n'marker' in globals()").plain[0].endswith(": False")


def test_autodip_runs_cells_remotely_until_off(k):
    on = k.run('%autodip on -a "--see all"')
    assert "autodip is on (cells run as %%dip --see all)" in on.stream()
    cell = k.run("import os\nprint('rank', os.environ.get('RANK'))")
    for r in range(3):
        assert f"rank {r}" in cell.stream()
    # A first line starting with % runs as written.
    local = k.run("%%dip local\nimport os\nprint('local', os.environ.get('RANK'))")
    assert local.stream() == "local None\n"
    assert "autodip is on" in k.run("%autodip").stream()
    assert "autodip is on" in k.run("%makedip -i").stream()
    assert "autodip is off" in k.run("%autodip off").stream()
    assert k.run("import os\nprint('rank', os.environ.get('RANK'))").stream() == "rank None\n"
    assert "autodip is off" in k.run("%autodip").stream()


def test_autodip_rejects_bad_args_and_stays_off(k):
    err = usage_error(k.run('%autodip on -a "--see 9"'))
    assert "--see 9" in err
    assert "autodip is off" in k.run("%autodip").stream()
    assert k.run("import os\nprint(os.environ.get('RANK'))").stream() == "None\n"


def test_push_and_pull_round_trip(k):
    assert k.run("a = {'x': [1, 2]}\nb = 'text'").ok
    assert k.run("%dipush a b").ok
    cell = k.run("%%dip --see all\nimport os\na['x'].append(int(os.environ['RANK']))\nc = (a, b)")
    assert cell.ok, cell.outputs
    assert k.run("%dipull c").ok
    assert k.run("print(c)").stream() == "({'x': [1, 2, 0]}, 'text')\n"
    assert k.run("%dipull -r 2 c").ok
    assert k.run("print(c)").stream() == "({'x': [1, 2, 2]}, 'text')\n"
    assert k.run("d = 7\n%dip --push d").ok
    assert k.run("%%dip --see all\nd").plain[-1].endswith(": 7")


def test_push_and_pull_errors(k):
    assert "not defined in the notebook: nope" in usage_error(k.run("%dipush nope"))
    assert "-r 5" in usage_error(k.run("%dipull -r 5 a"))
    cell = k.run("%dipull missing_on_rank")
    assert not cell.ok
    [err] = cell.of_type("error")
    assert err["ename"] == "NameError" and "missing_on_rank" in err["evalue"]


def test_dipstatus_table(k):
    cell = k.run("%dipstatus")
    [table] = cell.of_type("display_data")
    text = table["data"]["text/plain"]
    lines = text.splitlines()
    assert lines[0].split()[:7] == ["rank", "pid", "device", "state", "busy", "for", "memory"]
    pids = k.pids()
    for r, pid in enumerate(pids):
        row = lines[1 + r].split()
        assert row[:4] == [str(r), str(pid), "cpu", "idle"] and "MiB" in text
    assert "<table>" in table["data"]["text/html"]
    # In a frontend that renders widgets, the live rank panel (tests/test_browser.py draws it).
    assert "application/vnd.jupyter.widget-view+json" in table["data"]


def test_group_status_is_a_list_of_dicts_shown_as_the_rank_panel(k):
    g = "get_ipython().magics_manager.registry['DipMagics'].group"
    assert k.run(f"print([r['state'] for r in {g}.status()])").stream() == "['idle', 'idle', 'idle']\n"
    [shown] = k.run(f"{g}.status()").of_type("display_data")
    assert "application/vnd.jupyter.widget-view+json" in shown["data"]
    assert shown["data"]["text/plain"].splitlines()[0].split()[:4] == ["rank", "pid", "device", "state"]


def test_every_magic_takes_a_trailing_comment_and_keeps_a_quoted_hash(k, tmp_path):
    cell = k.run("%%dip --see all  # every rank; -q would hide them\nimport os\n"
                 "print('rank', os.environ['RANK'], '#', 'kept')  # the cell's code is code\n# a comment line")
    assert cell.ok, cell.outputs
    for r in range(3):
        assert f"[rank {r}]\nrank {r} # kept\n" in cell.stream(), cell.stream()
    assert k.run("x = 5\n%dipush x  # to every rank").ok
    assert k.run("%%dip\nimport os\ny = x + int(os.environ['RANK'])").ok
    assert k.run("%dipull -r 2 y  # -r 0 is no flag").ok
    assert k.run("print(y)").stream() == "7\n"
    assert k.run("z = 'pushed'\n%dip --push z  # as %dipush z").ok
    assert k.run("%%dip\nz").plain[0].endswith(": 'pushed'")
    on = k.run('%autodip on -a "--see all"  # every cell, every rank')
    assert on.ok and "autodip is on (cells run as %%dip --see all)\n" in on.stream(), on.outputs
    assert "autodip is off" in k.run("%autodip off  # back to the notebook").stream()
    assert len(k.run("%dipstatus  # the table").plain[0].splitlines()) == 4
    stacks = k.run("%dipstack -r 1  # -r 0 would be no flag")
    assert stacks.ok and "[rank 1]" in stacks.stream() and "[rank 0]" not in stacks.stream()
    # A # inside quotes, or inside a word, is part of the value: these log directories keep theirs.
    cell = k.run(f"%%diprun -n 2 --log-dir '{tmp_path}/logs #1'  # -n 5 is no flag\nprint('hi')")
    assert cell.ok and sorted(cell.stream().splitlines()) == ["[0] hi", "[1] hi"], cell.outputs
    # torchrun's layout: <dir>/<run id>_<random>/attempt_0/<local rank>/stdout.log
    assert [next((tmp_path / "logs #1").glob(f"*/attempt_0/{r}/stdout.log")).read_text()
            for r in range(2)] == ["hi\n", "hi\n"]
    cell = k.run(f"%%diprun -n 1 --log-dir {tmp_path}/logs#2\nprint('hi')")
    assert cell.ok, cell.outputs
    assert next((tmp_path / "logs#2").glob("*/attempt_0/0/stdout.log")).read_text() == "hi\n"


@pytest.mark.parametrize("code, needle", [
    ("%makedip -n 3 --backend bogus", "invalid choice"),
    ("%makedip -n 4", "already running"),
    ("%makedip -g all", "-g all"),
    ("%makedip -n 0 -r", "-n 0"),
    ("%makedip -r -a nosuchapp", "known apps"),
    ("%makedip -k -n 2", "-k"),
    ("%makedip --frobnicate", "unrecognized arguments"),
    ("%%dip --see 7\nprint('ran')", "--see 7"),
    ("%%dip --bogus\nprint('ran')", "unrecognized arguments"),
    ("%%dip local --to remote\nprint('ran')", "disagree"),
    ("%%dip sideways\nprint('ran')", "invalid choice"),
    ("%%dip local --timeout -1\nprint('ran')", "--timeout -1"),
    ("%%dip -q --tabs\nprint('ran')", "-q shows no rank; it contradicts --tabs"),
    ("%%dip --see none --tabs\nprint('ran')", "--see none shows no rank; it contradicts --tabs"),
    ("%dip print(1)", "%%dip"),
    ("%autodip maybe", "invalid choice"),
    ("%dipstatus now", "unrecognized arguments: now"),
    ("%makedip -n 2 # a comment, then a quote left open: '", "already running"),
    ("%makedip -n 4 -a 'open # not a comment", "cannot split"),
])
def test_bad_flags_raise_usage_error_and_change_nothing(k, code, needle):
    before = k.pids()
    cell = k.run(code)
    err = usage_error(cell)
    assert needle in err and "usage:" in err, err
    assert "ran" not in cell.stream()
    assert k.pids() == before


# -- life cycle (last: these replace the shared group) -----------------------------------------

def test_restart_gives_new_pids_and_keeps_options(k):
    before = k.pids()
    cell = k.run("%makedip -r -v")
    assert cell.ok and "ready in" in cell.stream()
    after = k.pids()
    assert len(after) == 3 and not set(after) & set(before)
    assert not any(_alive(p) for p in before)
    resized = k.run("%makedip -r -n 2 -t 30")
    assert resized.ok and len(k.pids()) == 2
    assert "-n 2 --backend none" in k.run("%makedip -i").stream()


def test_a_busy_rank_is_reported_by_its_error_type(k, tmp_path):
    started = tmp_path / "started"
    assert k.run("import pathlib, time\ng = get_ipython().magics_manager.registry['DipMagics'].group\n"
                 f"p = g.apply_async(lambda: (pathlib.Path({str(started)!r}).touch(), time.sleep(60)), "
                 f"ranks=[1])").ok
    cell = k.run("%%dip\nprint('ran')")
    [err] = cell.of_type("error")
    assert err["ename"] == "RankBusyError" and err["evalue"].startswith("rank(s) 1 still busy")
    assert "ran" not in cell.stream()
    assert wait_until(started.exists, 30)  # an interrupt before its code starts is dropped
    assert k.run("p.cancel(); assert p.results()[0].error.ename == 'KeyboardInterrupt'").ok
    assert k.run("%%dip\nprint('ran')").stream() == "ran\n"


def test_a_stopped_rank_is_reported_by_its_error_type_until_it_answers(k):
    import signal
    take = "g = get_ipython().magics_manager.registry['DipMagics'].group\n"
    assert k.run(take + "g.heartbeat_timeout = 1.0\n%makedip -r").ok  # restarted in place: 1 s heartbeats
    pid = k.pids()[1]
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while "unresponsive" not in k.run("%dipstatus").plain[0]:
            assert time.monotonic() < deadline, "rank 1 never showed up as unresponsive"
        cell = k.run("%%dip\nprint('ran')")
        [err] = cell.of_type("error")
        assert err["ename"] == "RankUnresponsiveError", err
        assert err["evalue"].startswith("rank(s) 1 stopped answering: no heartbeat for ")
        assert err["evalue"].endswith("wait for them to answer again, or run %makedip -r to replace them")
        assert "ran" not in cell.stream()
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while "unresponsive" in k.run("%dipstatus").plain[0]:
        assert time.monotonic() < deadline, "rank 1 never answered again"
    assert k.run("%%dip --see all --raw\nprint('ran')").stream().splitlines().count("ran") == 3  # each rank's
    assert k.run(take + "g.heartbeat_timeout = 10.0\n%makedip -r").ok


def test_a_dead_rank_is_reported_and_restart_recovers(k):
    import signal
    pids = k.pids()
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while "dead" not in k.run("%dipstatus").plain[0]:  # the runtime notices the death on its own time
        assert time.monotonic() < deadline, "rank 1 never showed up as dead"
    row = [line for line in k.run("%dipstatus").plain[0].splitlines() if line.startswith("1 ")][0]
    assert row.split()[3] == "dead"
    cell = k.run("%%dip\nprint('ran')")
    [err] = cell.of_type("error")
    assert "rank 1 is dead" in err["evalue"] and "%makedip -r" in err["evalue"]
    assert "ran" not in cell.stream()
    assert k.run("%makedip -r").ok
    assert len(k.run("%%dip --see all\n1").plain) == 3


def test_app_preset_sets_the_group_up(k, tmp_path):
    app = tmp_path / "dip_test_app.py"
    app.write_text("def setup_group(group):\n    group.run(\"APP_READY = 'yes'\")\n")
    # ddip.apps is where app presets live; make this test's one findable there.
    assert k.run(f"import ddip.apps\nddip.apps.__path__.append({str(tmp_path)!r})").ok
    cell = k.run("%makedip -r -a dip_test_app")
    assert cell.ok, cell.outputs
    assert "app: dip_test_app" in k.run("%makedip -i").stream()
    assert k.run("%%dip --see all\nAPP_READY").plain[-1].endswith(": 'yes'")
    err = usage_error(k.run("%makedip -r -a nosuch"))
    assert "dip_test_app" in err  # the known apps are listed


def test_a_group_that_does_not_come_up_in_time_is_reported(k):
    cell = k.run("%makedip -r -t 0.001")
    [err] = cell.of_type("error")
    assert err["ename"] == "StartError" and "-t SECONDS" in err["evalue"]
    assert "no group is running" in k.run("%makedip -i").stream()
    assert k.run("%makedip -r -t 30").ok and len(k.pids()) == 3


def test_kill_ends_every_rank(k):
    pids = k.pids()
    assert all(_alive(p) for p in pids)
    k.run('%autodip on')
    cell = k.run("%makedip -k")
    assert cell.ok and "killed the group" in cell.stream() and "autodip is now off" in cell.stream()
    assert not any(_alive(p) for p in pids)
    assert "no group" in usage_error(k.run("%%dip\n1"))
    assert "no group is running" in k.run("%makedip -k").stream()
    # Unloading the extension takes the magics (and any group) away; loading brings them back.
    assert k.run("%makedip -n 2 --backend none").ok
    pids = k.pids()
    assert k.run("%unload_ext ddip").ok
    assert not any(_alive(p) for p in pids)
    for magic in ("%makedip -i", "%dipush x", "%%dip\n1", "%%diprun\nprint('ran')"):  # every area's
        assert "not found" in usage_error(k.run(magic)), magic
    assert k.run("%load_ext ddip").ok
    assert "no group is running" in k.run("%makedip -i").stream()
    assert k.run("%%diprun\nprint('ran')").stream() == "[0] ran\n"
