"""Test seam for tests/test_template.py: importing this module makes torch report CUDA as
initialized (torch's own flag, set the way torch.cuda's lazy init sets it), as a module that
initializes CUDA on import would. No GPU is touched."""
import torch.cuda

torch.cuda._initialized = True
