"""The testing hook: force the automatic choices of the CUDA path
(csrc/cuda/heuristics.h) and the number of segments a sequence is cut into on
either device (csrc/segments.h). Also the layout of a chunk's record gradients,
which the private torch.ops.kda_testing kernels take and give.

For tests and measurements only. The setting is process-wide and not seen by
torch.compile's guards; it changes no result's meaning, only the low bits (the
block shapes and the segments sum in different orders) and the speed.
"""
import contextlib
import math
import numbers

import torch

import torch_kda._C  # noqa: F401  (registers torch.ops.kda_testing.*)
from torch_kda._ops import cuda_built


# A chunk's record gradients (csrc/cuda/params.h, RecordGradLayout<128>): fp32 [..., RECORD_GRAD_FLOATS],
# the parts in this order, each of its shape (16-token chunks, 128 channels).
RECORD_GRAD_SHAPES = {"Qs": (16, 128), "W": (16, 128), "Kd": (16, 128), "Aqk": (16, 16), "U0": (16, 128), "gl": (128,)}
RECORD_GRAD_SLICES = {}  # each part's slice of the last dimension
_start = 0
for _name, _shape in RECORD_GRAD_SHAPES.items():
    RECORD_GRAD_SLICES[_name] = slice(_start, _start + math.prod(_shape))
    _start += math.prod(_shape)
RECORD_GRAD_FLOATS = _start
del _start, _name, _shape


def record_grad_parts(r):
    """One chunk's record gradients r [RECORD_GRAD_FLOATS] as views, by part, in their shapes."""
    return {name: r[RECORD_GRAD_SLICES[name]].view(shape) for name, shape in RECORD_GRAD_SHAPES.items()}


def _check_count(name, value, least):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"torch_kda.testing.forced: {name} must be an int or None, got {value!r}")
    if value < least:
        raise ValueError(f"torch_kda.testing.forced: {name} must be at least {least} or None, got {value}")


@contextlib.contextmanager
def forced(recurrence_block="auto", ds_block="auto", window_slots=None, segments=None):
    """Within the block, every op runs with these choices; after it, the ones before it.

    recurrence_block: K2's block shape (CUDA): "2x2" or "4x4" at head sizes 64 and 128,
    "4x1w" at 128, "8x4" or "16x4" at 256.
    ds_block: the dS recurrence's (CUDA): "4x2" or "2x2" at every head size, "4x1" at 64
    and 128, "8x2" at 256.
    window_slots: 0 runs one pass; n > 0 windows of n chunk slots (CUDA; the same bits).
    segments: P >= 1 cuts every sequence of a forward into P segments (both devices),
    and in the backward (CUDA: its dS recurrence) each window of a lone sequence
    into at most P segments of whole chunks, or every sequence of a batch run in
    one pass into P; 1 runs none.
    "auto" or None leaves a choice automatic. A bad value raises before anything is set.
    """
    wants_cuda = recurrence_block not in ("auto", None) or ds_block not in ("auto", None) or window_slots is not None
    if wants_cuda and not cuda_built():
        raise RuntimeError("torch_kda.testing.forced: this build of torch_kda has no CUDA kernels to force")
    _check_count("window_slots", window_slots, 0)
    _check_count("segments", segments, 1)
    before_segments = torch.ops.kda_testing.forced_segments()
    before = torch.ops.kda_testing.forced() if cuda_built() else None
    if cuda_built():
        torch.ops.kda_testing.force(
            "auto" if recurrence_block is None else recurrence_block,
            "auto" if ds_block is None else ds_block,
            -1 if window_slots is None else int(window_slots),
        )
    torch.ops.kda_testing.force_segments(-1 if segments is None else int(segments))
    try:
        yield
    finally:
        if before is not None:
            torch.ops.kda_testing.force(*before)
        torch.ops.kda_testing.force_segments(before_segments)
