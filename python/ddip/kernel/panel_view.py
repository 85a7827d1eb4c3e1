"""The live rank panel: kernel/panel.py's samples drawn with ipywidgets (the `notebook` extra),
redrawn from a thread of its own about once a second while a rank is busy (every IDLE_EVERY_S
while all are idle, so a death still shows). The thread only reads (Sampler) and sets widget
values: the comm messages that carry them go out on ipykernel's IOPub thread (ipykernel >= 6), so
the kernel is never blocked and a running cell's output goes on around it. One live panel per
group: a newer one stops the older; closing the widget, its stop button, or the group's close
stop it too.

Where widgets can't render (a terminal, nbconvert, ipywidgets not installed) what is shown is the
text table (panel.status_table), the display's text/plain and text/html beside the widget's view."""

from __future__ import annotations

import html
import threading
import time
import weakref

from IPython.display import publish_display_data

from ..errors import GroupClosedError
from .panel import PanelData, Sampler, rows_html, status_table

EVERY_S = 1.0  # between samples while a rank is busy
IDLE_EVERY_S = 3.0  # ... while every rank is idle
_live: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> its live panel
_STYLE = """<style>
.ddip-panel td, .ddip-panel th { padding: 1px 8px; text-align: left; white-space: nowrap; }
.ddip-panel td:nth-child(4) { white-space: normal; min-width: 14em; max-width: 28em; }
.ddip-panel td:last-child { font-family: monospace; max-width: 30em; overflow: hidden; text-overflow: ellipsis; }
.ddip-panel .ddip-dead td, .ddip-panel .ddip-unresponsive td { color: #c62828; }
.ddip-panel .ddip-busy td { color: #1565c0; }
.ddip-panel .ddip-straggler td { background: #fff3e0; font-weight: bold; }
.ddip-straggler-line { color: #e65100; font-weight: bold; }
</style>"""


def widgets_render() -> bool:
    """Whether a widget can be shown here: inside a Jupyter kernel, with ipywidgets installed."""
    try:
        from IPython import get_ipython

        if getattr(get_ipython(), "kernel", None) is None:
            return False
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def show(group, rows: list[dict]):
    """Displays `rows` (Group.status()' of `group`): the live panel where widgets render, with the
    table as its text/plain and text/html; the table alone elsewhere."""
    text, markup = status_table(rows, gpus=group is not None and group.gpus is not None)
    bundle = {"text/plain": text, "text/html": markup}
    if group is not None and not group.closed and widgets_render():
        panel = LivePanel(group)
        bundle["application/vnd.jupyter.widget-view+json"] = {"version_major": 2, "version_minor": 0,
                                                              "model_id": panel.box.model_id}
        publish_display_data(bundle)
        panel.start()
        return
    publish_display_data(bundle)


def _cell_number() -> int | None:
    """The notebook's cell running now (In[N]): the one a run the panel first sees started in. The
    history has it from the cell's start (IPython's execution_count moves on at the start in some
    versions, at the end in others)."""
    from IPython import get_ipython

    history = getattr(get_ipython(), "history_manager", None)
    return len(history.input_hist_raw) - 1 if history is not None else None


class PanelView:
    """The panel's widgets (`box`): a title with a stop button, the straggler's line, and the rows,
    as one table or, from panel.HOSTS_FROM hosts on, an Accordion of hosts, each opening to its
    ranks. draw() shows a sample; stopped() says why it no longer changes."""

    def __init__(self, on_stop=None):
        import ipywidgets as w

        self.title = w.HTML()
        self.straggler = w.HTML()
        self.table = w.HTML()
        self.hosts = w.Accordion()
        self.stop_button = w.Button(description="stop updating", layout=w.Layout(width="auto"))
        if on_stop is not None:
            self.stop_button.on_click(lambda _: on_stop())
        self.body = w.VBox([self.table])
        self.box = w.VBox([w.HTML(_STYLE), w.HBox([self.title, self.stop_button]), self.straggler, self.body])
        self.box.add_class("ddip-rank-panel")

    def draw(self, data: PanelData):
        import ipywidgets as w

        busy = sum(r.state == "busy" for r in data.rows)
        dead = sum(r.state == "dead" for r in data.rows)
        self.title.value = (f"<b>ranks</b>: {len(data.rows)}, {busy} busy" + (f", {dead} dead" if dead else "")
                            + f" <small>(live; {time.strftime('%H:%M:%S', time.localtime(data.taken))})</small>")
        self.straggler.value = (f'<span class="ddip-straggler-line">{html.escape(data.straggler)}</span>'
                                if data.straggler else "")
        if data.hosts is None:
            self.table.value = rows_html(data.rows)
            if self.body.children != (self.table,):
                self.body.children = (self.table,)
            return
        if len(self.hosts.children) != len(data.hosts):
            self.hosts.children = tuple(w.HTML() for _ in data.hosts)
        for child, host in zip(self.hosts.children, data.hosts):
            child.value = rows_html(host.ranks)
        self.hosts.titles = tuple(h.summary for h in data.hosts)
        if self.body.children != (self.hosts,):
            self.body.children = (self.hosts,)

    def stopped(self, why: str):
        self.title.value = f"<b>ranks</b> ({html.escape(why)})"
        self.stop_button.layout.display = "none"


class LivePanel:
    """A PanelView of one group and the thread that redraws it."""

    def __init__(self, group):
        self.group = weakref.ref(group)
        self.sampler = Sampler(group, cell_number=_cell_number)
        self.view = PanelView(on_stop=lambda: self.stop("stopped"))
        self.box = self.view.box
        self._lock = threading.Lock()  # a draw and a stop, one at a time: once stopped, no draw
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddip-rank-panel", daemon=True)
        self.view.draw(self.sampler.sample())

    def start(self):
        older = _live.get(self.group())
        if older is not None:
            older.stop("stopped: a newer panel of this group shows it live")
        _live[self.group()] = self
        self._thread.start()

    def stop(self, why: str):
        with self._lock:
            self._stopped.set()
            self.view.stopped(why)

    def _run(self):
        every = EVERY_S
        while not self._stopped.wait(every):
            if self.box.comm is None:  # the widget was closed
                return
            group = self.group()
            if group is None or group.closed:
                self.stop("the group is closed")
                return
            try:
                data = self.sampler.sample()
            except GroupClosedError:
                self.stop("the group is closed")
                return
            except Exception as exc:  # noqa: BLE001 - a panel that can't sample says why and stops
                self.stop(f"stopped: {type(exc).__name__}: {exc}")
                return
            with self._lock:
                if self._stopped.is_set():
                    return
                self.view.draw(data)
            every = EVERY_S if data.busy else IDLE_EVERY_S


class RankStatus(list):
    """Group.status(): a list of per-rank dicts; shown as a cell's value it is the live rank panel
    where widgets render, the table elsewhere. (Here, beside show(), so that kernel/panel.py, the
    data, never imports its drawing.)"""

    def __init__(self, rows: list[dict], group=None):
        super().__init__(rows)
        self._group = weakref.ref(group) if group is not None else lambda: None

    def _ipython_display_(self):
        show(self._group(), self)
