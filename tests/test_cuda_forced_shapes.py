"""The testing hook: the environment settings that force K2's and the dS
recurrence's block shapes and K1's warps give the reference's results in every
shape (and each other's bits where they must), and bad values raise naming the
op. Skipped where CUDA is absent; tools/gpu_check.sh runs them on an H200.
"""

import pytest
import torch

from conftest import positional, rel, run_reference
from cuda_helpers import (
    CUDA_MARKS,
    DEV,
    FP32_STATE_TOL,
    assert_checkpoints_are_prefix_states,
    assert_each_sequence_alone_is_bitwise,
    check_grads,
    cuda_and_reference_grads,
    cuda_inputs,
    errors,
    hard_case,
    kernel_launches,
    record_values,
    run_cuda,
    run_windowed,
)

pytestmark = CUDA_MARKS


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
    hard_case(name, d, g)
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
    records = record_values(torch.ops.kda._fwd_checkpointed(*args)[3])
    monkeypatch.setenv("TORCH_KDA_K1_WARPS", "2" if warps == "1" else "1")
    other = record_values(torch.ops.kda._fwd_checkpointed(*args)[3])
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


def test_windows_with_eight_warp_blocks(monkeypatch):
    d, g = cuda_inputs(seqlens=[70, 0, 33, 129], H=3, state_dtype=torch.float32)
    monkeypatch.setenv("TORCH_KDA_RECURRENCE_BLOCK", "8x1")
    one_out, one_final = run_windowed(g, 0, monkeypatch)
    out, final = run_windowed(g, 4, monkeypatch)
    assert torch.equal(out, one_out) and torch.equal(final, one_final)


def test_bad_block_setting_in_windows_raises_before_any_launch(monkeypatch):
    """Both settings are read before anything is enqueued: no kernel of the
    failed call behind."""
    d, g = cuda_inputs(B=1, T=200, H=2)
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", "3")
    monkeypatch.setenv("TORCH_KDA_RECURRENCE_BLOCK", "16x1")

    def call():
        with pytest.raises(RuntimeError, match="TORCH_KDA_RECURRENCE_BLOCK must be one of"):
            run_cuda(g)

    assert kernel_launches(call)[1:] == (0, 0)


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
    assert_checkpoints_are_prefix_states(g, ckpt)


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


def test_forced_ds_block_shape_is_checked(monkeypatch):
    d, g = cuda_inputs(B=1, T=40, H=2)
    monkeypatch.setenv("TORCH_KDA_DS_BLOCK", "2x4")
    with pytest.raises(RuntimeError, match="TORCH_KDA_DS_BLOCK must be one of 1x1, 2x1, 4x1, 2x2, 4x2, 8x2, got '2x4'"):
        torch.ops.kda.bwd(torch.randn_like(g["v"]), None, *positional(g), lower_bound=-5.0)
