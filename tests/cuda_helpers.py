"""What the CUDA test files share: inputs of the CUDA kernels' shape, the calls,
the gradient comparison, window and launch helpers. Not a test module."""
import math

import pytest
import torch

import torch_kda
from torch_kda.testing import forced
from conftest import RECORD_FLOATS, make_inputs, positional, rel, run_reference

# Every CUDA test module's marks: skipped without a GPU or without the CUDA kernels.
CUDA_MARKS = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and torch_kda.cuda_built()), reason="needs a CUDA GPU and a CUDA build"
    ),
]
DEV = "cuda"


D = 128


# An fp32 state at fp32 level: the recurrence's bf16x3 products keep ~16 bits
# per operand (plain bf16 products would give ~1e-3).
FP32_STATE_TOL = 5e-5


def cuda_inputs(state_dtype=torch.float32, lower_bound=-5.0, **kw):
    """Random bf16 inputs of the CUDA kernels' shape (K = V = 128), on the GPU,
    with their CPU originals for the reference."""
    kw.setdefault("K", D)
    kw.setdefault("V", D)
    d = make_inputs(dtype=torch.bfloat16, state_dtype=state_dtype, **kw)
    g = {name: (t.to(DEV) if t is not None else None) for name, t in d.items()}
    return d, g


def run_cuda(g, lower_bound=-5.0, **kw):
    return torch_kda.kda(
        *positional(g),
        lower_bound=lower_bound,
        initial_state=g["initial_state"],
        output_final_state=True,
        cu_seqlens=g["cu_seqlens"],
        **kw,
    )


def errors(d, g, lower_bound=-5.0):
    out, final = run_cuda(g, lower_bound=lower_bound)
    torch.cuda.synchronize()
    ref_out, ref_final = run_reference(g, lower_bound=lower_bound)  # float64, on the GPU
    return rel(out, ref_out), rel(final, ref_final), out, final


def hard_case(name, d, g):
    if name == "random":
        return
    if name == "weak_decay":
        g["A_log"].fill_(2.0)
        g["dt_bias"].fill_(-8.0)
    elif name == "strong_decay":  # the bounded gate near its bound; the softplus gate's e^-6 a token
        g["A_log"].fill_(1.5)
        g["dt_bias"].fill_(1.0)
    elif name == "small_beta":
        g["beta"].sub_(6.0)
    d["A_log"], d["dt_bias"], d["beta"] = (g[n].cpu() for n in ("A_log", "dt_bias", "beta"))


def assert_each_sequence_alone_is_bitwise(g, out, final):
    """Each sequence of the varlen batch g, run alone, gives bitwise the batch's out and final state."""
    cu = g["cu_seqlens"].tolist()
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        part = {name: g[name][:, s:e] for name in ("q", "k", "v", "g", "beta")}
        o, f = torch_kda.kda(
            part["q"], part["k"], part["v"], part["g"], part["beta"], g["A_log"], g["dt_bias"],
            lower_bound=-5.0, initial_state=g["initial_state"][n : n + 1], output_final_state=True,
        )
        assert torch.equal(o, out[:, s:e]), n
        assert torch.equal(f[0], final[n]), n


def run_windowed(g, window, **kw):
    """run_cuda in windows of `window` chunk slots (0: one pass), the other choices automatic."""
    with forced(window_slots=window):
        return run_cuda(g, **kw)


WINDOW_CASES = {
    # name: (inputs, windows in slots); slots are 16-token chunks
    "fixed": (dict(B=2, T=300, H=2), [1, 3, 7, 19]),
    "varlen": (dict(seqlens=[5, 16, 0, 31, 1, 47, 0, 33], H=2), [1, 2, 3, 5]),
    "varlen_empty_ends": (dict(seqlens=[0, 0, 17, 0, 16, 0], H=3), [1, 2]),
    "many_heads": (dict(B=1, T=200, H=96), [2, 5]),
}


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state")


# The targets are 1e-2 (dq, dk, dv, dh0) and 2e-2 (dg, dbeta, dA_log, ddt_bias);
# the tests hold the computation to what it reaches, so that a bug cannot hide under
# them: bf16 gradients are rounded outputs (~2e-3); dA_log and ddt_bias, sums over
# every token of terms that cancel, carry the bf16 rounding of the chunk states and
# dS that the record gradients multiply by (3e-4 to 6.2e-3 on the H200, against
# ~1e-5 with fp32 ones); the initial state's gradient comes from the fp32 carry (~3e-6).
# The record gradients themselves are held to 5e-5 given those bf16 values
# (test_sweep_backward_matches_reference).
GRAD_TOL = dict(dq=5e-3, dk=5e-3, dv=5e-3, dg=5e-3, dbeta=5e-3, dA_log=1e-2, ddt_bias=1e-2, dinitial_state=1e-4)


