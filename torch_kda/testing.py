"""The testing hook: force the CUDA path's automatic choices (csrc/cuda/heuristics.h).

For tests and measurements only. The setting is process-wide and not seen by
torch.compile's guards; it changes no result's meaning, only the low bits (the
block shapes sum in different orders) and the speed.
"""
import contextlib

import torch

import torch_kda._C  # noqa: F401  (registers torch.ops.kda_testing.*)


@contextlib.contextmanager
def forced(recurrence_block="auto", ds_block="auto", window_slots=None):
    """Within the block, every CUDA op runs with these choices, then the automatic ones again.

    recurrence_block: K2's block shape, "4x1w", "2x2" or "4x4".
    ds_block: the dS recurrence's, "4x1", "4x2" or "2x2".
    window_slots: 0 runs one pass; n > 0 windows of n chunk slots (the same bits).
    "auto" and None leave a choice automatic. A bad value raises before anything is set.
    """
    torch.ops.kda_testing.force(recurrence_block, ds_block, -1 if window_slots is None else window_slots)
    try:
        yield
    finally:
        torch.ops.kda_testing.force()
