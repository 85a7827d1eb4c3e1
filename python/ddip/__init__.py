"""ddip: distributed data-parallel training from inside a Jupyter notebook, on a C++ runtime.

    import ddip
    with ddip.Group(n=2) as g:
        g.run("import os; os.environ['RANK']")
"""

from .errors import (FailureKind, GroupClosedError, HealError, HealReport, RankBusyError, RankDeadError, RankError, RankFailure,
                     RankUnresponsiveError, RemoteError, StartError)
from .kernel.group import Group, RankResult
from .kernel.template import prewarm
from .launch.oneshot import ranch, torchddp_launch, TorchDDPCtx, import_star
from . import template, torchdist  # noqa: F401  (reached after `import ddip`, as before)

__all__ = ["Group", "RankResult", "RemoteError", "RankFailure", "FailureKind", "StartError", "HealError", "HealReport"]
__all__ += ["RankError", "RankDeadError", "RankBusyError", "RankUnresponsiveError", "GroupClosedError"]
__all__ += ["ranch", "torchddp_launch", "TorchDDPCtx", "import_star", "prewarm"]
__version__ = "0.1.0"


def load_ipython_extension(ip):
    from .magics import load_ipython_extension as load  # IPython only when the magics are loaded

    load(ip)


def unload_ipython_extension(ip):
    from .magics import unload_ipython_extension as unload

    unload(ip)
