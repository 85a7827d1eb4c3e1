"""ddip: distributed data-parallel training from inside a Jupyter notebook, on a C++ runtime.

    import ddip
    with ddip.Group(n=2) as g:
        g.run("import os; os.environ['RANK']")

`import ddip` is lazy (PEP 562): the names below, and the submodules (`ddip.template`,
`ddip.hosts`, ...), are imported when first read, so a rank or a host's agent, which import
`ddip` too, load only their own side of it (docs/architecture.md, "Who imports what").
"""

import importlib as _importlib
import typing as _typing

from . import _lazy

# Each public name -> the module it lives in.
_HOMES = {
    **dict.fromkeys(["FailureKind", "GroupClosedError", "HealError", "HealReport", "RankBusyError", "RankDeadError",
                     "RankError", "RankFailedError", "RankFailure", "RankUnresponsiveError", "RemoteError",
                     "StartError"], "errors"),
    **dict.fromkeys(["Group", "RankResult"], "kernel.group"),
    "prewarm": "kernel.template",
    **dict.fromkeys(["ranch", "torchddp_launch"], "launch.oneshot"),
    **dict.fromkeys(["TorchDDPCtx", "import_star"], "rank.oneshot"),
}

__all__ = ["Group", "RankResult", "RankFailedError", "RemoteError", "RankFailure", "FailureKind", "StartError"]
__all__ += ["HealError", "HealReport"]
__all__ += ["RankError", "RankDeadError", "RankBusyError", "RankUnresponsiveError", "GroupClosedError"]
__all__ += ["ranch", "torchddp_launch", "TorchDDPCtx", "import_star", "prewarm"]
__version__ = "0.1.0"

if _typing.TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports each on first use
    from . import errors, gpus, hosts, kernel, launch, rank, template, torchdist, worker  # noqa: F401
    from .errors import (FailureKind, GroupClosedError, HealError, HealReport, RankBusyError, RankDeadError,
                         RankError, RankFailedError, RankFailure, RankUnresponsiveError, RemoteError, StartError)
    from .kernel.group import Group, RankResult
    from .kernel.template import prewarm
    from .launch.oneshot import ranch, torchddp_launch
    from .rank.oneshot import TorchDDPCtx, import_star


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        return _lazy.submodule(__name__, name)  # ddip.template, ddip.hosts, ... as they were reached
    value = getattr(_importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # read once: later reads don't come here
    return value


def __dir__() -> list[str]:
    return sorted({n for n in globals() if not n.startswith("_") or n.startswith("__")} | set(__all__)
                  | set(_lazy.submodule_names(__name__, __path__)))


def load_ipython_extension(ip):
    from .magics import load_ipython_extension as load  # IPython only when the magics are loaded

    load(ip)


def unload_ipython_extension(ip):
    from .magics import unload_ipython_extension as unload

    unload(ip)
