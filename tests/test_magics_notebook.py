"""examples/user_guide.ipynb, executed through a real kernel with nbclient.

    python tests/test_magics_notebook.py --write    # re-executes it and saves its outputs into the file
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_magics import KERNEL_NAME, install_kernelspec  # noqa: E402

from ddip.errors import strip_ansi  # noqa: E402

GUIDE = Path(__file__).resolve().parent.parent / "examples" / "user_guide.ipynb"


def execute_notebook(nb, cwd, **client_options):
    """Executes nb in place on this interpreter's kernel (a fresh one, shut down at the end),
    with cwd as its working directory; client_options go to nbclient's NotebookClient."""
    with tempfile.TemporaryDirectory() as root:
        old = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = install_kernelspec(Path(root))
        try:
            NotebookClient(nb, kernel_name=KERNEL_NAME, record_timing=False,
                           resources={"metadata": {"path": str(cwd)}}, **client_options).execute()
        finally:
            if old is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = old


def execute_guide():
    """The guide with fresh outputs, run on this interpreter's kernel; cells tagged
    raises-exception may fail, any other failing cell raises CellExecutionError."""
    nb = nbformat.read(GUIDE, as_version=4)
    execute_notebook(nb, GUIDE.parent, timeout=300)
    # Saved as written for users: their own python3 kernel, not the test's.
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def cell_text(outputs) -> str:
    """A cell's outputs as text, in order: streams, the plain form of values and displays, and
    tracebacks without their colours."""
    parts = []
    for out in outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(out.data.get("text/plain", "") + "\n")
        elif out.output_type == "error":
            parts.append(strip_ansi("\n".join(out.traceback)) + "\n")
    return "".join(parts)


def _text(cell) -> str:
    return cell_text(cell.get("outputs", []))


def _cell(nb, starts: str):
    [cell] = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(starts)]
    return cell


def test_user_guide_runs_and_shows_every_feature():
    nb = execute_guide()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        failed = any(o.output_type == "error" for o in cell.outputs) or "UsageError" in _text(cell)
        assert failed == ("raises-exception" in cell.metadata.get("tags", [])), (cell.source, _text(cell))

    assert "rank 2 -> cpu" in _text(_cell(nb, "%makedip -i"))
    assert _text(_cell(nb, '%%dip\nimport os')) == "hello from rank 0 of 3\n"
    see_all = _text(_cell(nb, "%%dip --see all\nprint"))
    assert all(f"[rank {r}]\nhello from rank {r} of 3" in see_all for r in range(3))
    assert _text(_cell(nb, "%%dip -q")) == ""
    reduced = _text(_cell(nb, "%%dip --see all\nimport torch"))
    assert all(f"Out[{r}:" in reduced for r in range(3)) and reduced.count("tensor([6.])") == 3

    rich = _cell(nb, "%%dip\nfrom IPython.display")
    assert sum("text/html" in o.get("data", {}) for o in rich.outputs) == 2
    plot = _cell(nb, "%%dip\n%matplotlib inline")
    assert any("image/png" in o.get("data", {}) for o in plot.outputs)
    [bar] = _cell(nb, "%%dip\nimport time\nfrom tqdm.auto").outputs  # one bar, saved at its last state
    assert "<progress value='40' max='40'" in bar["data"]["text/html"]

    merged = [o for o in _cell(nb, "%%dip\ndef train_step").outputs if o.output_type == "error"]
    assert len(merged) == 1 and "ranks 0-2 (the same traceback on each)" in strip_ansi(merged[0].traceback[0])
    split = [o for o in _cell(nb, "%%dip\nif rank > 0").outputs if o.output_type == "error"]
    assert [o.ename for o in split] == ["KeyError", "KeyError"]

    assert "from rank 2: 19900" in _text(_cell(nb, "%dipull result"))
    auto = _text(_cell(nb, 'print(f"rank {rank}: batch_size'))
    assert all(f"rank {r}: batch_size=64" in auto for r in range(3))
    assert "this one ran in the notebook" in _text(_cell(nb, "%%dip local\nprint(\"this one"))
    assert "idle" in _text(_cell(nb, "%dipstatus"))
    stacks = _text(_cell(nb, "%dipstack -r 0"))  # the rank's background thread, where it waits
    assert "[rank 0]" in stacks and "[rank 1]" not in stacks and "in load_batches" in stacks
    assert _text(_cell(nb, "%%dip --ranks 1")) == "only rank 1 ran this\n"
    debug = strip_ansi(_text(_cell(nb, "%dipdebug")))  # pdb in rank 1 on its frame; headless: nobody answers
    assert "[rank 1] > " in debug and "load_shard()" in debug and "this frontend can't take input" in debug
    hang = _text(_cell(nb, "%%dip --timeout 2"))
    assert "=> ranks 1, 2 have not entered all_reduce #2 (float32[1024]), which rank 0 has waited in" in hang
    assert hang.index("=> ranks 1, 2") < hang.index("[rank 0] did not stop; where it was:")
    assert "healed in" in _text(_cell(nb, "%makedip --heal"))
    script = _text(_cell(nb, "%%diprun -n 2"))
    assert "[0] rank 0 of 2: 3.0" in script and "[1] rank 1 of 2: 3.0" in script
    assert "invalid choice: 'mpi'" in _text(_cell(nb, "%makedip -n 3 --backend mpi"))
    assert "fresh namespace: False" in _text(_cell(nb, "%%dip --see all\n\"fresh"))


def test_user_guide_uses_every_magic_ddip_registers():
    """docs/magics.md says the guide runs every magic: each line and cell magic, by its name."""
    from ddip.magics import CellMagics, DataMagics, DipMagics, DipRunMagics, PanelMagics

    lines = [line for c in nbformat.read(GUIDE, as_version=4).cells if c.cell_type == "code"
             for line in c.source.splitlines()]
    registered = [("%" if kind == "line" else "%%") + name
                  for cls in (DipMagics, CellMagics, DataMagics, DipRunMagics, PanelMagics)
                  for kind, names in cls.magics.items() for name in names]
    assert len(registered) == 9
    missing = [m for m in registered if not any(line == m or line.startswith(m + " ") for line in lines)]
    assert not missing, f"examples/user_guide.ipynb does not run {missing}"


def main(argv):
    if argv != ["--write"]:
        print(__doc__)
        return 2
    nb = execute_guide()
    nbformat.write(nb, GUIDE)
    print(f"wrote {GUIDE} with its outputs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
