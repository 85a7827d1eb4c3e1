"""Ranks' output in the notebook (or a terminal): labelled with its rank, written live. The one
labelling path of the notebook's side: %%dip, output between cells, ranch and %%diprun all write
through a LabelledOutput, and `pieces` is the one '\r'/'\n' splitter of the Python package (the
C++ runtime's is ddip::for_each_line)."""

from __future__ import annotations

import re
import sys
import threading
from typing import Callable, Iterator

from . import _core

_PIECE = re.compile(r"([^\r\n]*)(\r\n|\r|\n|\Z)")


def rank_label(rank) -> str:
    """How a rank is named in the notebook, everywhere: "[rank 3]"; several ranks (a tuple: a line
    they all wrote, ddip.repeats) as "[ranks 0-126]". `ddip run`, a terminal tool, writes
    torchrun's shorter "[3] " instead."""
    return f"[{ranks_named(rank if isinstance(rank, tuple) else (rank,))}]"


def ranks_named(ranks) -> str:
    """"rank 3", or "ranks 0-126" / "ranks 0,2,4-7" (the runtime's one spelling of a rank set)."""
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_core.rank_ranges(ranks)}"


def pieces(text: str) -> Iterator[tuple[str, str]]:
    """`text` as (body, end) pieces: `end` is "\n", "\r\n", "\r" (a redrawn progress bar), or ""
    for text after the last line end."""
    for m in _PIECE.finditer(text):
        body, end = m.group(1), m.group(2)
        if body or end:
            yield body, end


