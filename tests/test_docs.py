"""The README's and docs' runnable snippets, executed through a real Jupyter kernel.

A fenced block runs when the line just before its opening fence is a marker that GitHub does not
show (an HTML comment):

    <!-- ddip:run -->               the block runs as one notebook cell and must not fail
    <!-- ddip:run expect -->        ... and the fenced block right after it (the output the doc
                                    shows) must appear in the cell's output; `...` stands for
                                    anything (doctest's ELLIPSIS), runs of whitespace compare equal,
                                    and each `[rank N]` part is compared with that rank's own
    <!-- ddip:run raises=NAME -->   ... the cell must fail with NAME (an exception's name, or
                                    UsageError), as the doc says it does

and a comment that starts `<!-- ddip:hidden` holds code that runs at that place as its own cell
without being shown: what a snippet takes for granted (a `model`, a `dataloader`), or asserts on
what the snippet made. Each document runs in one kernel of its own, in a fresh working directory,
its cells in order. Blocks that need what a test machine lacks (GPUs, other hosts, Slurm, a
terminal, downloads) stay unmarked. An unmarked fenced block is text, markers inside it too.
The rules, with an example: docs/contributing.md, "Docs that run".

    python tests/test_docs.py docs/magics.md     # runs one document and prints every cell's output
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_magics_notebook import cell_text, execute_notebook  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))

MARKER = re.compile(r"^<!-- ddip:run(?P<options>(?: [^>]*)?) -->$")
HIDDEN = "<!-- ddip:hidden"
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)")
CELL_TIMEOUT = 180


@dataclass
class Snippet:
    line: int                 # where its code starts in the document (1-based), for messages
    code: str
    hidden: bool = False
    expect: str | None = None  # the output the document shows, when it is to be checked
    raises: str | None = None
    outputs: list = field(default_factory=list)
    status: str = ""


class MarkupError(ValueError):
    """A marker the runner can't read: named with its document and line."""


def _fenced_block(lines: list[str], start: int, doc: str) -> tuple[str, int]:
    """The content of the fenced block that opens at lines[start] (dedented as far as its opening
    fence is indented), and the index of the line after its closing fence."""
    m = FENCE.match(lines[start]) if start < len(lines) else None
    if not m:
        raise MarkupError(f"{doc}:{start + 1}: a ddip:run marker must be followed by a fenced block")
    indent, fence = len(m["indent"]), m["fence"]
    for end in range(start + 1, len(lines)):
        if lines[end].strip().startswith(fence[0] * len(fence)) and lines[end].strip().strip(fence[0]) == "":
            body = [line[indent:] if line[:indent].strip() == "" else line for line in lines[start + 1:end]]
            return "\n".join(body), end + 1
    raise MarkupError(f"{doc}:{start + 1}: this fenced block is never closed")


def _options(text: str, doc: str, line: int) -> dict:
    options = {}
    for word in text.split():
        name, _, value = word.partition("=")
        if name not in ("expect", "raises") or (name == "raises") != bool(value):
            raise MarkupError(f"{doc}:{line}: unknown ddip:run option {word!r} (known: expect, raises=NAME)")
        options[name] = value or True
    return options


def snippets(doc: str) -> list[Snippet]:
    """The cells a document runs, in order."""
    lines = (ROOT / doc).read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith(HIDDEN):
            end = next((j for j in range(i, len(lines)) if lines[j].rstrip().endswith("-->")), None)
            if end is None:
                raise MarkupError(f"{doc}:{i + 1}: a ddip:hidden comment is never closed")
            body = "\n".join(lines[i:end + 1]).strip()[len(HIDDEN):-len("-->")]
            out.append(Snippet(line=i + 2, code=body.strip("\n"), hidden=True))
            i = end + 1
            continue
        m = MARKER.match(stripped)
        if not m:
            if stripped.startswith("<!-- ddip"):
                raise MarkupError(f"{doc}:{i + 1}: not a ddip marker: {stripped!r}")
            # An unmarked block is skipped whole: what it shows (markers included) is text.
            i = _fenced_block(lines, i, doc)[1] if FENCE.match(lines[i]) else i + 1
            continue
        options = _options(m["options"], doc, i + 1)
        code, after = _fenced_block(lines, i + 1, doc)
        snippet = Snippet(line=i + 3, code=code, raises=options.get("raises"))
        i = after
        if options.get("expect"):
            j = i
            while j < len(lines) and not lines[j].strip():
                j += 1
            snippet.expect, i = _fenced_block(lines, j, doc)
        out.append(snippet)
    return out


