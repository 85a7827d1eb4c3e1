"""ddip.worker, the rank's side of every request: IPython's shell in __main__ (magics, display(),
the last expression's value), notebook functions that call get_ipython(), notify(), and replies
the notebook can't rebuild. Through real groups (tests/test_group.py covers the Group itself)."""

import subprocess
import textwrap

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
