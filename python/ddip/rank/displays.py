"""Rich output from ranks, the rank's side: display frames with redraws coalesced, and progress
bars in the notebook's form (the kernel's side, which shows the frames, is ddip.kernel.displays).

In a rank, `display()`, `handle.update()` and `clear_output()` become display frames to the
kernel (worker.RankDisplayPublisher). A progress bar may redraw its display thousands of times a
second; `DisplayFrames` sends at most one update per display id every UPDATE_INTERVAL_S (the
newest; the ones in between are dropped) and always the last one before the cell's reply.

A rank runs a plain IPython InteractiveShell, so progress-bar libraries that ask "am I in a
notebook?" hear no and draw text. When the group belongs to a notebook (the kernel sets
DDIP_NOTEBOOK=1 in the ranks' environment), `install_notebook_progress()` gives them their
notebook form, drawn with display updates: fastprogress (fastai's bars) through its own
notebook classes, and tqdm.notebook / tqdm.auto as an HTML bar. Widgets (tqdm's usual notebook
bar) are not used: a widget is a model living in the kernel that talks to the browser over a
comm channel, and a rank has no such channel; a display update needs none and survives saving
the notebook.
"""

from __future__ import annotations

import html
import importlib.abc
import os
import sys
import threading
import time
import weakref
from typing import Callable

UPDATE_INTERVAL_S = 0.1  # at most ~10 redraws a second reach the notebook per display id
NOTEBOOK_ENV = "DDIP_NOTEBOOK"  # set by the kernel (ddip.kernel.displays.notebook_env)


# -- in a rank: display frames ----------------------------------------------------------------------


class DisplayFrames:
    """Sends display messages through `send(msg)` in order, coalescing updates of one display id.

    An update goes at once when its id's last one went UPDATE_INTERVAL_S ago or more; otherwise
    it waits (replacing any older one waiting for that id) and a thread sends it when its time
    comes. Anything else (a new display, clear_output) first sends the updates waiting, so the
    notebook sees every operation in the order the rank made it. flush() before the cell's
    reply sends whatever still waits: the final state is always shown."""

    def __init__(self, send: Callable[[dict], None], interval: float = UPDATE_INTERVAL_S):
        self._send = send
        self._interval = interval
        self._cond = threading.Condition()
        self._waiting: dict[str, dict] = {}  # display id -> its newest update, oldest id first
        self._last: dict[str, float] = {}  # display id -> when its last update was sent
        self._thread: threading.Thread | None = None
        # A process forked from a rank (a DataLoader worker) has no thread of ours and may have
        # a copy of the lock held by it: it starts afresh.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: ref() is not None and ref()._after_fork())

    def _after_fork(self):
        self._cond = threading.Condition()
        self._waiting, self._last, self._thread = {}, {}, None

    def publish(self, msg: dict) -> None:
        display_id = (msg.get("transient") or {}).get("display_id") if msg.get("update") else None
        with self._cond:
            if display_id is None:
                self._flush_locked()
                self._send(msg)
                return
            now = time.monotonic()
            last = self._last.get(display_id)
            if display_id not in self._waiting and (last is None or now - last >= self._interval):
                self._last[display_id] = now
                self._send(msg)
                return
            self._waiting[display_id] = msg
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ddip-display-updates", daemon=True)
                self._thread.start()
            self._cond.notify()

    def flush(self, forget: bool = False) -> None:
        """Sends every waiting update now; forget=True also forgets when ids were last updated
        (the cell is over: the next cell's first redraw goes at once)."""
        if not self._waiting and not self._last:
            return  # the usual reply: no display updated (a racing update is the thread's, as with the lock)
        with self._cond:
            self._flush_locked()
            if forget:
                self._last.clear()

    def _flush_locked(self):
        if not self._waiting:
            return
        waiting, self._waiting = self._waiting, {}
        now = time.monotonic()
        for display_id, msg in waiting.items():
            self._last[display_id] = now
            self._send(msg)

    def _run(self):
        with self._cond:
            while True:
                if not self._waiting:
                    self._cond.wait()
                    continue
                now = time.monotonic()
                due = [d for d in self._waiting if now - self._last.get(d, 0.0) >= self._interval]
                for display_id in due:
                    msg = self._waiting.pop(display_id)
                    self._last[display_id] = now
                    try:
                        self._send(msg)
                    except Exception:  # the kernel is gone: the worker ends by itself
                        pass
                if self._waiting:
                    nxt = min(self._last.get(d, 0.0) for d in self._waiting) + self._interval
                    self._cond.wait(max(0.0, nxt - time.monotonic()))


