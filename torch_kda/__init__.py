"""torch_kda: Kimi Delta Attention as PyTorch operators.

Public API:
  kda(...)                  functional, differentiable, torch.compile friendly
  fwd(...)                  drop-in for flash_kda.fwd: writes caller buffers
  kda_pool(...)             serving: each request's state read from and written to a state pool, in place
  get_workspace_size(...)   source compatibility with flash_kda (always 0)
  distributed.context_parallel_kda(...)   one sequence split along T across a process group
The operators themselves are torch.ops.kda.fwd, fwd_, fwd_pool_ and bwd.
"""
from torch_kda import distributed
from torch_kda._ops import cuda_built, fwd, get_workspace_size, kda, kda_pool

__all__ = ["kda", "kda_pool", "fwd", "get_workspace_size", "cuda_built", "distributed"]
__version__ = "0.1.0"
