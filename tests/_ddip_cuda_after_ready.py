"""Test seam for tests/test_template.py: once the rank template serves fork requests, torch
reports CUDA as initialized, as if something had started CUDA after the template's imports.
No GPU is touched; only the check the template makes before every fork is fooled."""
import torch.cuda

import ddip.template

_real = torch.cuda.is_initialized
torch.cuda.is_initialized = lambda: ddip.template.serving or _real()
