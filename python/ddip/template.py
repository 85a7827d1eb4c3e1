"""`ddip.template`, kept as a public path: the template process's command line is
`python -c "import ddip.template; ddip.template.main()"` (ddip.rank.template.command(); the
kernel's handle and every host's agent start it so, and tools look for it), and users read
`ddip.template.forked` and `ddip.template.status()` (docs/warm.md). The kernel's handle is
ddip.kernel.template, the template process ddip.rank.template.

The template and its forked ranks import this module too, so the kernel's handle is imported
only when one of its names is read (a rank loads no kernel module: tests/test_layout.py).
"""

from __future__ import annotations

from .rank import template as _rank
from .rank.template import main

__all__ = ["main", "prewarm", "status"]


def __getattr__(name):
    # `forked` and `serving` change after import (in a forked rank, in the template), so they
    # are read where they live, never copied here.
    if hasattr(_rank, name):
        return getattr(_rank, name)
    from .kernel import template as kernel  # prewarm, status, _handle: the notebook's

    if hasattr(kernel, name):
        return getattr(kernel, name)
    raise AttributeError(f"module 'ddip.template' has no attribute {name!r}")
