"""The notebook as one rank of a one-shot launch (ranch's caller rank): how it looks while fn
runs there, and how it is left afterwards — as it was found.

While fn runs, the notebook is an externally launched rank, as a torchrun process is: checks
for an interactive session (Lightning's `_IS_INTERACTIVE`, `hasattr(sys, "ps1")`) see none, and
accelerate's process-wide state starts empty, so `Accelerator()` comes up for this launch. After
the launch, whatever the training stacks created for it in this process is torn down: the
torch.distributed process groups (HF Trainer, `Accelerator()` and Lightning create the default
group and leave it), accelerate's state (a user's own from before the launch comes back),
Lightning's rank and interactive flags, the current CUDA device and torch's thread count.
"""

from __future__ import annotations

import sys
import warnings

from ..rank import torchdist

_MISSING = object()
# Packages that copy lightning.fabric.utilities.imports._IS_INTERACTIVE into their own modules.
_LIGHTNING = ("lightning", "lightning_fabric", "pytorch_lightning")
_LIGHTNING_RANK = ("lightning.fabric.utilities.rank_zero", "lightning_fabric.utilities.rank_zero")
_ACCELERATE_STATES = ("PartialState", "AcceleratorState", "GradientState")


class NotebookRank:
    """One launch's changes to the notebook's process: as_launched() before fn, undone in two
    steps: look_interactive() right after fn (once the launch put the environment back), and
    restore() once the children are gone (until then they may still use this rank's store)."""

    def __init__(self):
        self._ps1 = _MISSING
        self._flags: dict[str, bool] = {}
        self._rank_zero = _MISSING
        self._accelerate: dict[str, dict] = {}
        self._groups = frozenset()
        self._cuda_device = None
        self._threads = None
        self._launched = False
        self._looks_launched = False

    def as_launched(self):
        """Before fn: the notebook looks like an externally launched rank; accelerate starts afresh."""
        self._launched = self._looks_launched = True
        self._groups = torchdist.process_groups()
        torch = sys.modules.get("torch")
        if torch is not None:
            self._threads = torch.get_num_threads()
            if torch.cuda.is_initialized():
                self._cuda_device = torch.cuda.current_device()
        rank_zero = _rank_zero_only()
        if rank_zero is not None:
            self._rank_zero = getattr(rank_zero, "rank", _MISSING)
        for name, shared in _accelerate_states().items():
            self._accelerate[name] = dict(shared)
            shared.clear()  # in place: accelerate's Borg instances share this very dict
        self._ps1 = getattr(sys, "ps1", _MISSING)
        if self._ps1 is not _MISSING:
            del sys.ps1
        for name, module in _lightning_modules():
            self._flags[name] = module._IS_INTERACTIVE
            module._IS_INTERACTIVE = False

    def look_interactive(self):
        """After fn, with the notebook's environment back: interactive again, exactly as before."""
        if not self._looks_launched:
            return
        self._looks_launched = False
        if self._ps1 is not _MISSING:
            sys.ps1 = self._ps1
        # A Lightning module first imported during fn gets what an import in the notebook gives.
        interactive = hasattr(sys, "ps1") or bool(sys.flags.interactive)
        for name, module in _lightning_modules():
            module._IS_INTERACTIVE = self._flags.get(name, interactive)
        rank_zero = _rank_zero_only()
        if rank_zero is not None:
            if self._rank_zero is not _MISSING:
                rank_zero.rank = self._rank_zero
            else:
                rank_zero.rank = _lightning_rank_from_env()

    def restore(self):
        """After the launch, its children gone: what the launch created in this process is torn down."""
        if not self._launched:
            return
        self._launched = False
        for group, exc in torchdist.destroy_since(self._groups):
            warnings.warn(f"ranch could not destroy the process group {group} that fn created in the "
                          f"notebook: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)
        for name, shared in _accelerate_states().items():
            shared.clear()
            shared.update(self._accelerate.get(name, {}))
        torch = sys.modules.get("torch")
        if torch is None:
            return
        if self._threads is not None and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)  # accelerate on CPU sets it without asking
        if torch.cuda.is_initialized():
            # CUDA that started during the launch had device 0 current, as it would have here.
            device = self._cuda_device if self._cuda_device is not None else 0
            if torch.cuda.current_device() != device:
                torch.cuda.set_device(device)


def _lightning_modules():
    # Copied in one step: a thread of fn's (a DataLoader's, say) may be importing meanwhile.
    return [(name, module) for name, module in sys.modules.copy().items()
            if name.partition(".")[0] in _LIGHTNING and module is not None
            and "_IS_INTERACTIVE" in getattr(module, "__dict__", {})]


def _rank_zero_only():
    module = sys.modules.get("lightning_utilities.core.rank_zero")
    return getattr(module, "rank_zero_only", None)


def _lightning_rank_from_env() -> int:
    # What Lightning's import sets rank_zero_only.rank to, from the environment it sees.
    for name in _LIGHTNING_RANK:
        get_rank = getattr(sys.modules.get(name), "_get_rank", None)
        if get_rank is not None:
            return get_rank() or 0
    return 0


def _accelerate_states() -> dict[str, dict]:
    module = sys.modules.get("accelerate.state")
    if module is None:
        return {}
    return {name: getattr(module, name)._shared_state for name in _ACCELERATE_STATES if hasattr(module, name)}
