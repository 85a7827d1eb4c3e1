"""`ddip.worker`, kept as a public path: ranks start as
`python -c "import ddip.worker; ddip.worker.main()"` (the kernel's Group and every host's agent
start them so, and tools look for it), and rank code calls `ddip.worker.notify()`. The worker
loop is ddip.rank.worker.
"""

from .rank import worker as _worker
from .rank.worker import main, notify

__all__ = ["main", "notify"]


def __getattr__(name):
    # The loop's state changes while the rank runs, so it is read where it lives.
    return getattr(_worker, name)


if __name__ == "__main__":
    main()
