"""How the magics show things in the notebook, in one place: rank labels on live output, a rank's
last value as Out[rank:n], the ranks' tracebacks (merged when identical) and errors as IPython
shows its own, heal notes, %dipstack's stacks, and %%diprun's output (the rank panel: kernel/
panel_view.py; %%dip --tabs: magics/tabs.py)."""

from __future__ import annotations

import functools
import re
import sys

from IPython.display import publish_display_data

from ..kernel.displays import RankDisplays
from ..errors import merge_failures
from ..labels import LabelledOutput, pieces, rank_label, ranks_named
from ..repeats import Repeats


def header(text: str) -> str:
    """A bold red line, as IPython starts a traceback."""
    return f"\x1b[1;31m{text}\x1b[0m"


# -- errors ---------------------------------------------------------------------------------------

class CellError(Exception):
    """A magic's cell failed. IPython's custom-exception hook (show_cell_errors) shows `entries`
    (the ranks' own tracebacks, merged) instead of a local traceback of the magic's internals,
    and the cell still counts as failed, so "Run All" stops there."""

    def __init__(self, message: str, entries=()):
        super().__init__(message)
        self.entries = list(entries)  # (ename, evalue, structured traceback lines)

    @classmethod
    def of(cls, ename: str, text: str, *more_lines) -> "CellError":
        """One error shown as `ename` in red, then `text` and any further lines. Its class is
        named `ename` too, so the kernel's execute reply names what the cell shows."""
        return _named(cls, ename)(text, [(ename, text, [header(ename), text, *more_lines])])

    def show(self, shell):
        for ename, evalue, stb in self.entries:
            shell._showtraceback(type(ename, (Exception,), {}), evalue, stb)


@functools.lru_cache(maxsize=None)
def _named(cls: type, ename: str) -> type:
    return cls if cls.__name__ == ename else type(ename, (cls,), {"__module__": cls.__module__})


def show_cell_errors(shell):
    """Has the shell show CellErrors by their entries; returns what to restore on unload."""
    previous = (shell.custom_exceptions, shell.CustomTB)
    prev_types, prev_handler = previous

    def handler(shell, etype, value, tb, tb_offset=None):
        if isinstance(value, CellError):
            value.show(shell)
            return []
        return prev_handler(etype, value, tb, tb_offset)

    shell.set_custom_exc(tuple(t for t in prev_types if t is not CellError) + (CellError,), handler)
    return previous


def restore_cell_errors(shell, previous):
    shell.custom_exceptions, shell.CustomTB = previous


def failure_entries(failures, collapse: bool = True) -> list:
    """One entry per distinct traceback, naming every rank that raised it (root cause first);
    collapse=False (%%dip --raw): one per rank."""
    entries = []
    for f, ranks in merge_failures(failures) if collapse else [(f, [f.rank]) for f in failures]:
        if f.died:
            body = [f"{f.ename}: {f.evalue}"]
            if f.stderr_tail:
                body.append("last lines of its stderr:\n" + f.stderr_tail.rstrip("\n"))
            body.append(DIED_NOTE)
        else:
            body = list(f.traceback) or [f"{f.ename}: {f.evalue}"]
        label = rank_label(ranks[0]) if len(ranks) == 1 else f"[{ranks_named(ranks)} (the same traceback on each)]"
        entries.append((f.ename, f.evalue, [header(label)] + body))
    return entries


def brief_entries(failures) -> list:
    """For push/pull: the message alone; the worker's own frames would only confuse."""
    return [(f.ename, f.evalue, [header(rank_label(f.rank)), f"{f.ename}: {f.evalue}"]) for f in failures]


def stuck_lines(results) -> list[str]:
    """Where each rank that did not stop when interrupted was."""
    lines = []
    for r in results or []:
        if r.stacks:
            lines += [header(f"{rank_label(r.rank)} did not stop; where it was:"), r.stacks.rstrip("\n")]
    return lines


# -- heal notes -----------------------------------------------------------------------------------

def heal_note(report):
    """What a heal did to the group, before the ranks' tracebacks."""
    print(report.describe(), file=sys.stderr, flush=True)


def healed(report) -> str:
    kept = "their variables are kept" if not report.replaced else "the surviving ranks' variables are kept"
    rebuilt = (f"torch.distributed's default group rebuilt on all {report.world_size} ranks (MASTER_PORT "
               f"{report.port})" if report.port is not None else "no torch.distributed to rebuild")
    return (f"healed in {report.seconds:.2f} s: {rebuilt}; {kept}"
            + (f"; rank(s) {', '.join(map(str, report.released))} were released from what they ran"
               if report.released else "")
            + (f".\n{report.replacement().strip().rstrip(';')}." if report.replaced else "")
            + (f"\n{report.redo().strip()}" if report.redo() else ""))


# After a rank died in a cell: the way on that keeps the other ranks' variables.
DIED_NOTE = ("%makedip --heal (g.heal()) replaces the dead rank, keeping the other ranks' variables "
             "(--copy-from 0: with a copy of rank 0's); %makedip -r restarts every rank")


# -- a %%dip cell's output --------------------------------------------------------------------------

