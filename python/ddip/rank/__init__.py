"""A rank's side: the worker loop, heal's rank half, torch.distributed's set-up, displays sent to
the kernel, a one-shot launch's child (oneshot), and the warm rank template process that ranks
are forked from. Nothing here imports the kernel's side (ddip.kernel), the hosts' (ddip.hosts) or
the launches' (ddip.launch), so a rank loads none of them (tests/test_layout.py).

`command()` is a rank's command line, the one place it is written: the kernel's Group and every
host's agent start ranks with it, and a rank template's fork runs its `-c` code."""

from __future__ import annotations

import sys

from .. import _lazy

# Imported, not run as __main__, so rank code can `import ddip.worker` and reach the loop's state;
# the public path ddip.worker, which tools look for in a rank's command line.
_CODE = "import ddip.worker; ddip.worker.main()"


def command(python: str | None = None) -> list[str]:
    """A rank's argv: `python -c "import ddip.worker; ddip.worker.main()"` (`python`: the
    interpreter, this one by default; another host's for ranks there)."""
    return [python or sys.executable, "-c", _CODE]


__getattr__ = _lazy.submodules(__name__)
