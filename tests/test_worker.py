"""ddip.worker, the rank's side of every request: IPython's shell in __main__ (magics, display(),
the last expression's value), notebook functions that call get_ipython(), notify(), and replies
the notebook can't rebuild. Through real groups (tests/test_group.py covers the Group itself)."""

import os
import signal
import subprocess
import textwrap
import time

import pytest

import ddip
from conftest import PY


def test_ipython_features_work_in_ranks(group2):
    res = group2.run("%time y = sum(range(10))\ny", ranks=[0])
    assert res[0].value == 45
    assert "Wall time" in res[0].stdout
    res = group2.run("from IPython.display import display, HTML\ndisplay(HTML('<b>hi</b>'))", ranks=[0])
    assert res[0].displays[0]["data"]["text/html"] == "<b>hi</b>"
    res = group2.run("[1, 2]", ranks=[0])
    assert res[0].format[0]["text/plain"] == "[1, 2]"


def test_display_callback_receives_rich_output(group2):
    got = []
    group2.run("from IPython.display import display, Markdown\ndisplay(Markdown('**m**'))",
               on_display=lambda rank, msg: got.append((rank, msg["data"]["text/markdown"])))
    assert sorted(got) == [(0, "**m**"), (1, "**m**")]


def test_notebook_functions_calling_get_ipython_get_the_ranks_shell(tmp_path):
    script = tmp_path / "nb.py"
    script.write_text(textwrap.dedent("""
        import ddip
        from IPython.core.interactiveshell import InteractiveShell
        get_ipython = InteractiveShell.instance().get_ipython   # what a notebook's namespace has
        def which_shell():
            return type(get_ipython()).__name__
        with ddip.Group(n=1, backend=None) as g:
            print(g.apply(which_shell))
    """))
    out = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['RankShell']"


def test_an_idle_rank_sleeps_and_a_signal_still_runs_its_handler_at_once(group2, tmp_path):
    # An idle rank waits for its next request in C++, in slices of a second: a signal ends the
    # wait itself, so the signal's Python handler runs at once, and no slice wakes the rank 20
    # times a second to look for one.
    flag = tmp_path / "handled"
    group2.run("import signal, pathlib\n"
               f"signal.signal(signal.SIGUSR1, lambda *a: pathlib.Path({str(flag)!r}).write_text('ran'))",
               ranks=[0])
    pid = group2.pids[0]

    def sleeps():  # how many times the rank's main thread went to sleep
        with open(f"/proc/{pid}/task/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:"))

    before = sleeps()
    time.sleep(2)  # the idle time measured
    woke = sleeps() - before
    assert woke <= 10, f"the idle rank's main thread woke {woke} times in 2 s"  # 20 a second before
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert flag.exists() and flag.read_text() == "ran", "the idle rank's handler did not run"
    assert [r.value for r in group2.run("1 + 1")] == [2, 2]


def test_notify_outside_a_rank_is_a_clear_error():
    import ddip.worker

    with pytest.raises(RuntimeError, match="only inside a ddip rank"):
        ddip.worker.notify(1)


def test_an_exception_the_notebook_cannot_rebuild_is_still_reported(group2):
    code = ("class Picky(Exception):\n    def __init__(self, a, b):\n        super().__init__(f'{a}-{b}')\n"
            "raise Picky(1, 2)")
    with pytest.raises(ddip.RemoteError) as e:
        group2.run(code)
    assert [(f.ename, f.evalue) for f in e.value.failures] == [("Picky", "1-2")] * 2
    assert [r.value for r in group2.run("5")] == [5, 5]


def test_the_worker_has_a_method_for_every_request_kind(group2):
    from ddip import messages as M

    res = group2.run("from ddip.rank import worker as _w\nsorted(t.__name__ for t in _w.current().handlers)", ranks=[0])
    assert res[0].value == sorted(t.__name__ for t in M.REQUESTS)


def test_a_request_of_no_known_kind_is_answered_with_an_error(group2):
    from ddip import messages as M
    from ddip.kernel.request import Callbacks, collect

    req = group2.send_request(M.PromptAnswer("n"), [0], "a stray record")  # not a request
    (result,) = collect(group2, req, Callbacks(), None)
    assert result.error.ename == "ValueError" and "unknown request PromptAnswer" in result.error.evalue
    assert [r.value for r in group2.run("6")] == [6, 6]  # the rank serves on