def run_document(doc: str, cwd: str) -> list[Snippet]:
    """Runs the document's cells in one fresh kernel; fills in each snippet's outputs and status."""
    cells = snippets(doc)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s.code) for s in cells])

    def executed(cell, cell_index, execute_reply):
        cells[cell_index].status = execute_reply["content"]["status"]

    execute_notebook(nb, cwd, timeout=CELL_TIMEOUT, allow_errors=True, interrupt_on_timeout=True,
                     on_cell_executed=executed)
    for snippet, cell in zip(cells, nb.cells):
        snippet.outputs = cell.outputs
    return cells


def _error(snippet: Snippet) -> str:
    """The cell's failure in its own words: the error output's last line, or a UsageError's line."""
    for out in snippet.outputs:
        if out.output_type == "error":
            return f"{out.ename}: {out.evalue}"
    text = cell_text(snippet.outputs)
    usage = [line for line in text.splitlines() if line.startswith("UsageError")]
    return usage[0] if usage else text.strip().splitlines()[-1] if text.strip() else "(no output)"


RANK_LABEL = re.compile(r"^\[rank \d+\]$")


def _by_rank(text: str) -> dict:
    """Output split at ddip's `[rank N]` label lines, each rank's parts joined in order (ranks
    print side by side, so which comes first is not the document's to show)."""
    parts, label = {}, None
    for line in text.splitlines():
        if RANK_LABEL.match(line.strip()):
            label = line.strip()
            continue
        parts.setdefault(label, []).append(line)
    return {k: "\n".join(v) for k, v in parts.items()}