class RankOutput:
    """Writes the shown ranks' output into the notebook live, a "[rank N]" line heading each run
    of one rank's output (none when one rank is shown). Lines that several ranks print alike come
    once, headed "[ranks 0-7]" (ddip.repeats), unless `collapse` is False (--raw). close() at the
    cell's end writes what is held."""

    def __init__(self, shown: list[int], collapse: bool = True):
        self.shown = set(shown)
        self.out = LabelledOutput(rank_label if len(shown) > 1 else None, headers=True)
        self.displays = RankDisplays()
        self.repeats = Repeats(self.out.headed, shown) if collapse and len(shown) > 1 else None

    def on_output(self, rank, stream_name, text):
        if rank in self.shown and text:
            (self.repeats or self.out.headed)(rank, stream_name, text)

    def close(self):
        if self.repeats is not None:
            self.repeats.close()

    def on_display(self, rank, msg):
        if rank not in self.shown:
            return
        if self.repeats is not None:
            self.repeats.flush()  # the text printed before the display comes first
        if msg.get("clear"):
            # The cell's output goes (now, or with wait=True when the next output comes), labels
            # with it: the next output is labelled again.
            self.out.forget()
        elif not msg.get("update"):  # an update redraws a display in place: nothing new to label
            self.out.headed(rank, "stdout")
        # Keep display output after the text printed before it.
        sys.stdout.flush()
        sys.stderr.flush()
        self.displays.show(rank, msg)


def show_value(rank: int, count, fmt):
    """The last expression's value as Out[RANK:N]; rich bundles keep every MIME type."""
    data, metadata = fmt
    label = f"Out[{rank}:{count}]:"
    sys.stdout.flush()
    sys.stderr.flush()
    if set(data) <= {"text/plain"}:
        text = data.get("text/plain", "")
        sep = "\n" if "\n" in text else " "  # as IPython does for multi-line reprs
        publish_display_data({"text/plain": f"{label}{sep}{text}"}, metadata)
    else:
        publish_display_data({"text/plain": label})
        publish_display_data(data, metadata)


# -- %dipstack ------------------------------------------------------------------------------------------

def print_stacks(stacks: dict):
    """%dipstack: the straggler, where one rank holds the others up; which collective each rank is
    in (when torch.distributed runs); then the stacks."""
    stragglers = getattr(stacks, "stragglers", None)
    if stragglers is not None and stragglers.straggler is not None:
        print(stragglers.headline)
    picture = getattr(stacks, "collectives", None)
    if picture is not None and picture.known:
        print(picture.describe())
    for rank, text in stacks.items():
        print(rank_label(rank))
        print(text.rstrip("\n"))


# -- %%diprun ---------------------------------------------------------------------------------------

class RunOutput:
    """`ddip run`'s labelled output ("[rank] " after every '\\n' and every '\\r' that text follows;
    every piece it writes ends in one of them), written to the notebook by a LabelledOutput: ranks'
    redrawn bars take turns in place instead of overwriting each other's text.

    With `on_prompt`, a rank waiting at a debugger prompt (a line of stdout that is `ddip run
    --prompt-records`' record, "\\x1eddip prompt RANK OUTPUT PROMPT") is handed to
    on_prompt(rank, prompt) instead of being shown; what the debugger printed comes before it as
    the rank's text."""

    _TAG = re.compile(r"\[(\d+)\] ")
    _PROMPT = re.compile(r"\x1eddip prompt (\d+) (\S+) (\S+)\r?\n?")
    _UNESCAPE = re.compile(r"\\(.)")

    def __init__(self, on_prompt=None):
        self.on_prompt = on_prompt
        self.out = LabelledOutput()
        self.partial = {"stdout": "", "stderr": ""}  # a read can end inside a piece
        self.last = {"stdout": None, "stderr": None}  # whose text came last, per stream

    def write(self, stream: str, text: str, final: bool = False):
        text = self.partial[stream] + text
        cut = len(text) if final else max(text.rfind("\n"), text.rfind("\r")) + 1
        self.partial[stream] = text[cut:]
        for body, end in pieces(text[:cut]):
            piece = body + end
            record = self._PROMPT.fullmatch(piece) if stream == "stdout" and self.on_prompt else None
            if record:
                self.on_prompt(int(record.group(1)), self._text(record.group(3)))
                continue
            tag = self._TAG.match(piece)
            if tag:
                rank, piece = int(tag.group(1)), piece[tag.end():]
            elif piece.strip("\r\n"):
                rank = None  # ddip run's own message
            else:
                rank = self.last[stream]  # "\r" or the "\n" of "\r\n": the last writer's
            self.last[stream] = rank
            label = "" if rank is None else f"[{rank}] "
            self.out.write((rank, stream), label, stream, piece)

    @classmethod
    def _text(cls, field: str) -> str:
        """A record's text field, escaped as cpp/tools/run_protocol.hpp says."""
        if field == "\\e":
            return ""
        return cls._UNESCAPE.sub(lambda m: {"\\": "\\", "s": " ", "n": "\n", "r": "\r"}.get(m.group(1), m.group(0)),
                                 field)
