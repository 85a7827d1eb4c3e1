"""A rank's half of JupyterLab's visual debugger: debugpy in the rank, and cells compiled under
the name JupyterLab sets its breakpoints on.

Nothing here runs until the kernel asks (the debugger was switched on in JupyterLab and a %%dip
cell is about to run), so a rank that is never debugged never imports debugpy. `listen()`
starts debugpy's debugger in this process, speaking the Debug Adapter Protocol itself on a port
of 127.0.0.1 (its in-process adapter: no adapter process that could outlive the rank); the
kernel connects to it (ddip/kernel/dap.py). `cell_named()` compiles a cell's code as the file
ipykernel's dumpCell wrote for the whole cell, its lines where the cell's gutter shows them.
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import sys
import threading

_port: int | None = None


def listen() -> int:
    """Starts debugpy in this rank (once) and returns the port of 127.0.0.1 it listens on."""
    global _port
    if _port is None:
        # The rank's own threads (collectives, displays) run on while its code is stopped
        # (debugpy's documented opt-out).
        for thread in threading.enumerate():
            if thread.name.startswith("ddip-"):
                thread.pydev_do_not_trace = True
        import debugpy

        address = debugpy.listen(("127.0.0.1", 0), in_process_debug_adapter=True)
        if not address:  # before debugpy 1.8.2x its in-process listen() did not say where it listens
            raise RuntimeError(f"debugpy {debugpy.__version__} does not say which port it listens on; "
                               f"JupyterLab's debugger needs a newer one in the ranks' Python: "
                               f"pip install -U debugpy (1.8.22 has it)")
        _port = address[1]
    return _port


class _GutterLines(ast.NodeTransformer):
    """Moves the cell's code down to the lines it has in the whole cell (below its %%dip line),
    and shows those lines to tracebacks and the debugger under the cell's file name."""

    def __init__(self, filename: str, first_line: int, code: str):
        self.filename, self.first_line, self.code = filename, first_line, code

    def visit(self, node):  # called once, on the cell's module, after IPython cached the code
        ast.increment_lineno(node, self.first_line - 1)
        text = "\n" * (self.first_line - 1) + self.code
        linecache.cache[self.filename] = (len(text), None, text.splitlines(keepends=True), self.filename)
        return node


@contextlib.contextmanager
def cell_named(shell, filename: str, first_line: int, code: str):
    """While it lasts, the cell IPython runs in `shell` is compiled as `filename`, its first line
    being line `first_line` there (as ipykernel's compiler names the notebook's own cells)."""
    if _port is not None and sys.gettrace() is None:
        # An interrupt while this rank was stopped raised out of debugpy's trace function, which
        # takes it off this thread: put it back, or no breakpoint would stop the rank again.
        import debugpy

        debugpy.debug_this_thread()
    compiler = shell.compile
    lines = _GutterLines(filename, first_line, code)
    compiler.get_code_name = lambda raw_code, transformed_code, number: filename
    shell.ast_transformers.append(lines)
    try:
        yield
    finally:
        del compiler.get_code_name  # the class's own again
        if lines in shell.ast_transformers:
            shell.ast_transformers.remove(lines)