class LabelledOutput:
    """An on_output callback: ranks' output written live, labelled with its rank.

    Each line is labelled ("[rank 3] text"), or, with headers=True (a %%dip cell: its output reads
    as a notebook cell's), a "[rank 3]" line heads each run of one rank's output. label=None: the
    text as it is (one rank shown).

    Writers share the streams, so a line is never continued by another writer: text that comes
    while another's line is unfinished starts a new line. A line redrawn with '\r' (a text
    progress bar) is labelled again after each '\r' and stays in place; two writers redrawing
    take turns on one line, padded so that nothing of the other's line shows. Used as a context
    manager (ranch), this process's own sys.stdout/sys.stderr (the notebook's rank) go through it
    too, unlabelled."""

    def __init__(self, label: Callable[[int], str] | None = rank_label, headers: bool = False):
        self._label = label
        self._headers = headers
        self._lock = threading.RLock()
        self._lines: dict[str, dict] = {}  # stream -> its open line (_new_line)
        self._writers: dict = {}  # writer -> its state (_writer)
        self._replaced: dict = {}  # stream name -> the stream __enter__ replaced
        self._headed = None  # headers: the rank whose output came last
        self._at_start = {"stdout": True, "stderr": True}  # headers: each stream at a line's start

    def __call__(self, rank, stream, text):
        if self._headers or self._label is None:
            return self.headed(rank, stream, text)
        self.write((rank, stream), self._label(rank) + " ", stream, text)

    def headed(self, rank, stream: str, text: str = "") -> None:
        """Writes `text` of `rank` to sys.<stream>, after a header line when another rank's output
        came last (text "": only the header, as before a rank's display)."""
        with self._lock:
            dest = getattr(sys, stream)
            if self._label is not None and rank != self._headed:
                dest.write(("" if self._at_start[stream] else "\n") + self._label(rank) + "\n")
                self._at_start[stream] = True
            self._headed = rank
            if text:
                dest.write(text)
                self._at_start[stream] = text.endswith("\n")
            dest.flush()  # live: sent now, not at ipykernel's next flush interval

    def forget(self) -> None:
        """The output shown so far was cleared: the next output is headed again."""
        with self._lock:
            self._headed = None
            self._at_start = {"stdout": True, "stderr": True}

    def write(self, writer, label: str, stream: str, text: str, dest=None) -> None:
        """Writes `writer`'s text to sys.<stream> (or `dest`), each line labelled with `label`."""
        if not text:
            return
        with self._lock:
            line = self._lines.setdefault(stream, self._new_line())
            out: list[str] = []
            for body, end in pieces(text):
                if body:
                    self._body(line, writer, label, body, end == "\r", out)
                if end:
                    self._end(line, writer, label, end, out)
            if dest is None:
                dest = self._replaced.get(stream) or getattr(sys, stream)
            if out:
                dest.write("".join(out))
                dest.flush()

    @staticmethod
    def _new_line() -> dict:
        # redraw: the line began after its writer's '\r' (a bar); at_cr: the cursor is back at its start
        return {"owner": None, "at_cr": False, "redraw": False, "col": 0, "span": 0}

    def _body(self, line, writer, label, body, then_cr, out):
        me = self._writer(writer)
        redraw = me["after_cr"] or then_cr  # a line that comes or goes with '\r': a bar
        owner = line["owner"]
        if owner not in (None, writer):
            if redraw and (line["at_cr"] or line["redraw"]):
                if not line["at_cr"]:
                    out.append("\r")  # two bars take turns on one line
                line["at_cr"] = True
                self._writer(owner)["displaced"] = True
            else:
                out.append("\n")  # another's unfinished line: ours starts below it
                line.update(self._new_line())
        start = line["owner"] != writer or line["at_cr"]  # a line of ours starts (or is redrawn)
        if start:
            out.append(label)
            line.update(owner=writer, at_cr=False, col=len(label), redraw=redraw)
            me["drawn"] = ""
        out.append(body)
        line["col"] += len(body)
        if start and line["span"] > line["col"]:  # blank what is left of a longer line drawn there
            out.append(" " * (line["span"] - line["col"]) + "\r" + label + body)
        line["span"] = max(line["span"], line["col"])
        me.update(after_cr=False, mid=True, displaced=False, drawn=me["drawn"] + body)

    def _end(self, line, writer, label, end, out):
        me = self._writer(writer)
        mine = line["owner"] == writer
        if mine and not line["at_cr"]:
            out.append(" " * (line["span"] - line["col"]))  # covers a longer line drawn there
        if end == "\r":
            if mine and not line["at_cr"]:
                out.append("\r")
                line.update(at_cr=True, col=0)
            me["after_cr"] = True
            return
        if mine or me["displaced"] or not me["mid"]:
            pad = 0
            if not mine and line["owner"] is not None:
                if me["displaced"] and line["redraw"]:
                    # Another's bar redraws over ours: our last state takes the line back, and its
                    # bar comes back below with its next redraw (or its end), never left half-way.
                    out.append("\r")
                    pad = line["span"] - len(label + me["drawn"])
                    self._writer(line["owner"])["displaced"] = True
                else:
                    out.append("\n")  # below the line another writer has open
            if not mine:  # our last draw (overwritten by another's), or an empty line of ours
                out.append(label + (me["drawn"] if me["displaced"] else "") + " " * max(0, pad))
            out.append("\n")
            line.update(self._new_line())
        # else: our line was ended already, by another's text below it
        me.update(after_cr=False, mid=False, displaced=False, drawn="")

    def _writer(self, writer) -> dict:
        # after_cr: its last text was '\r'; mid: its line is unfinished (shown, or displaced by
        # another's redraw, its last draw `drawn`)
        return self._writers.setdefault(writer, {"after_cr": False, "mid": False, "displaced": False,
                                                 "drawn": ""})

    class _Own:
        """This process's own stream while a LabelledOutput is entered: its text goes through it,
        a line at a time. print() writes each argument and separator by itself, so a line passed
        on piece by piece could be cut by a rank's line arriving between two pieces (and its
        rest shown below it, unlabelled): an unfinished line is kept until its end ('\n', '\r'),
        or until flush() (print(..., flush=True), or the end of the launch)."""

        def __init__(self, out: "LabelledOutput", name: str, stream):
            self._out, self._name, self._stream = out, name, stream
            self._partial = ""

        def write(self, text):
            if not isinstance(text, str):
                return self._stream.write(text)
            with self._out._lock:
                pending = self._partial + text
                cut = max(pending.rfind("\n"), pending.rfind("\r")) + 1
                self._partial = pending[cut:]
                if cut:
                    self._out.write("own", "", self._name, pending[:cut], self._stream)
            return len(text)

        def writelines(self, lines):
            for text in lines:
                self.write(text)

        def flush(self):
            with self._out._lock:
                partial, self._partial = self._partial, ""
                if partial:
                    self._out.write("own", "", self._name, partial, self._stream)
            self._stream.flush()

        def __getattr__(self, name):
            return getattr(self._stream, name)

    def __enter__(self):
        for name in ("stdout", "stderr"):
            self._replaced[name] = getattr(sys, name)
            setattr(sys, name, LabelledOutput._Own(self, name, self._replaced[name]))
        return self

    def __exit__(self, *exc):
        for name, stream in self._replaced.items():
            current = getattr(sys, name)
            if isinstance(current, LabelledOutput._Own) and current._out is self:
                current.flush()  # an unfinished last line of the notebook's own
                setattr(sys, name, stream)  # unless the user's code replaced it meanwhile
        self._replaced = {}
