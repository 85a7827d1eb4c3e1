"""%%dip --tabs: each rank's output in a tab of its own (an ipywidgets Tab of Output widgets, rank
0's in front): its streams, its rich displays and, when it fails, its traceback. The cell's value
and its error are shown below, as without --tabs."""

from __future__ import annotations

import sys

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


class _Pane:
    """One rank's tab: Output widgets in a column. Text and displays go into the last one; a
    display that can be updated in place (it has a display id) gets an Output of its own, which
    its updates redraw, so updates work inside a tab as in a cell (tqdm's bar, a display handle)."""

    def __init__(self):
        import ipywidgets as w

        self.box = w.VBox([w.Output()])
        self.by_id: dict = {}  # display id -> the Output holding that display

    @property
    def current(self):
        return self.box.children[-1]

    def add_updatable(self, display_id):
        import ipywidgets as w

        held, after = w.Output(), w.Output()
        self.by_id[display_id] = held
        self.box.children = self.box.children + (held, after)
        return held

    def clear(self):
        import ipywidgets as w

        self.by_id.clear()
        self.box.children = (w.Output(),)


class RankTabs:
    """render.RankOutput's interface (shown, on_output, on_display, close), a tab per shown rank.
    Output goes into a tab's Output widget the way `with out:` puts it there: the frontend takes
    the cell's outputs into the widget that captures now. A rank's run of output keeps its tab
    capturing; another rank's output switches it (the text written so far flushed first)."""

    def __init__(self, shown: list[int]):
        import ipywidgets as w
        from IPython.display import publish_display_data

        self.shown = set(shown)
        self.panes = {r: _Pane() for r in sorted(shown)}
        self.tab = w.Tab(children=[p.box for p in self.panes.values()],
                         titles=[rank_label(r)[1:-1] for r in self.panes])
        self.tab.selected_index = 0
        self.tab.add_class("ddip-rank-tabs")
        self.capturing = None  # the Output that captures the cell's output now
        # Where widgets don't render (nbconvert), the note says what was there.
        publish_display_data({"text/plain": f"[%%dip --tabs: {', '.join(self.tab.titles)}: each rank's output in "
                                            f"a tab of its own (a widget)]",
                              "application/vnd.jupyter.widget-view+json": {
                                  "version_major": 2, "version_minor": 0, "model_id": self.tab.model_id}})

    def on_output(self, rank, stream_name, text):
        if rank in self.shown and text:
            self._into(self.panes[rank].current)
            (sys.stdout if stream_name == "stdout" else sys.stderr).write(text)

    def on_display(self, rank, msg):
        from IPython.display import clear_output, publish_display_data

        if rank not in self.shown:
            return
        pane = self.panes[rank]
        display_id = (msg.get("transient") or {}).get("display_id")
        if msg.get("clear"):
            self._into(None)
            pane.clear()
            return
        if msg.get("update"):
            held = pane.by_id.get(display_id)
            if held is None:
                return  # as in a cell: an update of a display never shown draws nothing
            self._into(held)
            clear_output(wait=True)
        elif display_id is not None:
            self._into(None)
            self._into(pane.add_updatable(display_id))
        else:
            self._into(pane.current)
        publish_display_data(msg["data"], msg.get("metadata") or {})

    def show_failures(self, failures):
        """Each shown rank's traceback (or death) in its own tab, its title saying so."""
        titles = list(self.tab.titles)
        for f in failures:
            if f.rank not in self.shown:
                continue
            self._into(self.panes[f.rank].current)
            [(_, _, lines)] = failure_entries([f], collapse=False)
            sys.stderr.write("\n".join(lines[1:]) + "\n")
            titles[list(self.panes).index(f.rank)] += " (died)" if f.died else f" ({f.ename})"
        self.close()
        self.tab.titles = tuple(titles)

    def close(self):
        self._into(None)

    def _into(self, out):
        if out is self.capturing:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        if self.capturing is not None:
            self.capturing.__exit__(None, None, None)
        self.capturing = out
        if out is not None:
            out.__enter__()
