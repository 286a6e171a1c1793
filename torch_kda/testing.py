"""The testing hook: force the CUDA path's automatic choices (csrc/cuda/heuristics.h).

For tests and measurements only. The setting is process-wide and not seen by
torch.compile's guards; it changes no result's meaning, only the low bits (the
block shapes sum in different orders) and the speed.
"""
import contextlib
import numbers

import torch

import torch_kda._C  # noqa: F401  (registers torch.ops.kda_testing.*)
from torch_kda._ops import cuda_built


@contextlib.contextmanager
def forced(recurrence_block="auto", ds_block="auto", window_slots=None):
    """Within the block, every CUDA op runs with these choices; after it, the ones before it.

    recurrence_block: K2's block shape, "4x1w", "2x2" or "4x4".
    ds_block: the dS recurrence's, "4x1", "4x2" or "2x2".
    window_slots: 0 runs one pass; n > 0 windows of n chunk slots (the same bits).
    "auto" or None leaves a choice automatic. A bad value raises before anything is set.
    """
    if not cuda_built():
        raise RuntimeError("torch_kda.testing.forced: this build of torch_kda has no CUDA kernels to force")
    if window_slots is not None and (isinstance(window_slots, bool) or not isinstance(window_slots, numbers.Integral)):
        raise TypeError(f"torch_kda.testing.forced: window_slots must be an int or None, got {window_slots!r}")
    before = torch.ops.kda_testing.forced()
    torch.ops.kda_testing.force(
        "auto" if recurrence_block is None else recurrence_block,
        "auto" if ds_block is None else ds_block,
        -1 if window_slots is None else int(window_slots),
    )
    try:
        yield
    finally:
        torch.ops.kda_testing.force(*before)