def to_cpu64(g):
    """The tensors of g on the CPU, the floating ones in float64."""
    return {n: (t.cpu().double() if t is not None and t.is_floating_point() else (t.cpu() if t is not None else None))
            for n, t in g.items()}


def float64_grads(g, grad_out, grad_final, lower_bound):
    """kda.bwd on the CPU in float64 from the values of the CUDA inputs g."""
    g64 = to_cpu64(g)
    return torch.ops.kda.bwd(grad_out.cpu().double(), None if grad_final is None else grad_final.cpu().double(),
                             *positional(g64), lower_bound=lower_bound, initial_state=g64["initial_state"],
                             cu_seqlens=g64["cu_seqlens"])


def cuda_and_reference_grads(d, g, with_final=True):
    """kda.bwd on the GPU (bf16 inputs) and on the CPU in float64 from the same values."""
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    gf = torch.randn(*g["initial_state"].shape, device=DEV) if with_final else None
    got = torch.ops.kda.bwd(grad_out, gf, *positional(g), lower_bound=-5.0, initial_state=g["initial_state"],
                            cu_seqlens=g["cu_seqlens"])
    return got, float64_grads(g, grad_out, gf, -5.0)


def check_grads(label, got, ref, tol=None):
    """Each gradient within GRAD_TOL of the reference, or within tol's entry for it."""
    tol = {**GRAD_TOL, **(tol or {})}
    for name, x, r in zip(GRAD_NAMES, got, ref):
        if r.numel() == 0:
            assert x.numel() == 0, name
            continue
        e = rel(x.cpu(), r)
        print(f"\n{label} {name}: rel {e:.2e}", end="")
        assert torch.isfinite(x).all(), name
        assert e <= tol[name], f"{name}: rel {e:.2e}"


# Slots of a backward window of ~1 GiB of scratch (csrc/checkpoints.cpp; 27136
# + 2 * 32768 + 34304 bytes per slot and head), where one pass would hold too much.
def window_floor(H):
    return max((1 << 30) // (H * 126976), 16)


def launched_kernels(fn):
    """fn's result and the names of the CUDA kernels it launched, in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


# The kernels' template arguments that name a block shape WxS, as (kWarps, kSplit):
# K2's (recurrence_kernel<D, kSplit, kWarps, kOut, kX3, kLate>) and the dS
# recurrence's (ds_recurrence_kernel<D, kWarps, kSplit, ...>), D the head size.
K2_SHAPE = {"4x1w": (4, 1), "2x2": (2, 2), "4x4": (4, 4), "8x4": (8, 4), "16x4": (16, 4)}
DS_SHAPE = {"4x1": (4, 1), "4x2": (4, 2), "2x2": (2, 2), "8x2": (8, 2)}


def k2_launches(names):
    """((kWarps, kSplit), kOut, kLate) of every K2 launch among the kernel names."""
    import re

    found = [re.search(r"recurrence_kernel<\d+, (\d+), (\d+), (true|false), (?:true|false), (true|false)>", n)
             for n in names if "ds_recurrence" not in n]
    return [((int(m.group(2)), int(m.group(1))), m.group(3) == "true", m.group(4) == "true") for m in found if m]


def ds_launches(names):
    """(kWarps, kSplit) of every dS recurrence launch among the kernel names."""
    import re

    found = [re.search(r"ds_recurrence_kernel<\d+, (\d+), (\d+),", n) for n in names]
    return [(int(m.group(1)), int(m.group(2))) for m in found if m]


def kernel_launches(fn):
    """fn's result and its launches of K1 (prepare_kernel) and of K2 (the
    recurrence_kernel, not the dS recurrence's)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    k2 = sum("recurrence_kernel" in n and "ds_recurrence" not in n for n in names)
    return result, sum("prepare_kernel" in n for n in names), k2


def assert_checkpoints_are_prefix_states(g, ckpt):
    """ckpt[s] is bitwise the fp32 final state of a forward over the tokens
    before slot s, rounded to bf16 (ckpt[0]: the initial state's), for a few
    slots of one fixed-length sequence."""
    init = g["initial_state"]
    slots = ckpt.shape[0]
    assert slots == math.ceil(g["q"].shape[1] / 16)
    assert torch.equal(ckpt[0], init[0].bfloat16())
    for s in sorted({1, slots // 3, slots - 1} - {0}):
        n = s * 16
        prefix = [t[:, :n] for t in positional(g)[:5]] + list(positional(g)[5:])
        _, state = torch.ops.kda.fwd(*prefix, None, -5.0, init, True, None)
        assert torch.equal(ckpt[s], state[0].bfloat16()), s
