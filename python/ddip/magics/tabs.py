"""%%dip --tabs: each rank's output in a tab of its own (an ipywidgets Tab of Output widgets, rank
0's in front): its streams, its rich displays and, when it fails, its traceback. The cell's value
and its error are shown below, as without --tabs."""

from __future__ import annotations

import sys

from ..kernel.displays import RankDisplays
from ..labels import rank_label
from .render import RankOutput, failure_entries

NO_WIDGETS = ("ddip: --tabs needs a Jupyter kernel with ipywidgets (pip install ipywidgets, or "
              "ddip[notebook]); the ranks' output is shown labelled instead\n")


def tabbed(shown: list[int], collapse: bool = True):
    """The output of %%dip --tabs: RankTabs where widgets render, else labelled output (saying so)."""
    from ..kernel.panel_view import widgets_render

    if widgets_render():
        return RankTabs(shown)
    sys.stderr.write(NO_WIDGETS)
    return RankOutput(shown, collapse)


class RankTabs:
    """render.RankOutput's interface (shown, on_output, on_display, close), a tab per shown rank.
    Output goes into a tab's Output widget the way `with out:` puts it there: the frontend takes
    the cell's outputs into the widget that captures now. A rank's run of output keeps its tab
    capturing; another rank's output switches it (the text written so far flushed first)."""

    def __init__(self, shown: list[int]):
        import ipywidgets as w
        from IPython.display import publish_display_data

        self.shown = set(shown)
        self.outputs = {r: w.Output() for r in sorted(shown)}
        self.tab = w.Tab(children=list(self.outputs.values()), titles=[rank_label(r)[1:-1] for r in self.outputs])
        self.tab.selected_index = 0
        self.tab.add_class("ddip-rank-tabs")
        self.displays = RankDisplays()
        self.current: int | None = None
        # Where widgets don't render (nbconvert), the note says what was there.
        publish_display_data({"text/plain": f"[%%dip --tabs: {', '.join(self.tab.titles)}: each rank's output in "
                                            f"a tab of its own (a widget)]",
                              "application/vnd.jupyter.widget-view+json": {
                                  "version_major": 2, "version_minor": 0, "model_id": self.tab.model_id}})

    def on_output(self, rank, stream_name, text):
        if rank in self.shown and text:
            self._into(rank)
            (sys.stdout if stream_name == "stdout" else sys.stderr).write(text)

    def on_display(self, rank, msg):
        if rank in self.shown:
            self._into(rank)
            self.displays.show(rank, msg)

    def show_failures(self, failures):
        """Each shown rank's traceback (or death) in its own tab, its title saying so."""
        titles = list(self.tab.titles)
        for f in failures:
            if f.rank not in self.shown:
                continue
            self._into(f.rank)
            [(_, _, lines)] = failure_entries([f], collapse=False)
            sys.stderr.write("\n".join(lines[1:]) + "\n")
            titles[list(self.outputs).index(f.rank)] += " (died)" if f.died else f" ({f.ename})"
        self.close()
        self.tab.titles = tuple(titles)

    def close(self):
        self._into(None)

    def _into(self, rank: int | None):
        if rank == self.current:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        if self.current is not None:
            self.outputs[self.current].__exit__(None, None, None)
        self.current = rank
        if rank is not None:
            self.outputs[rank].__enter__()
