"""The CUDA forward kernels (sm_90a) and the first CUDA backward against the float64 reference, fla's
chunk_kda, the CPU kernel, and the composition promises of SPEC section 6
(CUDA graphs, torch.compile, opcheck). Skipped where CUDA is absent; run them
on an H200 with tools/gpu_check.sh.
"""

import math

import pytest
import torch

import torch_kda
from conftest import capture_graph, fla_chunk_kda, make_inputs, positional, rel, run_reference

pytestmark = [
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


# --------------------------------------------------------------------------
# Accuracy (SPEC section 4)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("state_dtype,state_tol", [(torch.bfloat16, 5e-3), (torch.float32, 1e-3)])
def test_random_case_accuracy(state_dtype, state_tol):
    d, g = cuda_inputs(B=2, T=1024, H=4, state_dtype=state_dtype)
    e_out, e_state, _, final = errors(d, g)
    print(f"\nrandom T=1024 state={state_dtype}: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert final.dtype == state_dtype
    assert e_out <= 5e-3
    assert e_state <= state_tol


def _hard_case(name, d, g):
    if name == "random":
        return
    if name == "weak_decay":
        g["A_log"].fill_(2.0)
        g["dt_bias"].fill_(-8.0)
    elif name == "small_beta":
        g["beta"].sub_(6.0)
    d["A_log"], d["dt_bias"], d["beta"] = (g[n].cpu() for n in ("A_log", "dt_bias", "beta"))


@pytest.mark.parametrize(
    "name,lower_bound",
    [("weak_decay", -5.0), ("small_beta", -5.0), ("lower_bound", -0.1), ("lower_bound", -1.0), ("lower_bound", -5.0)],
)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_hard_cases(name, lower_bound, state_dtype):
    d, g = cuda_inputs(B=1, T=4096, H=2, state_dtype=state_dtype)
    _hard_case(name, d, g)
    e_out, e_state, _, _ = errors(d, g, lower_bound)
    print(f"\n{name} lb={lower_bound} T=4096 state={state_dtype}: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= 2e-2
    assert e_state <= 2e-2


def test_hard_case_long_sequence():
    d, g = cuda_inputs(B=1, T=65536, H=2, state_dtype=torch.float32)
    e_out, e_state, _, _ = errors(d, g, -5.0)
    print(f"\nlong lb=-5.0 T=65536 state=float32: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= 2e-2
    assert e_state <= 2e-2


def test_bf16_state_takes_bf16_products_over_long_sequences():
    """With a bf16 state the recurrence multiplies by the state, U and the record's
    planes in bf16 alone (FwdParams::bf16_products), where an fp32 state keeps bf16x3:
    over 4,096 chunks, each feeding its products back into the state, the bf16 state's
    errors stay inside SPEC's random-case targets, and the same inputs with an fp32
    state keep the far smaller fp32-level state error (the two paths differ)."""
    d, g = cuda_inputs(B=1, T=65536, H=2, state_dtype=torch.bfloat16)
    e_out, e_state, _, final = errors(d, g, -5.0)
    g32 = dict(g, initial_state=g["initial_state"].float())
    e_out32, e_state32, _, _ = errors(d, g32, -5.0)
    print(f"\nT=65536 random: bf16 state out rel {e_out:.2e} state rel {e_state:.2e};"
          f" fp32 state out rel {e_out32:.2e} state rel {e_state32:.2e}")
    assert final.dtype == torch.bfloat16
    assert e_out <= 5e-3 and e_state <= 5e-3
    assert e_state32 <= FP32_STATE_TOL and e_state32 * 10 < e_state


@pytest.mark.parametrize("H", [16, 32, 64, 96, 256])
def test_every_block_width_matches_reference(H):
    """The recurrence picks its block shape by N * H over the SM count; on a 132-SM
    H200, H = 16 splits each row group's key columns over four warps, 32 over two,
    64, 96 and 256 run four full-width warps per block (256: two waves). Eight- and
    two-warp full-width blocks run only when forced
    (test_forced_block_shapes_match_reference)."""
    d, g = cuda_inputs(B=1, T=200, H=H, state_dtype=torch.float32)
    e_out, e_state, _, _ = errors(d, g)
    print(f"\nH={H} on {torch.cuda.get_device_properties(0).multi_processor_count} SMs: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= 5e-3 and e_state <= 1e-4


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["8x1", "4x1", "4x1w", "2x1", "2x2", "4x4"])
def test_forced_block_shapes_match_reference(shape, state_dtype, monkeypatch):
    """TORCH_KDA_RECURRENCE_BLOCK (a measurement knob) runs any block shape on any
    problem: each on a varlen batch with an empty sequence and a partial chunk, with
    bf16x3 products (fp32 state) and bf16 ones (bf16 state)."""
    monkeypatch.setenv("TORCH_KDA_RECURRENCE_BLOCK", shape)
    d, g = cuda_inputs(seqlens=[5, 40, 0, 77], H=3, state_dtype=state_dtype)
    e_out, e_state, _, _ = errors(d, g)
    print(f"block {shape} state {state_dtype}: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= 5e-3 and e_state <= (FP32_STATE_TOL if state_dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("name", ["random", "weak_decay", "small_beta"])
def test_wgmma_shape_keeps_the_fp32_state_over_long_sequences(name, monkeypatch):
    """The 4x1 shape on wgmma, forced, over 256 chunks (an fp32 state that every
    chunk's products feed back into), against float64 and against the mma.sync
    4x1, which it equals bitwise on the H200 (the same products summed in the
    same order; the check allows 1e-5)."""
    d, g = cuda_inputs(B=1, T=4096, H=8, state_dtype=torch.float32)
    _hard_case(name, d, g)
    monkeypatch.setenv("TORCH_KDA_RECURRENCE_BLOCK", "4x1")
    out_ref, final_ref = run_cuda(g)
    monkeypatch.setenv("TORCH_KDA_RECURRENCE_BLOCK", "4x1w")
    e_out, e_state, out, final = errors(d, g)
    print(f"\n{name} block 4x1w T=4096: out rel {e_out:.2e}, state rel {e_state:.2e};"
          f" vs 4x1 out {rel(out.float().cpu(), out_ref.float().cpu()):.2e} state {rel(final.cpu(), final_ref.cpu()):.2e}")
    assert e_out <= 5e-3 and e_state <= FP32_STATE_TOL
    assert rel(final.cpu(), final_ref.cpu()) <= 1e-5


def test_forced_block_shape_is_checked(monkeypatch):
    d, g = cuda_inputs(B=1, T=40, H=2)
    monkeypatch.setenv("TORCH_KDA_RECURRENCE_BLOCK", "16x1")
    with pytest.raises(RuntimeError, match="TORCH_KDA_RECURRENCE_BLOCK must be one of 8x1, 4x1, 4x1w, 2x1, 2x2, 4x4, got '16x1'"):
        run_cuda(g)


def _record_values(records):
    """The values of the backward's records (csrc/cuda/params.h: per chunk and head,
    bf16 planes Qs, W hi, W lo, Kd hi, Kd lo, Aqk, Qs lo, Aqk lo, fp32 gl, M hi, M lo):
    Qs, W, Kd, Aqk and M as hi + lo, and gl, each in float64 on the CPU."""
    b = records.view(torch.uint8).reshape(-1, 27136).cpu()

    def plane(at, n, dtype=torch.bfloat16):
        return b[:, at:at + n].contiguous().view(dtype).double()

    P, Q = 16 * 128 * 2, 16 * 16 * 2
    return [plane(0, P) + plane(20480 + Q, P), plane(P, P) + plane(2 * P, P), plane(3 * P, P) + plane(4 * P, P),
            plane(20480, Q) + plane(20480 + Q + P, Q), plane(25600, 512, torch.float32),
            plane(26112, Q) + plane(26112 + Q, Q)]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("warps", ["1", "2"])
def test_k1_warps_match_reference(warps, state_dtype, monkeypatch):
    """TORCH_KDA_K1_WARPS (a measurement knob): K1 with one or two warps per chunk
    and head, on a varlen batch with an empty sequence and partial chunks, and the
    backward's records (kda._fwd_checkpointed) of the two against each other."""
    monkeypatch.setenv("TORCH_KDA_K1_WARPS", warps)
    d, g = cuda_inputs(seqlens=[5, 40, 0, 77], H=3, state_dtype=state_dtype)
    e_out, e_state, _, _ = errors(d, g)
    args = (g["q"], g["k"], g["v"], g["g"], g["beta"], g["A_log"], g["dt_bias"], None, -5.0,
            g["initial_state"], True, g["cu_seqlens"])
    records = _record_values(torch.ops.kda._fwd_checkpointed(*args)[3])
    monkeypatch.setenv("TORCH_KDA_K1_WARPS", "2" if warps == "1" else "1")
    other = _record_values(torch.ops.kda._fwd_checkpointed(*args)[3])
    e_rec = max(rel(a, b) for a, b in zip(records, other))
    print(f"K1 warps {warps} state {state_dtype}: out rel {e_out:.2e}, state rel {e_state:.2e}, records vs the other {e_rec:.2e}")
    assert e_out <= 5e-3 and e_state <= (FP32_STATE_TOL if state_dtype == torch.float32 else 5e-3)
    assert e_rec <= 1e-5


def test_k1_warps_knob_is_checked(monkeypatch):
    """A bad TORCH_KDA_K1_WARPS raises naming the op, in the forward, where no
    chunk runs K1 (a batch of empty sequences) and in the backward."""
    _, g = cuda_inputs(B=1, T=40, H=2)
    _, empty = cuda_inputs(seqlens=[0, 0], H=2)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    monkeypatch.setenv("TORCH_KDA_K1_WARPS", "4")
    bad = "TORCH_KDA_K1_WARPS must be one of 1, 2, got '4'"
    for inputs in (g, empty):
        with pytest.raises(RuntimeError, match=f"kda.fwd: {bad}"):
            run_cuda(inputs)
    with pytest.raises(RuntimeError, match=f"kda.bwd: {bad}"):
        torch.ops.kda.bwd(grad_out, None, *positional(g), lower_bound=-5.0)


def test_k1_one_warp_is_refused_for_the_softplus_gate(monkeypatch):
    """The softplus gate's K1 has two warps only: asking for one raises rather
    than silently running two."""
    _, g = cuda_inputs(B=1, T=40, H=2)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    monkeypatch.setenv("TORCH_KDA_K1_WARPS", "1")
    with pytest.raises(RuntimeError, match="kda.fwd: TORCH_KDA_K1_WARPS=1 serves the bounded gate only"):
        run_cuda(g, lower_bound=None)
    with pytest.raises(RuntimeError, match="kda.bwd: TORCH_KDA_K1_WARPS=1 serves the bounded gate only"):
        torch.ops.kda.bwd(grad_out, None, *positional(g), lower_bound=None)


def test_fp32_state_does_not_drift_over_long_small_beta_sequences():
    """Small beta: the delta rule corrects the state only over ~100 / beta tokens, so a
    rounding bias in the state update (the tensor cores' fp32 accumulation truncates)
    would add up over the sequence instead of washing out."""
    d, g = cuda_inputs(B=1, T=65536, H=2, state_dtype=torch.float32)
    _hard_case("small_beta", d, g)
    e_out, e_state, _, _ = errors(d, g, -5.0)
    print(f"\nsmall_beta lb=-5.0 T=65536 state=float32: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_state <= 1e-4


def test_fp32_state_is_accumulated_in_fp32():
    """Under weak decay the state sums thousands of updates; rounding it to
    bf16 on chip would show as a state error near bf16's resolution."""
    d, g = cuda_inputs(B=1, T=4096, H=2, state_dtype=torch.float32)
    _hard_case("weak_decay", d, g)
    _, e_state, _, _ = errors(d, g)
    assert e_state <= 1e-4


def test_agrees_with_fla_chunk_kda():
    d, g = cuda_inputs(B=2, T=1024, H=4, state_dtype=torch.float32)
    out, final = run_cuda(g)
    fla_out, fla_final = fla_chunk_kda(g, -5.0)
    ref_out, ref_final = run_reference(d, lower_bound=-5.0)
    print(
        f"\nvs reference: torch_kda out {rel(out.cpu(), ref_out):.2e} state {rel(final.cpu(), ref_final):.2e};"
        f" chunk_kda out {rel(fla_out.cpu(), ref_out):.2e} state {rel(fla_final.cpu(), ref_final):.2e}"
    )
    assert rel(out.float(), fla_out.float()) <= 1e-2
    assert rel(final.float(), fla_final.float()) <= 1e-2


def test_varlen_agrees_with_fla_chunk_kda():
    seqlens = [300, 1, 0, 77, 1024, 16, 33]
    d, g = cuda_inputs(seqlens=seqlens, H=4, state_dtype=torch.float32)
    out, final = run_cuda(g)
    fla_out, fla_final = fla_chunk_kda(g, -5.0)
    assert rel(out.float(), fla_out.float()) <= 1e-2
    assert rel(final.float(), fla_final.float()) <= 1e-2


# --------------------------------------------------------------------------
# Completeness: varlen, odd lengths, empty sequences, T = 0, no state
# --------------------------------------------------------------------------


@pytest.mark.parametrize("cu_dtype", [torch.int64, torch.int32])
def test_varlen_matches_reference(cu_dtype):
    seqlens = [1, 17, 0, 33, 15, 16, 100, 0]
    d, g = cuda_inputs(seqlens=seqlens, H=2, cu_dtype=cu_dtype)
    e_out, e_state, _, _ = errors(d, g)
    assert e_out <= 5e-3 and e_state <= 1e-3


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


def test_varlen_equals_separate_calls_bitwise(monkeypatch):
    """Each sequence computed alone gives bitwise the varlen result: the padded
    tail rows of a partial chunk never leak into the next sequence. (Both calls
    run one block shape, forced: across shapes the low bits may differ, see
    docs/ARCHITECTURE.md.)"""
    monkeypatch.setenv("TORCH_KDA_RECURRENCE_BLOCK", "4x4")
    seqlens = [5, 16, 0, 31, 1, 47]
    d, g = cuda_inputs(seqlens=seqlens, H=2)
    out, final = run_cuda(g)
    assert_each_sequence_alone_is_bitwise(g, out, final)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_4x1w_refill_points_agree_bitwise(monkeypatch, state_dtype):
    """The 4x1w forward issues a step's copies at one of two points, by how many
    blocks it runs (fwd_recurrence.cu, late_refill_pays): a batch of enough
    (sequence, head) pairs takes the later one, each of its sequences alone the
    earlier, and both give the same bits, which match the float64 reference."""
    monkeypatch.setenv("TORCH_KDA_RECURRENCE_BLOCK", "4x1w")
    H = 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    N = (3 * sms + 2 * H - 1) // (2 * H)  # two blocks a (sequence, head): 3 * sms or more
    seqlens = torch.randint(1, 60, (N,)).tolist()
    seqlens[N // 2] = 0
    d, g = cuda_inputs(seqlens=seqlens, H=H, state_dtype=state_dtype)
    out, final = run_cuda(g)
    ref_out, ref_final = run_reference(g, lower_bound=-5.0)
    assert rel(out, ref_out) <= 5e-3
    assert rel(final, ref_final) <= (5e-3 if state_dtype == torch.bfloat16 else FP32_STATE_TOL)
    assert_each_sequence_alone_is_bitwise(g, out, final)


def test_thousands_of_sequences_match_cpu_kernel():
    lengths = torch.randint(0, 40, (3000,)).tolist()
    d, g = cuda_inputs(seqlens=lengths, H=1, state_dtype=torch.float32)
    out, final = run_cuda(g)
    cpu_out, cpu_final = torch_kda.kda(
        *positional(d), lower_bound=-5.0, initial_state=d["initial_state"], output_final_state=True,
        cu_seqlens=d["cu_seqlens"],
    )
    assert rel(out.cpu(), cpu_out) <= 5e-3
    assert rel(final.cpu(), cpu_final) <= 1e-4


@pytest.mark.parametrize("T", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("with_state", [False, True])
def test_fixed_length_odd_T(T, with_state):
    d, g = cuda_inputs(B=3, T=T, H=2, state_dtype=torch.float32 if with_state else None)
    out, final = run_cuda(g)
    ref_out, ref_final = run_reference(d, lower_bound=-5.0)
    assert rel(out.cpu(), ref_out) <= 5e-3
    assert rel(final.cpu(), ref_final) <= 1e-3


def test_without_final_state_and_default_scale():
    d, g = cuda_inputs(B=1, T=70, H=2, state_dtype=None)
    out, final = torch_kda.kda(*positional(g), lower_bound=-1.0)
    assert final is None
    ref_out, _ = run_reference(d, lower_bound=-1.0)
    assert rel(out.cpu(), ref_out) <= 5e-3
    out2, _ = torch_kda.kda(*positional(g), lower_bound=-1.0, scale=0.3)
    ref2, _ = run_reference(d, lower_bound=-1.0, scale=0.3)
    assert rel(out2.cpu(), ref2) <= 5e-3


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_T_zero_passes_state_through(state_dtype):
    d, g = cuda_inputs(B=2, T=0, H=2, state_dtype=state_dtype)
    out, final = run_cuda(g)
    assert out.shape == (2, 0, 2, D)
    assert torch.equal(final, g["initial_state"])


def test_empty_sequences_pass_state_through():
    d, g = cuda_inputs(seqlens=[0, 5, 0], H=2, state_dtype=torch.float32)
    _, final = run_cuda(g)
    assert torch.equal(final[0], g["initial_state"][0])
    assert torch.equal(final[2], g["initial_state"][2])
    assert not torch.equal(final[1], g["initial_state"][1])


def test_non_contiguous_inputs():
    d, g = cuda_inputs(B=2, T=40, H=2)
    nc = {name: g[name].transpose(0, 1).contiguous().transpose(0, 1) for name in ("q", "k", "v", "g", "beta")}
    assert not nc["q"].is_contiguous()
    out, final = run_cuda({**g, **nc})
    out_c, final_c = run_cuda(g)
    assert torch.equal(out, out_c) and torch.equal(final, final_c)


def test_long_sequence_split_equals_whole():
    """T = 1M tokens: the whole sequence equals its two halves chained through an fp32 state."""
    T, H = 1 << 20, 1
    d, g = cuda_inputs(B=1, T=T, H=H, state_dtype=torch.float32)
    del d
    out, final = run_cuda(g)
    half = T // 2
    first = {n: g[n][:, :half] for n in ("q", "k", "v", "g", "beta")}
    second = {n: g[n][:, half:] for n in ("q", "k", "v", "g", "beta")}
    o1, f1 = torch_kda.kda(first["q"], first["k"], first["v"], first["g"], first["beta"], g["A_log"], g["dt_bias"],
                           lower_bound=-5.0, initial_state=g["initial_state"], output_final_state=True)
    o2, f2 = torch_kda.kda(second["q"], second["k"], second["v"], second["g"], second["beta"], g["A_log"],
                           g["dt_bias"], lower_bound=-5.0, initial_state=f1, output_final_state=True)
    assert torch.isfinite(out.float()).all()
    assert torch.equal(o1, out[:, :half])  # chunks are identical, so bitwise
    assert torch.equal(o2, out[:, half:])  # the half is a multiple of 16: identical chunks again
    assert torch.equal(f2, final)


# --------------------------------------------------------------------------
# Writes: poisoned outputs, determinism, in-place API
# --------------------------------------------------------------------------


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_inplace_writes_every_element(state_dtype):
    d, g = cuda_inputs(seqlens=[3, 16, 0, 45], H=2, state_dtype=state_dtype)
    out = torch.full((1, 64, 2, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    final = torch.full((4, 2, D, D), float("nan"), dtype=state_dtype, device=DEV)
    before = {n: g[n].clone() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")}
    ret = torch_kda.fwd(g["q"], g["k"], g["v"], g["g"], g["beta"], None, out, g["A_log"], g["dt_bias"], -5.0,
                        initial_state=g["initial_state"], final_state=final, cu_seqlens=g["cu_seqlens"])
    assert ret is None
    assert torch.isfinite(out.float()).all() and torch.isfinite(final.float()).all()
    ref_out, ref_final = run_reference(d, lower_bound=-5.0)
    assert rel(out.cpu(), ref_out) <= 5e-3
    for n, t in before.items():
        assert torch.equal(t, g[n]), f"{n} was modified"


# --------------------------------------------------------------------------
# Windows (forward_schedule.h): K1 and K2 window by window, states carried in fp32
# --------------------------------------------------------------------------


def run_windowed(g, window, monkeypatch, **kw):
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", str(window))
    try:
        return run_cuda(g, **kw)
    finally:
        monkeypatch.delenv("TORCH_KDA_WINDOW_SLOTS")


WINDOW_CASES = {
    # name: (inputs, windows in slots); slots are 16-token chunks
    "fixed": (dict(B=2, T=300, H=2), [1, 3, 7, 19]),
    "varlen": (dict(seqlens=[5, 16, 0, 31, 1, 47, 0, 33], H=2), [1, 2, 3, 5]),
    "varlen_empty_ends": (dict(seqlens=[0, 0, 17, 0, 16, 0], H=3), [1, 2]),
    "many_heads": (dict(B=1, T=200, H=96), [2, 5]),
}


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32, None])
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_windows_are_bitwise_one_pass(case, state_dtype, monkeypatch):
    """Windows split the call but not the arithmetic: the states wait between
    windows in fp32, as they do on chip, so every window size gives the
    one-pass result bit for bit; sequences start, end and are empty at and
    across window edges."""
    kw, windows = WINDOW_CASES[case]
    d, g = cuda_inputs(state_dtype=state_dtype or torch.float32, **kw)
    if state_dtype is None:
        g["initial_state"] = None
    one_out, one_final = run_windowed(g, 0, monkeypatch)
    for window in windows:
        out, final = run_windowed(g, window, monkeypatch)
        assert torch.equal(out, one_out), window
        assert torch.equal(final, one_final), window


def recurrence_launches(fn):
    """How many times fn launches the recurrence kernel and the prepare kernel."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum("recurrence_kernel" in n for n in names), sum("prepare_kernel" in n for n in names)


def test_window_setting_makes_windows(monkeypatch):
    """The setting really cuts the call: 2 x 300 tokens are 38 slots, so windows of
    7 slots are 6 launches of each kernel; 0 is one pass."""
    d, g = cuda_inputs(B=2, T=300, H=2)
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", "7")
    assert recurrence_launches(lambda: run_cuda(g)) == (6, 6)
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", "0")
    assert recurrence_launches(lambda: run_cuda(g)) == (1, 1)


def test_windows_with_eight_warp_blocks(monkeypatch):
    d, g = cuda_inputs(seqlens=[70, 0, 33, 129], H=3, state_dtype=torch.float32)
    monkeypatch.setenv("TORCH_KDA_RECURRENCE_BLOCK", "8x1")
    one_out, one_final = run_windowed(g, 0, monkeypatch)
    out, final = run_windowed(g, 4, monkeypatch)
    assert torch.equal(out, one_out) and torch.equal(final, one_final)


def test_outputs_overlapping_inputs_keep_one_pass(monkeypatch):
    """out may share memory with the inputs (one pass reads every input before it
    writes): with windows forced, a later window's K1 would read q where an earlier
    window's K2 had written out, so the call stays in one pass."""
    T, S, H = 200, 64, 2
    d, g = cuda_inputs(B=1, T=T, H=H, state_dtype=torch.float32)
    clean_out, clean_final = run_windowed(g, 0, monkeypatch)
    buf = torch.empty(1, T + S, H, D, dtype=torch.bfloat16, device=DEV)
    buf[:, :T] = g["q"]
    q_view, out_view = buf[:, :T], buf[:, S:]
    final = torch.full_like(clean_final, float("nan"))
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", "2")
    torch_kda.fwd(q_view, g["k"], g["v"], g["g"], g["beta"], None, out_view, g["A_log"], g["dt_bias"], -5.0,
                  initial_state=g["initial_state"], final_state=final)
    torch.cuda.synchronize()
    assert torch.equal(out_view, clean_out)
    assert torch.equal(final, clean_final)


def test_out_overlapping_v_reads_v_from_a_copy():
    """K2 reads v as it writes out (the forward's record leaves v to it): out S
    tokens on in v's own buffer, more than the chunks K2 stages ahead, would feed
    the recurrence its own output if v were read in place."""
    T, S, H = 200, 48, 2
    d, g = cuda_inputs(B=1, T=T, H=H, state_dtype=torch.float32)
    nan = float("nan")
    clean_out = torch.full_like(g["v"], nan)
    clean_final = torch.full_like(g["initial_state"], nan)
    torch_kda.fwd(*positional(g)[:5], None, clean_out, g["A_log"], g["dt_bias"], -5.0,
                  initial_state=g["initial_state"], final_state=clean_final)
    buf = torch.empty(1, T + S, H, D, dtype=torch.bfloat16, device=DEV)
    buf[:, :T] = g["v"]
    v_view, out_view = buf[:, :T], buf[:, S:]
    final = torch.full_like(clean_final, nan)
    torch_kda.fwd(g["q"], g["k"], v_view, g["g"], g["beta"], None, out_view, g["A_log"], g["dt_bias"], -5.0,
                  initial_state=g["initial_state"], final_state=final)
    torch.cuda.synchronize()
    assert torch.equal(out_view, clean_out)
    assert torch.equal(final, clean_final)
    ref_out, ref_final = run_reference(g, lower_bound=-5.0)
    assert rel(clean_out, ref_out) <= 5e-3 and rel(clean_final, ref_final) <= FP32_STATE_TOL


def test_misaligned_v_is_staged():
    """K2 copies v in 16-byte pieces: a v view that starts mid-vector is staged, not misread."""
    d, g = cuda_inputs(seqlens=[20, 37], H=2, state_dtype=torch.float32)
    v_buf = torch.empty(g["v"].numel() + 1, dtype=torch.bfloat16, device=DEV)
    v_mis = v_buf[1:].view_as(g["v"])
    v_mis.copy_(g["v"])
    want_out, want_final = run_cuda(g)
    got_out, got_final = run_cuda({**g, "v": v_mis})
    assert torch.equal(got_out, want_out) and torch.equal(got_final, want_final)


def test_windows_write_every_element_and_allow_inplace_state(monkeypatch):
    """Poisoned outputs, and final_state given as the initial state's own buffer:
    window 0 reads it, the last window writes it."""
    d, g = cuda_inputs(seqlens=[3, 40, 0, 45, 19], H=2, state_dtype=torch.float32)
    ref_out, ref_final = run_reference(d, lower_bound=-5.0)
    state = g["initial_state"].clone()
    out = torch.full((1, 107, 2, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", "2")
    torch_kda.fwd(g["q"], g["k"], g["v"], g["g"], g["beta"], None, out, g["A_log"], g["dt_bias"], -5.0,
                  initial_state=state, final_state=state, cu_seqlens=g["cu_seqlens"])
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    assert rel(out.cpu(), ref_out) <= 5e-3
    assert rel(state.cpu(), ref_final) <= FP32_STATE_TOL


@pytest.mark.parametrize("T,H", [(65536, 16), (32768, 32)])
def test_automatic_windows_match_reference(T, H, monkeypatch):
    """Few heads and many tokens: a one-pass workspace of 1.8 GB, so the call
    runs in windows by itself (test_automatic_windows_bound_memory); same bits
    as one pass, and the reference's values."""
    monkeypatch.delenv("TORCH_KDA_WINDOW_SLOTS", raising=False)
    d, g = cuda_inputs(B=1, T=T, H=H, state_dtype=torch.float32)
    e_out, e_state, out, final = errors(d, g)
    print(f"H={H} in windows: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= 5e-3 and e_state <= FP32_STATE_TOL
    one_out, one_final = run_windowed(g, 0, monkeypatch)
    assert torch.equal(out, one_out) and torch.equal(final, one_final)


def test_automatic_windows_bound_memory(monkeypatch):
    monkeypatch.delenv("TORCH_KDA_WINDOW_SLOTS", raising=False)
    T, H = 65536, 16
    d, g = cuda_inputs(B=1, T=T, H=H, state_dtype=torch.float32)
    one_pass_workspace = (T // 16) * H * 27136
    peaks = {}
    for window in (None, 0):
        if window is not None:
            monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", str(window))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_cuda(g)
        torch.cuda.synchronize()
        peaks[window] = torch.cuda.max_memory_allocated() - base
    print(f"peak: automatic {peaks[None] / 2**20:.0f} MiB, one pass {peaks[0] / 2**20:.0f} MiB")
    assert peaks[0] >= one_pass_workspace
    # Two equal windows of 2048 slots (0.89 GB each; one window of all 4096 is over 1 GiB) and the
    # fp32 carry, where one pass holds 1.78 GB; the rest (out) is the same.
    carry = H * D * D * 4
    assert peaks[None] <= peaks[0] - one_pass_workspace + 2**30 + carry
    monkeypatch.delenv("TORCH_KDA_WINDOW_SLOTS")
    assert recurrence_launches(lambda: run_cuda(g)) == (2, 2)


def test_window_setting_is_checked(monkeypatch):
    d, g = cuda_inputs(B=1, T=40, H=2)
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", "three")
    with pytest.raises(RuntimeError, match="TORCH_KDA_WINDOW_SLOTS must be a non-negative integer, got 'three'"):
        run_cuda(g)


def test_bad_block_setting_in_windows_raises_before_any_launch(monkeypatch):
    """Both settings are read before anything is enqueued: no kernel of the
    failed call behind."""
    d, g = cuda_inputs(B=1, T=200, H=2)
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", "3")
    monkeypatch.setenv("TORCH_KDA_RECURRENCE_BLOCK", "16x1")

    def call():
        with pytest.raises(RuntimeError, match="TORCH_KDA_RECURRENCE_BLOCK must be one of"):
            run_cuda(g)

    assert recurrence_launches(call) == (0, 0)


@pytest.mark.parametrize("final_dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_inplace_final_state_without_initial_state(final_dtype):
    """The first prefill of the flash_kda drop-in: no initial state, a final_state buffer
    of the caller's dtype. The kernels write fp32 then, so other dtypes are staged."""
    d, g = cuda_inputs(seqlens=[20, 0, 37], H=2, state_dtype=None)
    out = torch.full((1, 57, 2, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    guard = torch.full((4, 2, D, D), float("nan"), dtype=final_dtype, device=DEV)
    final = guard[:3]  # the slice after it shows any write past the end
    torch_kda.fwd(*positional(g)[:5], None, out, g["A_log"], g["dt_bias"], -5.0, final_state=final,
                  cu_seqlens=g["cu_seqlens"])
    torch.cuda.synchronize()
    assert torch.isnan(guard[3].float()).all(), "written past the end of final_state"
    ref_out, ref_final = run_reference(g, lower_bound=-5.0)
    assert rel(out, ref_out) <= 5e-3
    assert rel(final, ref_final) <= (5e-3 if final_dtype == torch.bfloat16 else FP32_STATE_TOL)


def test_inplace_state_overlaps():
    """The same buffer as initial and final state is allowed; a shifted view of it, or
    out sharing memory with the initial state, must not race between blocks."""
    d, g = cuda_inputs(seqlens=[16, 16], H=2, state_dtype=torch.float32)
    ref_out, ref_final = run_reference(g, lower_bound=-5.0)
    out = torch.empty(1, 32, 2, D, dtype=torch.bfloat16, device=DEV)

    same = g["initial_state"].clone()
    torch_kda.fwd(*positional(g)[:5], None, out, g["A_log"], g["dt_bias"], -5.0, initial_state=same,
                  final_state=same, cu_seqlens=g["cu_seqlens"])
    assert rel(same, ref_final) <= FP32_STATE_TOL and rel(out, ref_out) <= 5e-3

    buf = torch.empty(3, 2, D, D, dtype=torch.float32, device=DEV)
    buf[:2] = g["initial_state"]
    torch_kda.fwd(*positional(g)[:5], None, out, g["A_log"], g["dt_bias"], -5.0, initial_state=buf[:2],
                  final_state=buf[1:], cu_seqlens=g["cu_seqlens"])
    assert rel(buf[1:], ref_final) <= FP32_STATE_TOL


def test_inplace_out_overlapping_final_state_is_rejected():
    _, g = cuda_inputs(B=1, T=16, H=2, state_dtype=torch.float32)
    buf = torch.empty(16 * 2 * D + 2 * D * D, dtype=torch.float32, device=DEV)
    out = buf[: 16 * 2 * D].view(torch.bfloat16)[: 16 * 2 * D].view(1, 16, 2, D)
    final = buf[8 * D:8 * D + 2 * D * D].view(1, 2, D, D)  # starts inside out's bytes
    with pytest.raises(RuntimeError, match="out and final_state must not share memory"):
        torch_kda.fwd(*positional(g)[:5], None, out, g["A_log"], g["dt_bias"], -5.0,
                      initial_state=g["initial_state"], final_state=final)


def test_inplace_misaligned_views():
    """Views that start mid-vector (the kernels move 16-byte vectors) are staged, not misread."""
    d, g = cuda_inputs(seqlens=[20, 37], H=2, state_dtype=torch.float32)
    nan = float("nan")
    out_buf = torch.full((57 * 2 * D + 1,), nan, dtype=torch.bfloat16, device=DEV)
    out = out_buf[1:].view(1, 57, 2, D)
    init_buf = torch.empty(2 * 2 * D * D + 1, dtype=torch.float32, device=DEV)
    init = init_buf[1:].view(2, 2, D, D)
    init.copy_(g["initial_state"])
    final_buf = torch.full((2 * 2 * D * D + 1,), nan, dtype=torch.float32, device=DEV)
    final = final_buf[1:].view(2, 2, D, D)
    torch_kda.fwd(*positional(g)[:5], None, out, g["A_log"], g["dt_bias"], -5.0, initial_state=init,
                  final_state=final, cu_seqlens=g["cu_seqlens"])
    ref_out, ref_final = run_reference(g, lower_bound=-5.0)
    assert torch.isnan(out_buf[0].float()) and torch.isnan(final_buf[0])
    assert rel(out, ref_out) <= 5e-3 and rel(final, ref_final) <= FP32_STATE_TOL


def test_cpu_q_with_cuda_tensors_names_the_argument():
    d, g = cuda_inputs(B=1, T=8, H=2)
    with pytest.raises(RuntimeError, match="A_log must be on the same device as q"):
        torch_kda.kda(*positional(d)[:5], g["A_log"], d["dt_bias"], lower_bound=-5.0)


def test_deterministic():
    d, g = cuda_inputs(seqlens=[100, 7, 513], H=4)
    out1, final1 = run_cuda(g)
    for _ in range(3):
        out2, final2 = run_cuda(g)
        assert torch.equal(out1, out2) and torch.equal(final1, final2)


# --------------------------------------------------------------------------
# Composition: CUDA graphs, torch.compile, opcheck, CPU agreement
# --------------------------------------------------------------------------


@pytest.mark.parametrize("window", ["0", "3"])
def test_cuda_graph_capture_and_replay(window, monkeypatch):
    """window "3": the call runs in windows of 3 chunk slots, so the graph holds
    several launches of each kernel and the carry between them."""
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", window)
    d, g = cuda_inputs(seqlens=[40, 0, 100, 17], H=2, state_dtype=torch.float32)
    out = torch.empty(1, 157, 2, D, dtype=torch.bfloat16, device=DEV)
    final = torch.empty(4, 2, D, D, dtype=torch.float32, device=DEV)

    def step():
        torch_kda.fwd(g["q"], g["k"], g["v"], g["g"], g["beta"], None, out, g["A_log"], g["dt_bias"], -5.0,
                      initial_state=g["initial_state"], final_state=final, cu_seqlens=g["cu_seqlens"])

    graph, _ = capture_graph(step)

    for lengths in ([40, 0, 100, 17], [1, 60, 60, 36]):
        d2, g2 = cuda_inputs(seqlens=lengths, H=2, state_dtype=torch.float32)
        for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens"):
            g[name].copy_(g2[name])
        out.fill_(float("nan"))
        final.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_final = run_cuda(g2)
        assert torch.equal(out, eager_out)
        assert torch.equal(final, eager_final)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_compile_reduce_overhead(lower_bound):
    d, g = cuda_inputs(B=2, T=64, H=2, state_dtype=torch.float32)

    class Model(torch.nn.Module):
        def forward(self, q, k, v, gg, beta, A_log, dt_bias, h0):
            o, s = torch_kda.kda(q, k, v, gg, beta, A_log, dt_bias, lower_bound=lower_bound, initial_state=h0,
                                 output_final_state=True)
            return o.float() * 2, s

    model = Model()
    args = (*positional(g), g["initial_state"])
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        c_out, c_state = compiled(*args)
    e_out, e_state = model(*args)
    assert torch.equal(c_out, e_out) and torch.equal(c_state, e_state)


def test_opcheck_cuda():
    samples = []
    for seqlens, state in (([10, 0, 33], torch.float32), (None, torch.bfloat16), (None, None)):
        kw = {"seqlens": seqlens} if seqlens else {"B": 2, "T": 21}
        _, g = cuda_inputs(H=2, state_dtype=state, **kw)
        samples.append(g)
    for g in samples:
        torch.library.opcheck(
            torch.ops.kda.fwd.default, positional(g),
            {"lower_bound": -5.0, "initial_state": g["initial_state"], "output_final_state": True,
             "cu_seqlens": g["cu_seqlens"]},
        )
        N = g["initial_state"].shape[0] if g["initial_state"] is not None else (
            g["cu_seqlens"].numel() - 1 if g["cu_seqlens"] is not None else g["q"].shape[0])
        out = torch.empty(*g["q"].shape[:3], D, dtype=torch.bfloat16, device=DEV)
        final = torch.empty(N, 2, D, D, dtype=torch.float32, device=DEV)
        if g["initial_state"] is not None:
            final = final.to(g["initial_state"].dtype)
        torch.library.opcheck(
            torch.ops.kda.fwd_.default, (*positional(g), out, final),
            {"lower_bound": -5.0, "initial_state": g["initial_state"], "cu_seqlens": g["cu_seqlens"]},
        )


def test_cpu_and_cuda_agree():
    d, g = cuda_inputs(seqlens=[200, 3, 64], H=2, state_dtype=torch.float32)
    out, final = run_cuda(g)
    cpu_out, cpu_final = torch_kda.kda(
        *positional(d), lower_bound=-5.0, initial_state=d["initial_state"], output_final_state=True,
        cu_seqlens=d["cu_seqlens"],
    )
    assert rel(out.cpu(), cpu_out) <= 5e-3
    assert rel(final.cpu(), cpu_final) <= 1e-4


# --------------------------------------------------------------------------
# What the CUDA kernels refuse, before any kernel runs
# --------------------------------------------------------------------------


def test_cuda_limits_are_errors():
    _, g = cuda_inputs(B=1, T=8, H=2)
    args = positional(g)
    with pytest.raises(RuntimeError, match=r"lower_bound must be in \[-5, 0\) or None"):
        torch_kda.kda(*args, lower_bound=-6.0)
    with pytest.raises(RuntimeError, match="q, k, v, g and beta must have dtype bfloat16"):
        torch_kda.kda(*(a.float() if a.dtype == torch.bfloat16 else a for a in args), lower_bound=-5.0)
    small = make_inputs(B=1, T=8, H=2, K=64, V=64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="K must be 128"):
        torch_kda.kda(*(t.to(DEV) for t in positional(small)), lower_bound=-5.0)
    with pytest.raises(RuntimeError, match="must be on the same device as q"):
        torch_kda.kda(*args[:5], g["A_log"].cpu(), g["dt_bias"], lower_bound=-5.0)


def test_bad_cu_seqlens_checked_with_env(monkeypatch):
    _, g = cuda_inputs(seqlens=[4, 4], H=2)
    bad = torch.tensor([0, 6, 5], dtype=torch.int64, device=DEV)
    monkeypatch.setenv("TORCH_KDA_CHECK", "1")
    with pytest.raises(RuntimeError, match="cu_seqlens must be non-decreasing"):
        torch_kda.kda(*positional(g), lower_bound=-5.0, cu_seqlens=bad)
    monkeypatch.setenv("TORCH_KDA_CHECK", "0")
    out = torch.full((1, 8, 2, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    # Unchecked, a malformed cu_seqlens gives wrong numbers but stays in bounds.
    torch_kda.fwd(*positional(g)[:5], None, out, g["A_log"], g["dt_bias"], -5.0, cu_seqlens=bad)
    torch.cuda.synchronize()


@pytest.mark.parametrize("bad", [[0, 6, 5], [0, 3, 100], [-5, 4, 8], [2, 2, 8], [0, 8, 0]])
def test_malformed_cu_seqlens_read_clamped_and_non_decreasing(bad, monkeypatch):
    """Unchecked, cu_seqlens is read clamped into [0, tokens] and made non-decreasing
    (running maximum): bitwise the result of those sanitised offsets."""
    monkeypatch.delenv("TORCH_KDA_CHECK", raising=False)
    _, g = cuda_inputs(seqlens=[4, 4], H=2, state_dtype=torch.float32)
    sane = torch.tensor(bad).clamp(0, 8).cummax(0).values
    results = []
    for cu in (torch.tensor(bad, device=DEV), sane.to(DEV)):
        out = torch.full((1, 8, 2, D), float("nan"), dtype=torch.bfloat16, device=DEV)
        final = torch.full((2, 2, D, D), float("nan"), dtype=torch.float32, device=DEV)
        torch_kda.fwd(*positional(g)[:5], None, out, g["A_log"], g["dt_bias"], -5.0,
                      initial_state=g["initial_state"], final_state=final, cu_seqlens=cu)
        results.append((out.float().nan_to_num(7.0), final.nan_to_num(7.0)))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_backward_zeros_the_tokens_no_sequence_covers(monkeypatch):
    """Unchecked, a malformed cu_seqlens that starts past 0 and ends before the
    last token leaves tokens no chunk covers: their gradients are zeros (the
    allocations NaN-filled first), the others bitwise those of the covered
    tokens alone."""
    from conftest import nan_filled_empty

    monkeypatch.delenv("TORCH_KDA_CHECK", raising=False)
    _, g = cuda_inputs(seqlens=[40, 40], H=2, state_dtype=torch.float32)
    bad = torch.tensor([5, 30, 60], device=DEV)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    kw = dict(lower_bound=-5.0, initial_state=g["initial_state"])
    with nan_filled_empty():
        got = torch.ops.kda.bwd(grad_out, None, *positional(g), cu_seqlens=bad, **kw)
    part = [t[:, 5:60] for t in positional(g)[:5]] + list(positional(g)[5:])
    want = torch.ops.kda.bwd(grad_out[:, 5:60], None, *part, cu_seqlens=torch.tensor([0, 25, 55], device=DEV), **kw)
    for name, x, y in zip(GRAD_NAMES[:5], got, want):
        assert not torch.isnan(x.float()).any(), name
        assert torch.equal(x[:, :5], torch.zeros_like(x[:, :5])) and torch.equal(x[:, 60:], torch.zeros_like(x[:, 60:]))
        assert torch.equal(x[:, 5:60], y), name


# --------------------------------------------------------------------------
# Backward (kernels: K1, K2 with chunk-start states, the sweep, K1's backward)
# --------------------------------------------------------------------------

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


def cuda_and_reference_grads(d, g, with_final=True):
    """kda.bwd on the GPU (bf16 inputs) and on the CPU in float64 from the same values."""
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    gf = torch.randn(*g["initial_state"].shape, device=DEV) if with_final else None
    kw = dict(lower_bound=-5.0, cu_seqlens=g["cu_seqlens"])
    got = torch.ops.kda.bwd(grad_out, gf, *positional(g), initial_state=g["initial_state"], **kw)
    d64 = {n: (t.cpu().double() if t is not None and t.is_floating_point() else (t.cpu() if t is not None else None))
           for n, t in g.items()}
    kw["cu_seqlens"] = d64["cu_seqlens"]
    ref = torch.ops.kda.bwd(grad_out.cpu().double(), gf.cpu().double() if gf is not None else None,
                            *positional(d64), initial_state=d64["initial_state"], **kw)
    return got, ref


def check_grads(label, got, ref):
    for name, x, r in zip(GRAD_NAMES, got, ref):
        if r.numel() == 0:
            assert x.numel() == 0, name
            continue
        e = rel(x.cpu(), r)
        print(f"\n{label} {name}: rel {e:.2e}", end="")
        assert torch.isfinite(x).all(), name
        assert e <= GRAD_TOL[name], f"{name}: rel {e:.2e}"


@pytest.mark.parametrize("varlen", [False, True])
def test_backward_matches_float64_reference(varlen):
    kw = dict(seqlens=[1024, 300, 0, 777, 1]) if varlen else dict(B=2, T=1024)
    d, g = cuda_inputs(H=4, state_dtype=torch.float32, **kw)
    got, ref = cuda_and_reference_grads(d, g)
    check_grads("varlen" if varlen else "fixed", got, ref)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("case", ["random", "weak_decay", "small_beta"])
def test_backward_odd_length_and_hard_cases(with_state, case):
    d, g = cuda_inputs(B=3, T=37, H=2, state_dtype=torch.float32 if with_state else None)
    _hard_case(case, d, g)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    got = torch.ops.kda.bwd(grad_out, None, *positional(g), lower_bound=-5.0, initial_state=g["initial_state"])
    d64 = {n: (t.cpu().double() if t is not None and t.is_floating_point() else t) for n, t in g.items()}
    ref = torch.ops.kda.bwd(grad_out.cpu().double(), None, *positional(d64), lower_bound=-5.0,
                            initial_state=d64["initial_state"])
    check_grads(case, got, ref)


def test_opcheck_cuda_bwd():
    for seqlens, state in (([10, 0, 33], torch.float32), (None, None)):
        kw = {"seqlens": seqlens} if seqlens else {"B": 2, "T": 21}
        _, g = cuda_inputs(H=2, state_dtype=state, **kw)
        grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
        gf = torch.randn(*g["initial_state"].shape, device=DEV) if state is not None else None
        torch.library.opcheck(
            torch.ops.kda.bwd.default, (grad_out, gf, *positional(g)),
            {"lower_bound": -5.0, "initial_state": g["initial_state"], "cu_seqlens": g["cu_seqlens"]},
        )


def test_backward_grad_out_dtypes_agree():
    """The sweep reads grad_out as bf16 or fp32 as given (fp64 as fp32);
    the same values in each give the same bits, and a misaligned view is staged."""
    _, g = cuda_inputs(seqlens=[40, 0, 77], H=2, state_dtype=torch.float32)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    gf = torch.randn(*g["initial_state"].shape, device=DEV)
    kw = {"lower_bound": -5.0, "initial_state": g["initial_state"], "cu_seqlens": g["cu_seqlens"]}
    want = torch.ops.kda.bwd(grad_out, gf, *positional(g), **kw)
    shifted = torch.empty(grad_out.numel() + 1, dtype=torch.bfloat16, device=DEV)[1:].view(grad_out.shape)
    shifted.copy_(grad_out)
    for go in (grad_out.float(), grad_out.double(), shifted):
        got = torch.ops.kda.bwd(go, gf, *positional(g), **kw)
        for name, x, y in zip(GRAD_NAMES, got, want):
            assert torch.equal(x, y), (go.dtype, name)


def test_backward_misaligned_grad_final_state():
    """A grad_final_state view that starts mid-vector (as cat's backward hands out)
    is staged, not read misaligned: the same bits as an aligned copy."""
    _, g = cuda_inputs(B=2, T=50, H=2, state_dtype=torch.float32)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    gf = torch.randn(*g["initial_state"].shape, device=DEV)
    shifted = torch.empty(gf.numel() + 1, device=DEV)[1:].view(gf.shape)
    shifted.copy_(gf)
    kw = {"lower_bound": -5.0, "initial_state": g["initial_state"]}
    want = torch.ops.kda.bwd(grad_out, gf, *positional(g), **kw)
    got = torch.ops.kda.bwd(grad_out, shifted, *positional(g), **kw)
    torch.cuda.synchronize()
    for name, x, y in zip(GRAD_NAMES, got, want):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, None])
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_backward_windows_are_bitwise_one_pass(case, state_dtype, monkeypatch):
    """The backward in windows of slots (a forward pass for the window-start
    checkpoints, then the windows from the last to the first, with dS waiting
    between them in fp32) gives the one-pass gradients bit for bit; sequences
    start, end and are empty at and across window edges, with and without a
    gradient flowing into the final state, with an fp32, a bf16 or no initial
    state."""
    kw, windows = WINDOW_CASES[case]
    _, g = cuda_inputs(state_dtype=state_dtype or torch.float32, **kw)
    state_shape = g["initial_state"].shape
    if state_dtype is None:
        g["initial_state"] = None
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    for gf in (torch.randn(*state_shape, device=DEV), None):
        def grads(window):
            monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", str(window))
            try:
                return torch.ops.kda.bwd(grad_out, gf, *positional(g), lower_bound=-5.0,
                                         initial_state=g["initial_state"], cu_seqlens=g["cu_seqlens"])
            finally:
                monkeypatch.delenv("TORCH_KDA_WINDOW_SLOTS")
        want = grads(0)
        for window in windows:
            got = grads(window)
            for name, x, y in zip(GRAD_NAMES, got, want):
                assert torch.equal(x, y), (window, gf is None, name)


def test_backward_window_setting_makes_windows(monkeypatch):
    """The setting really cuts the backward: 2 x 300 tokens are 38 slots, so windows
    of 7 slots are 6 launches of the dS recurrence (one per window); 0 is one pass."""
    _, g = cuda_inputs(B=2, T=300, H=2, state_dtype=torch.float32)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)

    def ds_launches():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.ops.kda.bwd(grad_out, None, *positional(g), lower_bound=-5.0, initial_state=g["initial_state"])
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return sum("ds_recurrence_kernel" in n for n in names)

    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", "7")
    assert ds_launches() == 6
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", "0")
    assert ds_launches() == 1


def test_backward_windows_engage_and_bound_memory(monkeypatch):
    """Long few-head calls get windows without any setting: less memory than the
    one-pass scratch (7.75 KB per token and head: 1984 MiB here),
    the one-pass gradients."""
    monkeypatch.delenv("TORCH_KDA_WINDOW_SLOTS", raising=False)
    _, g = cuda_inputs(B=1, T=16384, H=16, state_dtype=torch.float32)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    kw = dict(lower_bound=-5.0, initial_state=g["initial_state"])
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = torch.ops.kda.bwd(grad_out, None, *positional(g), **kw)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    one_pass_scratch = 16384 * 16 * 7936
    print(f"\nbackward peak {peak / 2**20:.0f} MiB (one-pass scratch alone {one_pass_scratch / 2**20:.0f} MiB)", end="")
    assert peak < one_pass_scratch * 3 / 4
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", "0")
    want = torch.ops.kda.bwd(grad_out, None, *positional(g), **kw)
    for name, x, y in zip(GRAD_NAMES, got, want):
        assert torch.equal(x, y), name


# Slots of a backward window of ~1 GiB of scratch (csrc/checkpoints.cpp; 27136
# + 2 * 32768 + 34304 bytes per slot and head), where one pass would hold too much.
RECORD_FLOATS = 6784  # 27,136 bytes a record (csrc/cuda/params.h)


def _window_floor(H):
    return max((1 << 30) // (H * 126976), 16)


def _recurrence_launches(fn):
    """fn's result and its launches of K1 (prepare_kernel) and of K2 (the
    recurrence_kernel, not the dS recurrence's)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    k2 = sum("recurrence_kernel" in n and "ds_recurrence" not in n for n in names)
    return result, sum("prepare_kernel" in n for n in names), k2


def _assert_checkpoints_are_prefix_states(g, ckpt):
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


@pytest.mark.parametrize("window,T,H,windows,state_dtype", [
    (None, 10000, 16, 2, torch.float32), (None, 4000, 96, 3, torch.float32), ("7", 4000, 96, 36, torch.float32),
    ("0", 300, 2, 1, torch.float32), (None, 4000, 96, 3, torch.bfloat16), (None, 10000, 16, 2, torch.bfloat16)])
def test_forward_checkpoints_serve_the_backward_bitwise(window, T, H, windows, state_dtype, monkeypatch):
    """kda._fwd_checkpointed returns fwd's outputs bit for bit, the state at
    every chunk slot's start in bf16 (bitwise a prefix forward's final state,
    rounded) and K1's records, in one pass unless windows are forced. kda.bwd
    given the states runs no K2 (against one pass per window and the checkpoint
    pass without them: K1 once per window, against twice but once), given the
    records too no K1 for the records either, and gives the gradients it gives
    without them, bit for bit, also when called again: the checkpoints and
    records are left as they were. TORCH_KDA_WINDOW_SLOTS moves the windows (7
    slots: 36 of them) but not the checkpoints. With a bf16 state (bf16 products; at 96
    heads the 4x1w shape, at 16 the 2x2) too: the backward's own passes recompute the
    forward's states."""
    if window is None:
        monkeypatch.delenv("TORCH_KDA_WINDOW_SLOTS", raising=False)
    else:
        monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", window)
    _, g = cuda_inputs(B=1, T=T, H=H, state_dtype=state_dtype)
    init = g["initial_state"]
    (out, final, ckpt, records), k1_fwd, _ = _recurrence_launches(
        lambda: torch.ops.kda._fwd_checkpointed(*positional(g), None, -5.0, init, True, None))
    assert k1_fwd == (36 if window == "7" else 1)
    want_out, want_final = torch.ops.kda.fwd(*positional(g), None, -5.0, init, True, None)
    assert torch.equal(out, want_out) and torch.equal(final, want_final)
    assert ckpt.shape == (math.ceil(T / 16), H, D, D) and ckpt.dtype == torch.bfloat16
    assert records.shape == (math.ceil(T / 16), H, RECORD_FLOATS) and records.dtype == torch.float32
    _assert_checkpoints_are_prefix_states(g, ckpt)

    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    gf = torch.randn_like(init)
    kw = dict(lower_bound=-5.0, initial_state=init)
    saved, saved_records = ckpt.clone(), records.clone()
    want, k1_without, k2_without = _recurrence_launches(lambda: torch.ops.kda.bwd(grad_out, gf, *positional(g), **kw))
    got, k1_with, k2_with = _recurrence_launches(
        lambda: torch.ops.kda.bwd(grad_out, gf, *positional(g), checkpoints=ckpt, **kw))
    both, k1_both, k2_both = _recurrence_launches(
        lambda: torch.ops.kda.bwd(grad_out, gf, *positional(g), checkpoints=ckpt, records=records, **kw))
    again = torch.ops.kda.bwd(grad_out, gf, *positional(g), checkpoints=ckpt, records=records, **kw)
    assert (k1_with, k2_with) == (windows, 0)
    assert (k1_both, k2_both) == (0, 0)
    assert k1_without == k2_without == 2 * windows - 1
    assert torch.equal(ckpt, saved) and torch.equal(records, saved_records)
    for name, x, y, z, w in zip(GRAD_NAMES, got, want, again, both):
        assert torch.equal(x, y) and torch.equal(z, y) and torch.equal(w, y), name


@pytest.mark.parametrize("window", ["0", "5"])
def test_forward_checkpoints_serve_a_varlen_backward_bitwise(window, monkeypatch):
    """A varlen batch (an empty sequence, partial chunks): kda._fwd_checkpointed's
    checkpoints and records (min(T, ceil(T / 16) + N) slots, the last N zeroed
    before the forward, so that the outputs hold no uninitialised memory:
    NaN-filled allocations here) give kda.bwd the gradients it gives without
    them, bit for bit, in one pass and in windows of 5 slots, with no K2 launch
    (the states alone) and no K1 for the records either (both)."""
    from conftest import nan_filled_empty

    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", window)
    _, g = cuda_inputs(seqlens=[37, 0, 100, 16], H=3, state_dtype=torch.float32)
    init = g["initial_state"]
    with nan_filled_empty():
        out, final, ckpt, records = torch.ops.kda._fwd_checkpointed(*positional(g), None, -5.0, init, True,
                                                                    g["cu_seqlens"])
    assert ckpt.shape == (min(153, math.ceil(153 / 16) + 4), 3, D, D)  # 14 slots, 3 + 7 + 1 chunks
    assert records.shape == (14, 3, RECORD_FLOATS)
    assert not torch.isnan(ckpt.float()).any() and not torch.isnan(records).any()
    assert torch.equal(ckpt[11:], torch.zeros_like(ckpt[11:]))
    assert torch.equal(records[11:], torch.zeros_like(records[11:]))
    want_out, want_final = torch.ops.kda.fwd(*positional(g), None, -5.0, init, True, g["cu_seqlens"])
    assert torch.equal(out, want_out) and torch.equal(final, want_final)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    gf = torch.randn_like(init)
    kw = dict(lower_bound=-5.0, initial_state=init, cu_seqlens=g["cu_seqlens"])
    want = torch.ops.kda.bwd(grad_out, gf, *positional(g), **kw)
    got, _, k2 = _recurrence_launches(lambda: torch.ops.kda.bwd(grad_out, gf, *positional(g), checkpoints=ckpt, **kw))
    both, k1_both, k2_both = _recurrence_launches(
        lambda: torch.ops.kda.bwd(grad_out, gf, *positional(g), checkpoints=ckpt, records=records, **kw))
    assert k2 == 0 and (k1_both, k2_both) == (0, 0)
    for name, x, y, z in zip(GRAD_NAMES, got, want, both):
        assert torch.equal(x, y) and torch.equal(z, y), name


def test_save_states_off_keeps_nothing(monkeypatch):
    """TORCH_KDA_SAVE_STATES=0: the forward keeps no states and no records
    (empty outputs) and torch_kda.kda's backward recomputes them (K2 and K1 run
    there); TORCH_KDA_SAVE_RECORDS=0 keeps the states alone (K1 runs there);
    the same gradients bit for bit as with both kept (neither runs)."""
    _, g = cuda_inputs(B=1, T=300, H=2, state_dtype=torch.float32)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")

    def grads_and_launches(states, records):
        monkeypatch.setenv("TORCH_KDA_SAVE_STATES", states)
        monkeypatch.setenv("TORCH_KDA_SAVE_RECORDS", records)
        leaves = {n: g[n].detach().clone().requires_grad_() for n in names}
        out, _ = torch_kda.kda(*(leaves[n] for n in names), lower_bound=-5.0, initial_state=g["initial_state"])
        _, k1, k2 = _recurrence_launches(lambda: out.backward(torch.ones_like(out)))
        return [leaves[n].grad for n in names], (k1, k2)

    monkeypatch.setenv("TORCH_KDA_SAVE_STATES", "0")
    monkeypatch.delenv("TORCH_KDA_SAVE_RECORDS", raising=False)
    _, _, ckpt, records = torch.ops.kda._fwd_checkpointed(*positional(g), None, -5.0, None, False, None)
    assert ckpt.shape == (0, 2, D, D) and records.shape == (0, 2, RECORD_FLOATS)
    monkeypatch.setenv("TORCH_KDA_SAVE_STATES", "1")
    monkeypatch.setenv("TORCH_KDA_SAVE_RECORDS", "0")
    _, _, ckpt, records = torch.ops.kda._fwd_checkpointed(*positional(g), None, -5.0, None, False, None)
    assert ckpt.shape == (19, 2, D, D) and records.shape == (0, 2, RECORD_FLOATS)
    off, launches_off = grads_and_launches("0", "")
    states, launches_states = grads_and_launches("1", "0")
    on, launches_on = grads_and_launches("1", "1")
    assert (launches_off, launches_states, launches_on) == ((1, 1), (1, 0), (0, 0))
    for name, x, y, z in zip(names, off, states, on):
        assert torch.equal(x, z) and torch.equal(y, z), name


@pytest.mark.parametrize("shape", ["8x1", "4x1", "4x1w", "2x1", "2x2", "4x4"])
def test_backward_and_checkpoints_in_every_block_shape(shape, monkeypatch):
    """Each K2 block shape in the backward's passes (K2 without output), in
    windows of 5 slots (the checkpoint pass and the carries too): gradients
    against float64; and in the forward's chunk-state stores: bitwise a prefix
    forward's final states, rounded (4000 tokens x 96 heads)."""
    monkeypatch.setenv("TORCH_KDA_RECURRENCE_BLOCK", shape)
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", "5")
    d, g = cuda_inputs(B=2, T=300, H=4, state_dtype=torch.float32)
    got, ref = cuda_and_reference_grads(d, g)
    check_grads(shape, got, ref)
    _, g = cuda_inputs(B=1, T=4000, H=96, state_dtype=torch.float32)
    _, _, ckpt, _ = torch.ops.kda._fwd_checkpointed(*positional(g), None, -5.0, g["initial_state"], False, None)
    _assert_checkpoints_are_prefix_states(g, ckpt)


@pytest.mark.parametrize("ds_block", ["1x1", "2x1", "4x1", "2x2", "4x2", "8x2"])
def test_backward_in_every_ds_block_shape(ds_block, monkeypatch):
    """Each block shape of the dS recurrence (TORCH_KDA_DS_BLOCK) in the whole
    backward, in windows of 5 slots (dS through the carries), on a varlen batch
    with an empty sequence and partial chunks: gradients against float64."""
    monkeypatch.setenv("TORCH_KDA_DS_BLOCK", ds_block)
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", "5")
    d, g = cuda_inputs(seqlens=[37, 0, 100, 16], H=3, state_dtype=torch.float32)
    got, ref = cuda_and_reference_grads(d, g)
    check_grads(ds_block, got, ref)


@pytest.mark.parametrize("ds_block", ["", "4x1", "4x2", "8x2"])
@pytest.mark.parametrize("window", ["0", "5"])
def test_backward_with_nan_filled_scratch_is_unchanged(ds_block, window, monkeypatch):
    """kda.bwd with every uninitialised allocation NaN-filled (its outputs and all
    the scratch between its kernels: records, chunk states, dS1, record gradients,
    carries), in one pass and in windows, in the dS recurrence's automatic shape and
    three forced ones: the gradients bit for bit those of a normal call, so no kernel
    reads an element another did not write."""
    from conftest import nan_filled_empty

    monkeypatch.setenv("TORCH_KDA_DS_BLOCK", ds_block)
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", window)
    _, g = cuda_inputs(seqlens=[37, 0, 100, 16], H=3, state_dtype=torch.float32)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    gf = torch.randn(*g["initial_state"].shape, device=DEV)
    kw = dict(lower_bound=-5.0, initial_state=g["initial_state"], cu_seqlens=g["cu_seqlens"])
    want = torch.ops.kda.bwd(grad_out, gf, *positional(g), **kw)
    with nan_filled_empty():
        probe = torch.empty(3, device=DEV)
        got = torch.ops.kda.bwd(grad_out, gf, *positional(g), **kw)
    assert torch.isnan(probe).all()
    for name, x, y in zip(GRAD_NAMES, got, want):
        assert torch.equal(x, y), name


def test_forced_ds_block_shape_is_checked(monkeypatch):
    d, g = cuda_inputs(B=1, T=40, H=2)
    monkeypatch.setenv("TORCH_KDA_DS_BLOCK", "2x4")
    with pytest.raises(RuntimeError, match="TORCH_KDA_DS_BLOCK must be one of 1x1, 2x1, 4x1, 2x2, 4x2, 8x2, got '2x4'"):
        torch.ops.kda.bwd(torch.randn_like(g["v"]), None, *positional(g), lower_bound=-5.0)


def test_autograd_uses_the_forward_checkpoints(monkeypatch):
    """torch_kda.kda with a gradient wanted on CUDA keeps the chunk-start states
    and the records, and its backward (in 3 windows) runs no K2 and no K1 for
    the records: the gradients of kda.bwd without them, bit for bit, again on a
    second backward through the same graph, and with a gradient into the final
    state alone (out's then zero)."""
    monkeypatch.delenv("TORCH_KDA_WINDOW_SLOTS", raising=False)
    monkeypatch.delenv("TORCH_KDA_SAVE_STATES", raising=False)
    monkeypatch.delenv("TORCH_KDA_SAVE_RECORDS", raising=False)
    _, g = cuda_inputs(B=1, T=4000, H=96, state_dtype=torch.float32)
    assert math.ceil(250 / _window_floor(96)) == 3
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
    leaves = {n: g[n].detach().clone().requires_grad_() for n in names}
    init = g["initial_state"].detach().clone().requires_grad_()
    out, final = torch_kda.kda(*(leaves[n] for n in names), lower_bound=-5.0, initial_state=init,
                               output_final_state=True)
    grad_out = torch.randn_like(out)
    gf = torch.randn_like(final)
    kw = dict(lower_bound=-5.0, initial_state=g["initial_state"])
    for outputs, grads in (((out, final), (grad_out, gf)), ((out, final), (grad_out, gf)), ((final,), (gf,))):
        want = torch.ops.kda.bwd(grads[0] if len(grads) == 2 else torch.zeros_like(out), gf, *positional(g), **kw)
        for t in (*leaves.values(), init):
            t.grad = None
        _, k1, k2 = _recurrence_launches(lambda: torch.autograd.backward(outputs, grads, retain_graph=True))
        assert (k1, k2) == (0, 0), len(grads)
        for name, t, y in zip(GRAD_NAMES, (*leaves.values(), init), want):
            assert torch.equal(t.grad, y), (len(grads), name)


def test_opcheck_cuda_fwd_checkpointed():
    for kw, state, slots in ((dict(B=1, T=100), torch.float32, 7), (dict(seqlens=[10, 0, 33]), torch.float32, 6),
                             (dict(B=1, T=21), None, 2)):
        _, g = cuda_inputs(H=2, state_dtype=state, **kw)
        args = [t.detach().requires_grad_() for t in positional(g)]
        torch.library.opcheck(torch.ops.kda._fwd_checkpointed.default,
                              (*args, None, -5.0, g["initial_state"], True, g["cu_seqlens"]))
        out, _, ckpt, records = torch.ops.kda._fwd_checkpointed(*positional(g), None, -5.0, g["initial_state"],
                                                                True, g["cu_seqlens"])
        assert ckpt.shape == (slots, 2, D, D) and records.shape == (slots, 2, RECORD_FLOATS)
        torch.library.opcheck(
            torch.ops.kda.bwd.default, (torch.randn_like(out), None, *positional(g)),
            {"lower_bound": -5.0, "initial_state": g["initial_state"], "cu_seqlens": g["cu_seqlens"],
             "checkpoints": ckpt, "records": records},
        )


@pytest.mark.parametrize("window", ["0", "3"])
def test_backward_cuda_graph_capture_and_replay(window, monkeypatch):
    """The backward captured in a CUDA graph, in one pass and in windows of 3 slots
    (the checkpoint pass, its copies and the carries in the graph), replays the eager
    gradients for new incoming gradients."""
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", window)
    _, g = cuda_inputs(seqlens=[40, 0, 100, 17], H=2, state_dtype=torch.float32)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    gf = torch.randn(*g["initial_state"].shape, device=DEV)
    kw = dict(lower_bound=-5.0, initial_state=g["initial_state"], cu_seqlens=g["cu_seqlens"])

    def step():
        return torch.ops.kda.bwd(grad_out, gf, *positional(g), **kw)

    graph, got = capture_graph(step)
    for _ in range(2):
        grad_out.copy_(torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16))
        gf.copy_(torch.randn_like(gf))
        for t in got:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        for name, x, y in zip(GRAD_NAMES, got, want):
            assert torch.equal(x, y), (window, name)


def test_backward_agrees_with_fla_chunk_kda():
    fla_kda = pytest.importorskip("fla.ops.kda")
    d, g = cuda_inputs(B=2, T=1024, H=4, state_dtype=torch.float32)
    leaves = {n: g[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "A_log")}
    leaves["dt_bias"] = g["dt_bias"].flatten().detach().clone().requires_grad_()  # fla takes it flat
    leaves["h0"] = g["initial_state"].detach().clone().requires_grad_()
    out, _ = fla_kda.chunk_kda(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["h0"],
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, state_v_first=True,
        A_log=leaves["A_log"], dt_bias=leaves["dt_bias"])
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ours = torch.ops.kda.bwd(grad_out, None, *positional(g), lower_bound=-5.0, initial_state=g["initial_state"])
    theirs = [leaves[n].grad for n in ("q", "k", "v", "g", "beta", "A_log")]
    theirs += [leaves["dt_bias"].grad.view(g["dt_bias"].shape), leaves["h0"].grad]
    for name, x, y in zip(GRAD_NAMES, ours, theirs):
        e = rel(x.float(), y.float())
        print(f"\n{name}: torch_kda vs chunk_kda rel {e:.2e}", end="")
        assert e <= 5e-2, f"{name}: rel {e:.2e}"


def test_backward_varlen_gradients_stay_inside_their_sequence():
    d, g = cuda_inputs(seqlens=[40, 13, 70], H=2, state_dtype=torch.float32)
    grad_out = torch.zeros(*g["v"].shape, device=DEV, dtype=torch.bfloat16)
    grad_out[:, 40:53] = torch.randn(1, 13, 2, D, device=DEV).to(torch.bfloat16)
    dq, dk, dv, dg, dbeta, _, _, dinit = torch.ops.kda.bwd(
        grad_out, None, *positional(g), lower_bound=-5.0, initial_state=g["initial_state"], cu_seqlens=g["cu_seqlens"])
    for t in (dq, dk, dv, dg, dbeta):
        assert torch.count_nonzero(t[:, :40]) == 0 and torch.count_nonzero(t[:, 53:]) == 0
        assert torch.count_nonzero(t[:, 40:53]) > 0
    assert torch.count_nonzero(dinit[0]) == 0 and torch.count_nonzero(dinit[2]) == 0
    assert torch.count_nonzero(dinit[1]) > 0


def test_opcheck_cuda_with_gradients():
    for seqlens, state in (([10, 0, 33], torch.float32), (None, torch.bfloat16)):
        kw = {"seqlens": seqlens} if seqlens else {"B": 2, "T": 21}
        _, g = cuda_inputs(H=2, state_dtype=state, **kw)
        args = [t.detach().requires_grad_() if n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias") else t
                for n, t in zip(("q", "k", "v", "g", "beta", "A_log", "dt_bias"), positional(g))]
        init = g["initial_state"].detach().requires_grad_()
        torch.library.opcheck(
            torch.ops.kda.fwd.default, tuple(args),
            {"lower_bound": -5.0, "initial_state": init, "output_final_state": True, "cu_seqlens": g["cu_seqlens"]},
        )


def test_compiled_training_step_equals_eager():
    """torch.compile(fullgraph=True) of the layer, forward and backward, against eager.
    Inductor fuses the bf16 roundings differently unless told to emulate eager's casts."""
    from torch._inductor import config as inductor_config
    from torch_kda.nn import KimiDeltaAttention

    torch.manual_seed(0)
    layer = KimiDeltaAttention(hidden_size=256, num_heads=2, head_dim=D, lower_bound=-5.0).to(DEV)
    x = torch.randn(2, 64, 256, device=DEV)

    def step(module):
        module.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, _ = module(x)
        y.float().square().mean().backward()
        return y.detach().float(), [p.grad.detach().float().clone() for p in module.parameters()]

    y_eager, g_eager = step(layer)
    with inductor_config.patch(emulate_precision_casts=True):
        compiled = torch.compile(layer, fullgraph=True)
        y_comp, g_comp = step(compiled)
    assert rel(y_comp, y_eager) <= 1e-3
    for ge, gc in zip(g_eager, g_comp):
        assert rel(gc, ge) <= 5e-3


# --------------------------------------------------------------------------
# Backward kernels, piece by piece (branch next/bwd-prepare)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["random", "weak_decay"])
def test_prepare_backward_matches_reference(case):
    """K1's backward alone (kda._prepare_bwd) against reference.chunk_record_backward
    in float64, chunk by chunk, on random record gradients; the last chunk of each
    sequence is partial (the padding rows' gradients must not leak into it). Weak
    decay keeps exp(G_last) near 1, where the decay terms weigh most."""
    from torch_kda import reference

    B, T, H = 2, 37, 3
    d, g = cuda_inputs(B=B, T=T, H=H)
    _hard_case(case, d, g)
    nch = (T + 15) // 16
    d_record = torch.randn(B * nch, H, 8576, device=DEV)
    got = torch.ops.kda._prepare_bwd(g["q"], g["k"], g["v"], g["g"], g["beta"], g["A_log"], g["dt_bias"], d_record,
                                     None, -5.0)
    torch.cuda.synchronize()
    x = {n: g[n].double().cpu() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
    qn, kn, lam, b = reference.activations(x["q"], x["k"], x["g"], x["beta"], x["A_log"], x["dt_bias"], -5.0)
    rec = d_record.double().cpu()
    names = ("dqn", "dkn", "dv", "dlam", "dbeta")
    want = [torch.zeros(B, T, H, D, dtype=torch.float64) for _ in range(4)] + [torch.zeros(B, T, H, dtype=torch.float64)]
    for bb in range(B):
        for ci in range(nch):
            s, e = 16 * ci, min(T, 16 * ci + 16)
            L = e - s
            for h in range(H):
                r = rec[bb * nch + ci, h]
                drec = dict(Qs=r[0:2048].view(16, D)[:L], W=r[2048:4096].view(16, D)[:L],
                            Kd=r[4096:6144].view(16, D)[:L], Aqk=r[6144:6400].view(16, 16)[:L, :L],
                            U0=r[6400:8448].view(16, D)[:L], gl=r[8448:8576])
                res = reference.chunk_record_backward(qn[bb, s:e, h], kn[bb, s:e, h], x["v"][bb, s:e, h],
                                                      lam[bb, s:e, h], b[bb, s:e, h], D ** -0.5, drec)
                for w, t in zip(want, res):
                    w[bb, s:e, h] = t
    for name, w, t in zip(names, want, got):
        err = rel(t.cpu(), w)
        print(f"{name}: rel {err:.2e}")
        assert torch.isfinite(t).all(), name
        assert err <= 2e-5, name  # fp32 against float64: ~1e-6 in a CPU emulation of the kernel


@pytest.mark.parametrize("case, ds_block", [("random", ""), ("weak_decay", ""), ("random", "1x1"), ("random", "2x1"),
                                            ("random", "4x1"), ("weak_decay", "2x2"), ("random", "4x2"),
                                            ("random", "8x2")])
def test_sweep_backward_matches_reference(case, ds_block, monkeypatch):
    """The backward sweep alone (kda._sweep_bwd, after K1), in the dS recurrence's
    automatic block shape or one forced by TORCH_KDA_DS_BLOCK, from chunk-start states
    given in bf16 (as K2 stores them for it), against reference.chunk_step_backward
    chained over the chunks in float64: dS at every chunk's end (which the dS
    recurrence carries in fp32 and stores in bf16), every record gradient (zero on
    the padding rows of a partial chunk) and the initial state's gradient. The
    record gradients multiply by S0 and dS1 as stored, so the reference takes those
    bf16 values too (S0 as given, dS1 as the kernel returns it, itself checked
    against float64): what is left is the products' own error. With random gates
    exp(G_last) is ~1e-12 or less, so only weak decay shows the carry
    dS1 diag(exp(G_last)) in d_initial."""
    from torch_kda import reference

    monkeypatch.setenv("TORCH_KDA_DS_BLOCK", ds_block)
    B, T, H = 2, 37, 2
    d, g = cuda_inputs(B=B, T=T, H=H, state_dtype=torch.float32)
    _hard_case(case, d, g)
    nch = (T + 15) // 16
    x = {n: g[n].double().cpu() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")}
    qn, kn, lam, b = reference.activations(x["q"], x["k"], x["g"], x["beta"], x["A_log"], x["dt_bias"], -5.0)
    grad_out = torch.randn(B, T, H, D, device=DEV).to(torch.bfloat16)
    grad_final = torch.randn(B, H, D, D, device=DEV)
    dO64, dS64 = grad_out.double().cpu(), grad_final.double().cpu()
    states = torch.zeros(B * nch, H, D, D, dtype=torch.bfloat16)
    saved = {}
    for bb in range(B):
        for h in range(H):
            S = x["initial_state"][bb, h]
            for ci in range(nch):
                s, e = 16 * ci, min(T, 16 * ci + 16)
                rec = reference.chunk_record(qn[bb, s:e, h], kn[bb, s:e, h], x["v"][bb, s:e, h], lam[bb, s:e, h],
                                             b[bb, s:e, h], D ** -0.5)
                states[bb * nch + ci, h] = S.to(torch.bfloat16)
                saved[bb, h, ci] = rec
                _, S, _ = reference.chunk_step(S, rec)
    d_record, d_initial, d_states = torch.ops.kda._sweep_bwd(
        g["q"], g["k"], g["v"], g["g"], g["beta"], g["A_log"], g["dt_bias"], states.to(DEV), grad_out,
        grad_final, None, -5.0)
    torch.cuda.synchronize()
    assert d_states.dtype == torch.bfloat16
    got_ds = d_states.double().cpu()
    want_ds = torch.zeros(B * nch, H, D, D, dtype=torch.float64)
    want_rec = torch.zeros(B * nch, H, 8576, dtype=torch.float64)
    want_init = torch.zeros(B, H, D, D, dtype=torch.float64)
    for bb in range(B):
        for h in range(H):
            dS = dS64[bb, h]
            for ci in reversed(range(nch)):
                s, e = 16 * ci, min(T, 16 * ci + 16)
                L, rec = e - s, saved[bb, h, ci]
                want_ds[bb * nch + ci, h] = dS
                S0 = states[bb * nch + ci, h].double()
                U = rec["U0"] - rec["W"] @ S0.T
                dS_next, dr = reference.chunk_step_backward(S0, rec, U, dO64[bb, s:e, h], dS)
                # dKd and dgl take dS1 as the kernel stored it (dU and dS0 its fp32 value).
                _, dr_st = reference.chunk_step_backward(S0, rec, U, dO64[bb, s:e, h], got_ds[bb * nch + ci, h])
                dr["Kd"], dr["gl"] = dr_st["Kd"], dr_st["gl"]
                dS = dS_next
                w = want_rec[bb * nch + ci, h]
                w[0:2048].view(16, D)[:L] = dr["Qs"]
                w[2048:4096].view(16, D)[:L] = dr["W"]
                w[4096:6144].view(16, D)[:L] = dr["Kd"]
                w[6144:6400].view(16, 16)[:L, :L] = dr["Aqk"]
                w[6400:8448].view(16, D)[:L] = dr["U0"]
                w[8448:8576] = dr["gl"]
            want_init[bb, h] = dS
    err = rel(got_ds, want_ds)
    print(f"d_states: rel {err:.2e}")
    assert err <= 3e-3  # bf16's rounding: 1.67e-3 measured on the H200
    for name, lo, hi in (("dQs", 0, 2048), ("dW", 2048, 4096), ("dKd", 4096, 6144), ("dAqk", 6144, 6400),
                         ("dU0", 6400, 8448), ("dgl", 8448, 8576)):
        err = rel(d_record[..., lo:hi].cpu(), want_rec[..., lo:hi])
        print(f"{name}: rel {err:.2e}")
        assert err <= 5e-5, name  # the fp32 side's bf16 hi + lo planes keep ~2^-17
    err = rel(d_initial.cpu(), want_init)
    print(f"d_initial: rel {err:.2e}")
    assert err <= 5e-5