# -- in a rank: progress bars in notebook form ------------------------------------------------------


class _PatchingLoader(importlib.abc.Loader):
    """Runs a module's own loader, then patch(module); the module keeps its own loader."""

    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _apply(self._patch, module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _apply(patch, module):
    try:
        patch(module)
    except Exception as exc:  # a library changed under us: keep its own behaviour, say why
        print(f"ddip: {module.__name__} keeps its text form in this rank; its notebook form could "
              f"not be set up ({type(exc).__name__}: {exc})", file=sys.stderr)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """A post-import hook: patches[name](module) runs right after module `name` is executed, so
    names imported from it (`from tqdm.auto import tqdm`) are already the patched ones."""

    def __init__(self, patches: dict):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def _fastprogress_notebook(mod):
    """fastprogress decides once, at import, from the shell's class name (ZMQInteractiveShell or
    not); its notebook classes draw with display(HTML, display_id=True) and handle.update(),
    which work in a rank. This is its own switch, turned the other way from
    force_console_behavior(): the module-level names fastai imports, and what the notebook
    branch would have imported."""
    from IPython.display import HTML, clear_output, display

    mod.HTML, mod.clear_output, mod.display = HTML, clear_output, display
    if not hasattr(mod, "plt"):
        mod.plt = _LazyPyplot()  # only graphs (ShowGraphCallback) use it
    mod.IN_NOTEBOOK = True  # printing() asks this
    console = {mod.ConsoleMasterBar: mod.NBMasterBar, mod.ConsoleProgressBar: mod.NBProgressBar}
    # Modules that imported the console classes already (fastai, preloaded by a rank template).
    for other in sys.modules.copy().values():  # copied at once: another thread may be importing
        for name in ("master_bar", "progress_bar"):
            try:
                value = getattr(other, name, None)
                if value in console:
                    setattr(other, name, console[value])
            except Exception:  # an odd module object: not ours to fix
                pass


class _LazyPyplot:
    def __getattr__(self, name):
        import matplotlib.pyplot as plt

        return getattr(plt, name)


def _tqdm_notebook(mod):
    bar = _rank_tqdm_class(mod.tqdm_notebook)
    mod.tqdm = mod.tqdm_notebook = bar
    mod.trange = mod.tnrange = lambda *args, **kwargs: bar(range(*args), **kwargs)


def _tqdm_autonotebook(mod):
    # It chose tqdm.std (no ipykernel here); the notebook's choice is tqdm.notebook.
    import tqdm.notebook as nb

    mod.tqdm, mod.trange = nb.tqdm, nb.trange


def _lightning_tqdm(mod):
    """Lightning's TQDMProgressBar draws `Tqdm`, built on tqdm.auto only when ipywidgets is
    installed (else on text tqdm): in a notebook's rank it is built on the notebook bar."""
    import tqdm.notebook as nb  # the rank's HTML bar (patched on import)

    if issubclass(mod.Tqdm, nb.tqdm):
        return  # ipywidgets is installed: tqdm.auto gave it the notebook bar already
    old = mod.Tqdm
    bar = type(old.__name__, (nb.tqdm,), {"format_num": staticmethod(old.format_num),
                                          "__module__": old.__module__, "__doc__": old.__doc__})
    bar.__qualname__ = old.__qualname__
    mod.Tqdm = bar


def _transformers_trainer(mod):
    """transformers' Trainer takes NotebookProgressCallback when is_in_notebook() said so at
    import (it asks for an IPKernelApp): in a notebook's rank it takes it too, drawn by the main
    process only, as its text ProgressCallback is."""
    if mod.DEFAULT_PROGRESS_CALLBACK is not mod.ProgressCallback:
        return  # the user chose, or transformers changed its default
    from transformers.utils.notebook import NotebookProgressCallback

    def main_process_only(hook):
        def on_event(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                return hook(self, args, state, control, **kwargs)

        return on_event

    hooks = {name: main_process_only(fn) for name, fn in vars(NotebookProgressCallback).items()
             if name.startswith("on_") and callable(fn)}
    if not hooks:
        raise RuntimeError("NotebookProgressCallback has no on_* hooks")
    mod.DEFAULT_PROGRESS_CALLBACK = type("NotebookProgressCallback", (NotebookProgressCallback,),
                                         {**hooks, "__module__": NotebookProgressCallback.__module__})


# -- rich ---------------------------------------------------------------------------------------------
# Rich asks console._is_jupyter() (ZMQInteractiveShell or not) when a Console is made; in Jupyter
# it prints renderables as HTML displays and draws a Live (Progress, Lightning's RichProgressBar)
# into an ipywidgets Output. A rank has no comm channel for a widget: its Live draws into one
# display updated in place instead.


def _rich_console(mod):
    original = mod._is_jupyter
    if "_is_jupyter" not in mod.Console.__init__.__code__.co_names:
        raise RuntimeError("rich.console.Console no longer asks _is_jupyter()")

    def _is_jupyter() -> bool:  # a notebook's rank renders as the notebook would
        return True

    _is_jupyter.ddip_original = original
    mod._is_jupyter = _is_jupyter


def _rich_jupyter(mod):
    """rich.jupyter.display(segments, text): the text/plain form without ANSI codes."""
    original = mod.display

    def display(segments, text):
        segments = list(segments)
        if not segments:
            return None  # a Console leaving `with console:` with nothing printed: no empty output
        return original(segments, _rich_plain(segments))

    mod.display = display


def _rich_plain(segments) -> str:
    return "".join(seg.text for seg in segments if not seg.control)


def _rich_live(mod):
    try:
        from rich.jupyter import _render_segments

        Live = mod.Live
        if not {"_lock", "_live_render", "_nested", "ipy_widget"} <= set(Live.__init__.__code__.co_names):
            raise RuntimeError("rich.live.Live changed: no _lock/_live_render/_nested/ipy_widget")
        refresh, stop = Live.refresh, Live.stop
    except Exception:
        # Without a Live that draws, Jupyter mode would show nothing: rich keeps its text mode.
        console = sys.modules.get("rich.console")
        original = getattr(getattr(console, "_is_jupyter", None), "ddip_original", None)
        if original is not None:
            console._is_jupyter = original
        raise

    def _draw(live):
        if live.ipy_widget is None:
            live.ipy_widget = _LiveDisplay()
        segments = list(live.console.render(live._live_render.renderable, live.console.options))
        live.ipy_widget.show({"text/plain": _rich_plain(segments), "text/html": _render_segments(segments)})

    def ddip_refresh(self):
        if not self.console.is_jupyter or self._nested:
            return refresh(self)
        with self._lock:
            self._live_render.set_renderable(self.renderable)
            _draw(self)

    def ddip_stop(self):
        # Rich in Jupyter leaves the last auto-refresh on screen; the final state is drawn here.
        final = self.console.is_jupyter and self._started and not self._nested and not self.transient
        stop(self)
        if final:
            with self._lock:
                self._live_render.set_renderable(self.renderable)
                _draw(self)

    ddip_refresh.__doc__, ddip_stop.__doc__ = refresh.__doc__, stop.__doc__
    Live.refresh, Live.stop = ddip_refresh, ddip_stop


class _LiveDisplay:
    """Stands where rich.live keeps its ipywidgets Output: one display, updated in place (rich
    closes it when a transient Live stops)."""

    def __init__(self):
        self.handle = None

    def show(self, bundle: dict):
        if self.handle is None:
            from IPython.display import display

            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)

    def close(self):
        if self.handle is not None:
            self.handle.update({"text/plain": "", "text/html": ""}, raw=True)


_PATCHES = {
    "fastprogress.fastprogress": _fastprogress_notebook,
    "tqdm.notebook": _tqdm_notebook,
    "tqdm.autonotebook": _tqdm_autonotebook,
    "lightning.pytorch.callbacks.progress.tqdm_progress": _lightning_tqdm,
    "pytorch_lightning.callbacks.progress.tqdm_progress": _lightning_tqdm,
    "transformers.trainer": _transformers_trainer,
    "rich.console": _rich_console,  # before rich.live, which undoes it if it can't draw
    "rich.jupyter": _rich_jupyter,
    "rich.live": _rich_live,
}
_installed: _PatchOnImport | None = None


def install_notebook_progress() -> bool:
    """In a rank of a notebook's group: progress bars imported from now on take their notebook
    form. Modules imported already are patched now (names bound from them earlier stay as they
    were). Returns whether it was installed (only with DDIP_NOTEBOOK=1)."""
    global _installed
    if os.environ.get(NOTEBOOK_ENV) != "1":
        return False
    if _installed is None:
        _installed = _PatchOnImport(_PATCHES)
        sys.meta_path.insert(0, _installed)
        for name, patch in _PATCHES.items():
            if name in sys.modules:
                _apply(patch, sys.modules[name])
    return True


_BAR_COLOURS = {"success": "#5cb85c", "danger": "#d9534f", "info": "#5bc0de"}


class _HTMLBar:
    """Stands where tqdm.notebook keeps its widget (`container`): the bar's state, drawn as HTML
    into one display that is updated in place."""

    def __init__(self, total=None, desc=None, ncols=None):
        self.total, self.n = total, 0
        self.left, self.right = (desc or ""), ""
        self.bar_style, self.colour, self.hidden = "", None, False
        self.width = ncols
        self.handle = None
        self.pbar = None

    def _ipython_display_(self):
        from IPython.display import display

        self.handle = display(self._bundle(), raw=True, display_id=True)

    def draw(self):
        if self.handle is not None:
            self.handle.update(self._bundle(), raw=True)

    def _bundle(self):
        if self.hidden:
            return {"text/plain": "", "text/html": ""}
        colour = self.colour or _BAR_COLOURS.get(self.bar_style)
        accent = f"accent-color:{colour};" if colour else ""
        value = f" value='{self.n}'" if self.total else ""
        maximum = self.total if self.total else 1
        if not self.total:
            value = " value='1'"
        width = self.width or "300px"
        if isinstance(width, int) or str(width).isdigit():
            width = f"{width}px"
        markup = (f"<div class='ddip-progress' data-bar-style='{self.bar_style}' "
                  f"style='display:flex;align-items:center;gap:0.5em'>"
                  f"<span>{self.left}</span>"
                  f"<progress{value} max='{maximum}' style='width:{html.escape(str(width))};"
                  f"height:20px;{accent}'></progress><span>{self.right}</span></div>")
        plain = self.pbar.__str__() if self.pbar is not None else f"{self.left} {self.right}"
        return {"text/plain": plain, "text/html": markup}


def _rank_tqdm_class(tqdm_notebook):
    """tqdm.notebook's bar with `_HTMLBar` in place of its widgets: same arguments, same
    behaviour (danger style on errors, leave=False hides it, reset, delay)."""

    class tqdm_rank(tqdm_notebook):
        """tqdm.notebook's bar in a ddip rank: HTML redrawn through display updates."""

        @staticmethod
        def status_printer(_, total=None, desc=None, ncols=None):
            return _HTMLBar(total, html.escape(desc) if desc else desc, ncols)

        def display(self, msg=None, pos=None, close=False, bar_style=None, check_delay=True):
            bar = self.container
            if not msg and not close:
                d = self.format_dict
                d["bar_format"] = (d["bar_format"] or "{l_bar}<bar/>{r_bar}").replace("{bar}", "<bar/>")
                msg = self.format_meter(**d)
            bar.n, bar.total = self.n, self.total  # Lightning sets .total after reset()
            if msg:
                msg = msg.replace(" ", "\u2007")  # keeps the text's columns in HTML
                if "<bar/>" in msg:
                    import re

                    left, right = (html.escape(s) for s in re.split(r"\|?<bar/>\|?", msg, maxsplit=1))
                else:
                    left, right = "", html.escape(msg)
                bar.left = left
                if right:
                    bar.right = right
            if bar_style and (bar.bar_style != "danger" or bar_style != "success"):
                bar.bar_style = bar_style
            if close and bar.bar_style != "danger":
                bar.hidden = True
            if check_delay and self.delay > 0 and not self.displayed:
                bar._ipython_display_()
                self.displayed = True
            bar.draw()

        @property
        def colour(self):
            return getattr(getattr(self, "container", None), "colour", None)

        @colour.setter
        def colour(self, value):
            if hasattr(self, "container"):
                self.container.colour = value

        def reset(self, total=None):
            if self.disable:
                return super(tqdm_notebook, self).reset(total=total)
            self.container.bar_style = ""
            if total is not None:
                self.container.total = total
            return super(tqdm_notebook, self).reset(total=total)

    tqdm_rank.__module__ = tqdm_notebook.__module__
    return tqdm_rank
