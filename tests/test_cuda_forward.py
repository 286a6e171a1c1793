"""The CUDA forward (sm_90a) on fixed-length batches against the float64
reference, fla's chunk_kda and the CPU kernel: accuracy on random and hard
inputs, odd lengths, T = 0, poisoned outputs, the in-place API and its overlap
rules, determinism, and what the CUDA kernels refuse before any kernel runs.
Skipped where CUDA is absent; tools/gpu_check.sh runs them on an H200.
"""

import pytest
import torch

import torch_kda
from conftest import fla_chunk_kda, make_inputs, positional, rel, run_reference
from cuda_helpers import CUDA_MARKS, D, DEV, FP32_STATE_TOL, cuda_inputs, errors, hard_case, run_cuda
from torch_kda.testing import forced

pytestmark = CUDA_MARKS


@pytest.mark.parametrize("state_dtype,state_tol", [(torch.bfloat16, 5e-3), (torch.float32, 1e-3)])
def test_random_case_accuracy(state_dtype, state_tol):
    d, g = cuda_inputs(B=2, T=1024, H=4, state_dtype=state_dtype)
    e_out, e_state, _, final = errors(d, g)
    print(f"\nrandom T=1024 state={state_dtype}: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert final.dtype == state_dtype
    assert e_out <= 5e-3
    assert e_state <= state_tol


@pytest.mark.parametrize(
    "name,lower_bound",
    [("weak_decay", -5.0), ("small_beta", -5.0), ("lower_bound", -0.1), ("lower_bound", -1.0), ("lower_bound", -5.0)],
)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_hard_cases(name, lower_bound, state_dtype):
    d, g = cuda_inputs(B=1, T=4096, H=2, state_dtype=state_dtype)
    hard_case(name, d, g)
    e_out, e_state, _, _ = errors(d, g, lower_bound)
    print(f"\n{name} lb={lower_bound} T=4096 state={state_dtype}: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= 2e-2
    assert e_state <= 2e-2


# Two heads of 65,536 tokens run in segments by default (heuristics.cpp): these long
# tests hold both the whole chain and the automatic choice to the reference.
SEGMENTS = pytest.mark.parametrize("segments", [1, None], ids=["whole", "automatic"])


@SEGMENTS
def test_hard_case_long_sequence(segments):
    d, g = cuda_inputs(B=1, T=65536, H=2, state_dtype=torch.float32)
    with forced(segments=segments):
        e_out, e_state, _, _ = errors(d, g, -5.0)
    print(f"\nlong lb=-5.0 T=65536 state=float32 segments={segments}: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= 2e-2
    assert e_state <= 2e-2


def test_bf16_state_takes_bf16_products_over_long_sequences():
    """With a bf16 state the recurrence multiplies by the state, U and the record's
    planes in bf16 alone (FwdParams::bf16_products), where an fp32 state keeps bf16x3:
    over 4,096 chunks, each feeding its products back into the state, the bf16 state's
    errors stay inside the random case's targets, and the same inputs with an fp32
    state keep the far smaller fp32-level state error (the two paths differ). One
    chain, without segments."""
    d, g = cuda_inputs(B=1, T=65536, H=2, state_dtype=torch.bfloat16)
    g32 = dict(g, initial_state=g["initial_state"].float())
    with forced(segments=1):
        e_out, e_state, _, final = errors(d, g, -5.0)
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
    64, 96 and 256 run four full-width warps per block (256: two waves). Each shape
    forced on one problem: test_forced_block_shapes_match_reference."""
    d, g = cuda_inputs(B=1, T=200, H=H, state_dtype=torch.float32)
    e_out, e_state, _, _ = errors(d, g)
    print(f"\nH={H} on {torch.cuda.get_device_properties(0).multi_processor_count} SMs: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= 5e-3 and e_state <= 1e-4


@SEGMENTS
def test_fp32_state_does_not_drift_over_long_small_beta_sequences(segments):
    """Small beta: the delta rule corrects the state only over ~100 / beta tokens, so a
    rounding bias in the state update (the tensor cores' fp32 accumulation truncates)
    would add up over the sequence instead of washing out."""
    d, g = cuda_inputs(B=1, T=65536, H=2, state_dtype=torch.float32)
    hard_case("small_beta", d, g)
    with forced(segments=segments):
        e_out, e_state, _, _ = errors(d, g, -5.0)
    print(f"\nsmall_beta lb=-5.0 T=65536 state=float32: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_state <= 1e-4


def test_fp32_state_is_accumulated_in_fp32():
    """Under weak decay the state sums thousands of updates; rounding it to
    bf16 on chip would show as a state error near bf16's resolution."""
    d, g = cuda_inputs(B=1, T=4096, H=2, state_dtype=torch.float32)
    hard_case("weak_decay", d, g)
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


def test_non_contiguous_inputs():
    d, g = cuda_inputs(B=2, T=40, H=2)
    nc = {name: g[name].transpose(0, 1).contiguous().transpose(0, 1) for name in ("q", "k", "v", "g", "beta")}
    assert not nc["q"].is_contiguous()
    out, final = run_cuda({**g, **nc})
    out_c, final_c = run_cuda(g)
    assert torch.equal(out, out_c) and torch.equal(final, final_c)


@pytest.mark.parametrize("head_size", [128, 64])
def test_misaligned_inputs_give_the_aligned_bits(head_size):
    """q, k and g as contiguous views 2 bytes off a 16-byte boundary (K1 reads
    them by 16-byte copies): the same bits, forward and backward, as aligned
    ones, on the 128-wide kernels and on the 64-wide forward."""
    _, g = cuda_inputs(B=1, T=50, H=2, K=head_size, V=head_size)
    shifted = dict(g)
    for name in ("q", "k", "g"):
        t = g[name]
        shifted[name] = torch.empty(t.numel() + 1, device=DEV, dtype=t.dtype)[1:].view(t.shape).copy_(t)
        assert shifted[name].data_ptr() % 16 != 0
    results = []
    for inputs in (g, shifted):
        leaves = {n: inputs[n].detach().requires_grad_() for n in ("q", "k", "g")}
        x = dict(inputs, **leaves)
        out, final = run_cuda(x)
        (out.float().square().sum() + final.square().sum()).backward()
        results.append((out, final, *(leaves[n].grad for n in ("q", "k", "g"))))
    assert all(torch.equal(a, b) for a, b in zip(*results))


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


def test_cpu_and_cuda_agree():
    d, g = cuda_inputs(seqlens=[200, 3, 64], H=2, state_dtype=torch.float32)
    out, final = run_cuda(g)
    cpu_out, cpu_final = torch_kda.kda(
        *positional(d), lower_bound=-5.0, initial_state=d["initial_state"], output_final_state=True,
        cu_seqlens=d["cu_seqlens"],
    )
    assert rel(out.cpu(), cpu_out) <= 5e-3
    assert rel(final.cpu(), cpu_final) <= 1e-4


def test_cuda_limits_are_errors():
    _, g = cuda_inputs(B=1, T=8, H=2)
    args = positional(g)
    with pytest.raises(RuntimeError, match=r"lower_bound must be in \[-5, 0\) or None"):
        torch_kda.kda(*args, lower_bound=-6.0)
    with pytest.raises(RuntimeError, match="q, k, v, g and beta must have dtype bfloat16"):
        torch_kda.kda(*(a.float() if a.dtype == torch.bfloat16 else a for a in args), lower_bound=-5.0)
    wide = make_inputs(B=1, T=8, H=2, K=300, V=64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError,
                       match=r"q must have a head size K \(dim 3\) of at most 256, got shape \[1, 8, 2, 300\]"):
        torch_kda.kda(*(t.to(DEV) for t in positional(wide)), lower_bound=-5.0)
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