# -- the lean request path (ddip/rank/plain_cells.py) -------------------------------------------

def _served(g) -> int:
    """How many cells rank 0 has run without run_cell (this cell itself takes run_cell: its last
    statement is an expression)."""
    return g.run("from ddip.rank import worker as _w\n_w.current().plain.served", ranks=[0])[0].value


@pytest.mark.parametrize("code, plain", [
    ("pass", True), ("x = 1", True), ("for i in range(3):\n    y = i", True), ("import os", True),
    ("def f():\n    return 1", True), ("x = 1\nx", False), ("1", False), ("print('p')", False),
    ("%time z = 1", False), ("!true", False), ("  x = 2", False), ("x = 2;", True),
    ("import asyncio\nr = await asyncio.sleep(0)", False), ("", False), ("x = 1\nreturn 1", False),
])
def test_plain_python_skips_run_cell_and_the_rest_takes_it(group2, code, plain):
    before = _served(group2)
    try:
        group2.run(code, ranks=[0])
    except ddip.RemoteError:
        assert code.endswith("return 1")  # compiles only statement by statement: run_cell's error
    assert _served(group2) - before == (1 if plain else 0)


def test_a_debugger_cell_name_or_a_pre_run_cell_handler_takes_run_cell(group2):
    before = _served(group2)
    group2.run("x = 3", ranks=[0], cell=("/tmp/ddip-cell-1.py", 2))
    assert _served(group2) == before
    group2.run("_seen = []\n_h = lambda info: _seen.append(info.raw_cell)\n"
               "get_ipython().events.register('pre_run_cell', _h)", ranks=[0])
    try:
        before = _served(group2)
        group2.run("x = 4", ranks=[0])
        assert _served(group2) == before
        assert group2.run("'x = 4' in _seen", ranks=[0])[0].value is True  # the handler saw it
    finally:
        group2.run("get_ipython().events.unregister('pre_run_cell', _h)", ranks=[0])
    before = _served(group2)
    group2.run("x = 5", ranks=[0])
    assert _served(group2) == before + 1



def test_a_cell_run_again_and_again_keeps_one_copy_of_its_text(group2):
    # A rank driven by g.run in a loop serves millions of cells: with history off nothing may queue
    # for a database, a plain cell's text is stored once however often it runs (In, _iN), and the
    # lines of one that leaves nothing behind (no def, lambda, class, try or with) are dropped.
    cell = "v = 1  # " + "marker" * 200
    for _ in range(20):
        group2.run(cell, ranks=[0])
    probe = ("import linecache\nh = get_ipython().history_manager\n"
             "(In[-2] is In[-3], len(h.db_input_cache) <= 1, len(h.db_output_cache),"  # <= 1: this cell itself
             " sum(1 for e in list(linecache.cache.values()) if 'mark' + 'er' * 1 + 'marker' in ''.join(e[2])))")
    assert group2.run(probe, ranks=[0])[0].value == (True, True, 0, 0)
    group2.run("def kept():\n    return 'marker' * 2", ranks=[0])  # its lines stay: tracebacks and getsource need them
    assert group2.run("import inspect\ninspect.getsource(kept)", ranks=[0])[0].value.startswith("def kept")


def test_an_observer_of_the_shells_traits_sees_every_plain_cell(group2):
    # The lean path writes the execution count and the history's values without traitlets' setter
    # only while nothing observes them: an observer (of one trait, or of all) gets every change.
    group2.run("_counts = []\n_seen = lambda change: _counts.append((change.name, change.new))\n"
               "get_ipython().observe(_seen, names=['execution_count'])\n"
               "get_ipython().history_manager.observe(_seen)", ranks=[0])
    try:
        before = _served(group2)
        group2.run("a = 1", ranks=[0])
        group2.run("b = 2", ranks=[0])
        assert _served(group2) - before == 2  # plain cells, run by the lean path
        counts = group2.run("_counts", ranks=[0])[0].value
    finally:
        group2.run("get_ipython().unobserve(_seen, names=['execution_count'])\n"
                   "get_ipython().history_manager.unobserve(_seen)", ranks=[0])
    changed = [name for name, _ in counts]
    assert changed.count("execution_count") >= 2 and "_i00" in changed, counts
    assert ("_i00", "b = 2") in counts


