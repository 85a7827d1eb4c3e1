"""`ddip.template`, kept as a public path: the template process's command line is
`python -c "import ddip.template; ddip.template.main()"` (the kernel's handle and every host's
agent start it so, and tools look for it), and users read `ddip.template.forked` and
`ddip.template.status()` (docs/warm.md). The kernel's handle is ddip.kernel.template, the
template process ddip.rank.template.
"""

from .kernel import template as _kernel
from .kernel.template import prewarm, status
from .rank import template as _rank
from .rank.template import main

__all__ = ["main", "prewarm", "status"]


def __getattr__(name):
    # `forked` and `serving` change after import (in a forked rank, in the template), so they
    # are read where they live, never copied here.
    for module in (_rank, _kernel):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module 'ddip.template' has no attribute {name!r}")
