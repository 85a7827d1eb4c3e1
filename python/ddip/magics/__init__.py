"""IPython magics: one Magics class per area, registered together by `%load_ext ddip`.

    %load_ext ddip
    %makedip -n 3
    %%dip --see all
    import os; print(os.environ["RANK"])

- lifecycle.DipMagics: the group's life (%makedip) and its ranks' stacks (%dipstack)
- panel.PanelMagics: the rank panel (%dipstatus)
- cells.CellMagics: running cells (%%dip, %autodip)
- data.DataMagics: moving data (%dipush, %dipull)
- run.DipRunMagics: %%diprun, a cell as a script under `ddip run`
- debug.DebugMagics: pdb in a rank (%dipdebug, %dippdb)
- session.Session: the state the first three share (the group, its spec, %autodip)
- flags: shared flag groups and checks; render: everything the magics show

Rank output is written to the notebook as it arrives; values, display() calls and tracebacks
become the notebook's own display/error outputs.
"""

from __future__ import annotations

from ..kernel import dap as _dap
from ..kernel import template as _template
from . import render
from .cells import CellMagics
from .data import DataMagics
from .debug import DebugMagics
from .lifecycle import DipMagics
from .panel import PanelMagics
from .run import DipRunError, DipRunMagics
from .session import Session

__all__ = ["CellMagics", "DataMagics", "DebugMagics", "DipMagics", "DipRunError", "DipRunMagics", "PanelMagics",
           "Session",
           "load_ipython_extension", "unload_ipython_extension"]

_loaded: dict = {}  # for the shell it is loaded in: its Session, its Magics, what to restore on unload


def load_ipython_extension(ip):
    if _loaded.get("shell") is ip:
        return
    session = Session(ip)
    debug = DebugMagics(ip, session)
    magics = [DipMagics(ip, session), PanelMagics(ip, session), CellMagics(ip, session), DataMagics(ip, session),
              DipRunMagics(ip), debug]
    for m in magics:
        ip.register_magics(m)
    ip.events.register("post_run_cell", debug.after_cell)  # %dippdb
    _loaded.update(shell=ip, session=session, magics=magics, exc=render.show_cell_errors(ip),
                   after_cell=debug.after_cell)
    _dap.install(ip)  # JupyterLab's visual debugger reaches the ranks of %%dip cells
    _template.prewarm()  # in the background: the first %makedip forks its ranks from it


def unload_ipython_extension(ip):
    if _loaded.get("shell") is not ip:
        return
    _loaded["session"].close()
    _dap.uninstall(ip)
    ip.events.unregister("post_run_cell", _loaded["after_cell"])
    render.restore_cell_errors(ip, _loaded["exc"])
    for m in _loaded["magics"]:
        for kind, names in m.magics.items():
            for name in names:
                ip.magics_manager.magics[kind].pop(name, None)
    _loaded.clear()
