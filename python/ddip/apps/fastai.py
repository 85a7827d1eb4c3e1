"""fastai (v2) distributed training in ddip's ranks.

Two ways in:

    %makedip -n 2 -a fastai              # the magic calls setup_group(group)
    %%dip
    learn = Learner(dls, model, loss_func=MSELossFlat())
    with learn.distrib_ctx():
        learn.fit(2)

    ddip.ranch(2, train, ctx=ddip.apps.fastai.ctx())    # train() calls learn.distrib_ctx()

fastai's own `distrib_ctx()` wraps the model in DDP (through accelerate) and shards the data
loaders; what it needs from us: torch.distributed initialized (gloo on CPU, which fastai's own
setup can't do: it hard-codes NCCL), accelerate told whether it is on CPU or which GPU is this
rank's, fastai's data-order broadcast working on CPU tensors, and accelerate's process-wide state
reset between launches. Progress bars and metrics come from rank 0 only (fastai removes them
from the other ranks); in a notebook's group they are fastprogress's notebook bar and results
table, updating in place (ddip.rank.displays switches fastprogress to its notebook classes in ranks
whose kernel is a notebook). With BatchNorm on CPU, use `learn.distrib_ctx(sync_bn=False)`.
"""

from __future__ import annotations

import os

from ..rank.oneshot import TorchDDPCtx

__all__ = ["ctx", "FastaiCtx", "prepare_rank", "setup_group"]

# Run in every rank of a persistent group by setup_group: the names fastai code expects.
RANK_SETUP = """\
from fastai.basics import *
from fastai.distributed import *
import ddip.apps.fastai as _ddip_fastai
_ddip_fastai.prepare_rank()
del _ddip_fastai
"""


def setup_group(group):
    """Prepares every rank of a ddip.Group (as `%makedip -a fastai` does) for fastai's
    distributed training: `from fastai.basics import *` and `from fastai.distributed import *`
    in each rank's namespace, and the
    settings prepare_rank() makes. The group's ranks must have torch.distributed initialized
    (the default backend='auto' does that)."""
    return group.run(RANK_SETUP)


def prepare_rank(device=None):
    """In one rank: what fastai's distributed training needs beyond torch.distributed itself."""
    import torch

    import fastai.distributed as fd

    if device is None:
        cuda = os.environ.get("CUDA_VISIBLE_DEVICES", "") != "" and torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cpu":
        # accelerate (which fastai's DistributedTrainer uses) goes multi-process on CPU only if told.
        os.environ["ACCELERATE_USE_CPU"] = "true"
        os.environ.pop("ACCELERATE_TORCH_DEVICE", None)
    else:
        os.environ.pop("ACCELERATE_USE_CPU", None)
        # This rank's GPU, as ddip chose it (the notebook picks by physical id, not LOCAL_RANK).
        os.environ["ACCELERATE_TORCH_DEVICE"] = str(device)
    if not getattr(fd.DistributedDL._broadcast, "_ddip", False):
        fd.DistributedDL._broadcast = _broadcast


def _broadcast(self, t, rank):
    """fastai's DistributedDL._broadcast, on CPU tensors unless the backend is NCCL."""
    import torch
    import torch.distributed as dist

    t = torch.LongTensor(t)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.broadcast(t, rank)
    return t.cpu().tolist()


_broadcast._ddip = True


def _reset_accelerate():
    try:
        from accelerate.state import AcceleratorState, GradientState
    except ImportError:
        return
    # accelerate keeps one process-wide state; a later launch (another world size) needs a fresh one.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class FastaiCtx(TorchDDPCtx):
    """TorchDDPCtx plus what fastai needs (see the module's doc); use through ctx()."""

    def __enter__(self):
        import torch

        self._threads = torch.get_num_threads()
        super().__enter__()
        try:
            if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
                # Share the cores between the ranks (what accelerate would do, with a warning).
                world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
                n = max(1, (os.cpu_count() or 1) // max(1, world))
                os.environ["OMP_NUM_THREADS"] = str(n)
                torch.set_num_threads(n)
            prepare_rank(self.device)
            _reset_accelerate()
        except BaseException:
            super().__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        import torch

        try:
            _reset_accelerate()
            torch.set_num_threads(self._threads)
        finally:
            suppress = super().__exit__(*exc)
        return suppress


def ctx(backend: str | None = None, gpus=None, port: int | None = None, *, timeout: float | None = None):
    """A context manager for ddip.ranch: torch.distributed set up as TorchDDPCtx does, plus
    what fastai's `learn.distrib_ctx()` needs in each rank."""
    return FastaiCtx(backend=backend, gpus=gpus, port=port, timeout=timeout)
