"""One-shot launches: `ranch` and `torchddp_launch` (oneshot), a launch as data (spec), the
notebook as their rank 0 (notebook_rank: frameworks' flags; notebook_env: its environment;
interrupts: the SIGINT guard around its fn), and the native `ddip run` program reached from
Python (program).

`from ddip.launch import ranch` keeps working, as it did when this was one module."""

from .. import _lazy
from .oneshot import TorchDDPCtx, import_star, ranch, torchddp_launch

__all__ = ["ranch", "torchddp_launch", "TorchDDPCtx", "import_star"]

__getattr__ = _lazy.submodules(__name__)  # ddip.launch.<module> reached after `import ddip`