def _shows(want: str, got: str) -> bool:
    """Whether the output shown appears in the output printed: `...` stands for anything, runs of
    whitespace compare equal, and each rank's labelled part is compared with that rank's."""
    checker = doctest.OutputChecker()
    got_parts = _by_rank(got)
    return all(checker.check_output("..." + part.strip() + "...", got_parts.get(label, ""),
                                    doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
               for label, part in _by_rank(want).items())


def failures(doc: str, cells: list[Snippet]) -> list[str]:
    problems = []
    for s in cells:
        where = f"{doc}:{s.line}" + (" (hidden)" if s.hidden else "")
        text = cell_text(s.outputs)
        failed = s.status != "ok" or "UsageError" in text
        if s.raises:
            if not failed or s.raises not in _error(s):
                problems.append(f"{where}: should fail with {s.raises}, but {_error(s) if failed else 'ran'}")
                continue
        elif failed:
            problems.append(f"{where}: {_error(s)}\n    in: {s.code.splitlines()[0] if s.code else ''}")
            continue
        if s.expect is not None and not _shows(s.expect, text):  # a failure's message too (raises= expect)
            problems.append(f"{where}: the output the document shows is not what the cell printed\n"
                            f"--- shown:\n{s.expect}\n--- printed:\n{text}")
    return problems


def _runs_something(doc: str) -> bool:
    try:
        return bool(snippets(doc))
    except MarkupError:
        return True  # its test fails, naming the marker's line


RUNNABLE = [doc for doc in DOCUMENTS if _runs_something(doc)]


@pytest.mark.parametrize("doc", RUNNABLE)
def test_a_documents_runnable_snippets_run_as_written(doc, tmp_path):
    problems = failures(doc, run_document(doc, str(tmp_path)))
    assert not problems, "\n\n".join(problems)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*$")


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a markdown file's headings (lower case, punctuation dropped, spaces
    to hyphens), outside fenced blocks."""
    anchors, fence = set(), None
    for line in path.read_text().split("\n"):
        m = FENCE.match(line)
        if m and (fence is None or m["fence"].startswith(fence)):
            fence = None if fence else m["fence"]
            continue
        h = None if fence else HEADING.match(line)
        if h:
            anchors.add(re.sub(r"[^\w\- ]", "", h[1].strip().lower()).replace(" ", "-"))
    return anchors


def _in_repository(path: Path) -> bool:
    if not path.resolve().is_relative_to(ROOT) or not path.exists():
        return False
    if not (ROOT / ".git").exists():
        return True  # an unpacked sdist: what exists is what ships
    rel = str(path.resolve().relative_to(ROOT))
    return bool(subprocess.run(["git", "-C", str(ROOT), "ls-files", "--", rel],
                               capture_output=True, text=True).stdout.strip())


def test_links_between_documents_lead_to_files_and_headings_of_the_repository():
    """A clone stands on its own: every relative link of the README, the docs and the tests' and
    benchmarks' READMEs leads to a file the repository holds, and to a heading there."""
    broken = []
    for doc in DOCUMENTS + ["tests/README.md", "bench/README.md"]:
        for n, line in enumerate((ROOT / doc).read_text().split("\n"), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # http(s), mailto
                path, _, anchor = target.partition("#")
                file = (ROOT / doc).parent / path if path else ROOT / doc
                if not _in_repository(file):
                    broken.append(f"{doc}:{n}: {target}: no such file in the repository")
                elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                    broken.append(f"{doc}:{n}: {target}: no heading #{anchor} in {path or doc}")
    assert not broken, "\n".join(broken)


def test_the_runner_reads_markers_and_rejects_broken_ones(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    doc.write_text("text\n````\n<!-- ddip:run -->\n```\nshown, not run\n```\n````\n<!-- ddip:hidden\nx = 1\n-->\n<!-- ddip:run expect -->\n```python\nprint(x)\n```\n\n"
                   "```\n1\n```\n  <!-- ddip:run raises=ValueError -->\n  ```python\n  int('a')\n  ```\n"
                   "```python\nnot marked\n```\n")
    got = snippets("doc.md")
    assert [(s.line, s.code, s.hidden, s.expect, s.raises) for s in got] == [
        (9, "x = 1", True, None, None), (13, "print(x)", False, "1", None), (21, "int('a')", False, None, "ValueError")]
    for text, problem in [("<!-- ddip:run -->\ntext\n", "must be followed by a fenced block"),
                          ("<!-- ddip:run expect=1 -->\n```\nx\n```\n", "unknown ddip:run option"),
                          ("<!-- ddip:hidden\nx = 1\n", "never closed"),
                          ("<!-- ddip:runs -->\n", "not a ddip marker")]:
        doc.write_text(text)
        with pytest.raises(MarkupError, match=problem):
            snippets("doc.md")
    # What a failure says: the document, the line and the error; and a shown output that differs.
    cells = [Snippet(3, "1/0", status="error",
                     outputs=[nbformat.v4.new_output("error", ename="ZeroDivisionError", evalue="division by zero",
                                                     traceback=[])]),
             Snippet(5, "print(2)", expect="3", status="ok",
                     outputs=[nbformat.v4.new_output("stream", name="stdout", text="2\n")]),
             Snippet(7, "%makedip -x", status="error",
                     outputs=[nbformat.v4.new_output("stream", name="stderr", text="UsageError: bad -x\n")])]
    assert _shows("[rank 0]\n0 ...\n[rank 1]\n1 2", "[rank 1]\n1 2\n[rank 0]\n0 2\n[rank 1]\nmore")
    assert not _shows("[rank 0]\n1 2", "[rank 1]\n1 2\n[rank 0]\n0 2")
    assert failures("doc.md", cells) == [
        "doc.md:3: ZeroDivisionError: division by zero\n    in: 1/0",
        "doc.md:5: the output the document shows is not what the cell printed\n--- shown:\n3\n--- printed:\n2\n",
        "doc.md:7: UsageError: bad -x\n    in: %makedip -x"]


def main(argv):
    if not argv:
        print(__doc__)
        return 2
    rc = 0
    for doc in argv:
        with tempfile.TemporaryDirectory() as cwd:
            cells = run_document(os.path.relpath(os.path.abspath(doc), ROOT), cwd)
        for s in cells:
            print(f"== {doc}:{s.line}{' (hidden)' if s.hidden else ''} [{s.status}]\n{s.code}\n-- output:\n{cell_text(s.outputs)}")
        problems = failures(doc, cells)
        print("\n\n".join(problems) or f"{doc}: every snippet ran as documented")
        rc = rc or bool(problems)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
