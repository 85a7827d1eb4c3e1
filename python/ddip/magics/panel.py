"""The rank panel: %dipstatus shows every rank at a glance, live where widgets render
(kernel/panel_view.py draws it; kernel/panel.py takes its samples), the table elsewhere."""

from __future__ import annotations

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import magic_arguments

from ..kernel import panel_view
from .flags import parse
from .session import Session


@magics_class
class PanelMagics(Magics):
    """%dipstatus."""

    def __init__(self, shell, session: Session):
        super().__init__(shell)
        self.session = session

    @magic_arguments()  # no flags; the parser makes `%dipstatus x` a UsageError as every magic's
    @line_magic
    def dipstatus(self, line=""):
        """A table of the ranks: pid, device, state (idle, busy, dead, or unresponsive: no heartbeat
        for 10 s), how long a busy rank has been busy, memory, heartbeat age, and each rank's GPU in
        a GPU group. In JupyterLab (ipywidgets: the notebook extra) a live panel instead, updated
        about once a second while cells run: per rank what it does (running cell N for T s, at a
        debugger prompt, waiting in collective all_reduce #7 for T s, dead with its cause,
        replaced by heal), CPU %, memory, GPU use and the last line it printed; the straggler
        named."""
        parse(self.dipstatus, line)
        group = self.session.running_group()
        panel_view.show(group, group.status())
