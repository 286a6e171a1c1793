"""torch_kda: Kimi Delta Attention as PyTorch operators.

Public API:
  kda(...)                  functional, differentiable, torch.compile friendly
  fwd(...)                  drop-in for flash_kda.fwd: writes caller buffers
  get_workspace_size(...)   source compatibility with flash_kda (always 0)
The operators themselves are torch.ops.kda.fwd, torch.ops.kda.fwd_ and torch.ops.kda.bwd.
"""
from torch_kda._ops import cuda_built, fwd, get_workspace_size, kda

__all__ = ["kda", "fwd", "get_workspace_size", "cuda_built"]
__version__ = "0.1.0"