def test_the_shells_settings_are_followed_as_they_change(group2):
    # An input transformer: the cell is no longer what IPython runs, so run_cell runs it.
    group2.run("get_ipython().input_transformers_post.append(lambda lines: [l.replace('41', '42') for l in lines])",
               ranks=[0])
    try:
        group2.run("v = 41", ranks=[0])
        assert group2.run("v", ranks=[0])[0].value == 42
    finally:
        group2.run("get_ipython().input_transformers_post.pop()", ranks=[0])
    group2.run("v = 41", ranks=[0])
    assert group2.run("v", ranks=[0])[0].value == 41
    # %config InteractiveShell.ast_node_interactivity: an assignment's value is shown.
    group2.run("get_ipython().ast_node_interactivity = 'last_expr_or_assign'", ranks=[0])
    try:
        assert group2.run("w = 5", ranks=[0])[0].value == 5
    finally:
        group2.run("get_ipython().ast_node_interactivity = 'last_expr'", ranks=[0])
    assert group2.run("w = 6", ranks=[0])[0].value is None

CELLS = ["x = 1", "x", "pass", "y = x + 1", "y", "def f(a):\n    return 1 / a", "z = f(0)", "f(0)",
         "for i in range(2):\n    print(i)", "import sys\nsys.stderr.write('e\\n')\nw = 3",
         "raise ValueError('v')", "q = 0\n1/0\nq = 1", "x = (", "%time t = 1", "t",
         "class C:\n    pass", "c = C()", "import inspect\nsrc = inspect.getsource(f)", "src",
         "get_ipython().execution_count", "In[1:], _i, _ii, _iii, _i3", "sorted(Out)", "_, __",
         "import warnings\nwarnings.warn('w')\nw2 = 1", "warnings.warn('w')\nw2 = 2", "def g():\n    yield 1\nlist(g())", "x = 1\nreturn 1",
         "import asyncio\nr = await asyncio.sleep(0, 'a')", "r",
         # a cell that ran without error, whose caught exception's traceback is shown later
         "try:\n    1 / 0\nexcept ZeroDivisionError as exc:\n    saved = exc", "raise saved",
         "import contextlib\nwith contextlib.suppress(KeyError):\n    {}['k']\nx = 1", "x = 1", "In[-3:]"]


def test_the_lean_path_and_run_cell_give_the_same_counts_values_output_and_errors():
    with ddip.Group(n=1, backend=None) as lean, ddip.Group(n=1, backend=None, env={"DDIP_LEAN": "0"}) as full:
        seen = {}
        for name, g in (("lean", lean), ("full", full)):
            got = []
            for code in CELLS:
                try:
                    (r,) = g.run(code)
                except ddip.RemoteError as exc:
                    (r,) = exc.results
                err = r.error and (r.error.ename, r.error.evalue, r.error.traceback)
                out = "" if code.startswith("%time") else r.stdout
                got.append((code, r.execution_count, repr(r.value), r.format, out, r.stderr, err))
            # What the history keeps of each cell's output (as %notebook writes it; %time's times
            # differ), and the streams' writes put back after every cell (IPython's _tee's is a closure).
            got.append(g.run("import sys\n{n: [(o.output_type, o.bundle) for o in v if 'Wall time' not in str(o.bundle)] for n, v in "
                             "get_ipython().history_manager.outputs.items()}, "
                             "[('write' in vars(s)) and s.write.__qualname__ for s in (sys.stdout, sys.stderr)]")[0].value)
            with pytest.raises(TimeoutError) as e:  # Ctrl-C in a plain cell: KeyboardInterrupt, as before
                g.run("import time\nfor _ in range(10000):\n    time.sleep(0.01)", timeout=1)
            got.append(("interrupted", e.value.results[0].error.ename, e.value.results[0].execution_count))
            seen[name] = got
        for a, b in zip(seen["lean"], seen["full"]):
            assert a == b
        assert lean.run("from ddip.rank import worker as _w\n_w.current().plain.served")[0].value > 8
        assert full.run("from ddip.rank import worker as _w\n_w.current().plain")[0].value is None
