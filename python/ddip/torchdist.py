"""`ddip.torchdist`, kept as a public path: users catch `ddip.torchdist.RendezvousError`
(docs/api.md). torch.distributed's set-up in a rank is ddip.rank.torchdist."""

from .rank.torchdist import RendezvousError

__all__ = ["RendezvousError"]
