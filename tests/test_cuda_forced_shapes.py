"""The testing hook (torch_kda.testing.forced): the block shapes it forces on
K2 and on the dS recurrence give the reference's results in every shape (and
each other's bits where they must), the windows it forces give one pass's bits
in each, and a bad value raises before anything is set. Skipped where CUDA is
absent; tools/gpu_check.sh runs them on an H200.
"""

import re

import pytest
import torch

from torch_kda.testing import forced
from conftest import positional, rel, run_reference
from cuda_helpers import (
    CUDA_MARKS,
    DS_SHAPE,
    FP32_STATE_TOL,
    K2_SHAPE,
    assert_checkpoints_are_prefix_states,
    assert_each_sequence_alone_is_bitwise,
    check_grads,
    cuda_and_reference_grads,
    cuda_inputs,
    ds_launches,
    errors,
    hard_case,
    k2_launches,
    kernel_launches,
    launched_kernels,
    run_cuda,
)

pytestmark = CUDA_MARKS

RECURRENCE_BLOCKS = ["4x1w", "2x2", "4x4"]
DS_BLOCKS = ["4x1", "4x2", "2x2"]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", RECURRENCE_BLOCKS)
def test_forced_block_shapes_match_reference(shape, state_dtype):
    """forced(recurrence_block=...) runs any block shape on any problem: each on a
    varlen batch with an empty sequence and a partial chunk, with bf16x3 products
    (fp32 state) and bf16 ones (bf16 state)."""
    with forced(recurrence_block=shape):
        d, g = cuda_inputs(seqlens=[5, 40, 0, 77], H=3, state_dtype=state_dtype)
        (e_out, e_state, _, _), names = launched_kernels(lambda: errors(d, g))
    print(f"block {shape} state {state_dtype}: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= 5e-3 and e_state <= (FP32_STATE_TOL if state_dtype == torch.float32 else 5e-3)
    assert {split for split, _, _ in k2_launches(names)} == {K2_SHAPE[shape]}  # the forced shape ran


@pytest.mark.parametrize("name", ["random", "weak_decay", "small_beta"])
def test_wgmma_shape_keeps_the_fp32_state_over_long_sequences(name):
    """The 4x1w shape (wgmma), forced where the automatic choice is another (8
    heads), over 256 chunks (an fp32 state that every chunk's products feed back
    into), against float64."""
    d, g = cuda_inputs(B=1, T=4096, H=8, state_dtype=torch.float32)
    hard_case(name, d, g)
    with forced(recurrence_block="4x1w"):
        e_out, e_state, _, _ = errors(d, g)
    print(f"\n{name} block 4x1w T=4096: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= 5e-3 and e_state <= FP32_STATE_TOL


@pytest.mark.parametrize("kw, message", [
    (dict(recurrence_block="8x1"), "recurrence_block must be one of auto, 4x1w, 2x2, 4x4, 8x4, 16x4, got '8x1'"),
    (dict(ds_block="1x1"), "ds_block must be one of auto, 4x1, 4x2, 2x2, 8x2, got '1x1'"),
    (dict(window_slots=-2),
     "window_slots must be -1 (automatic), 0 (one pass) or a positive number of chunk slots, got -2"),
])
def test_the_hook_rejects_bad_values(kw, message):
    """A bad value raises naming the argument and the choices, from the op and from
    forced (which refuses a negative window itself, in Python's terms)."""
    try:
        with pytest.raises(RuntimeError, match=re.escape(f"kda_testing.force: {message}")):
            torch.ops.kda_testing.force(**kw)
        if "window_slots" in kw:
            error, message = ValueError, "torch_kda.testing.forced: window_slots must be at least 0 or None, got -2"
        else:
            error, message = RuntimeError, f"kda_testing.force: {message}"
        with pytest.raises(error, match=re.escape(message)):
            with forced(**kw):
                pass
    finally:
        torch.ops.kda_testing.force()


def test_a_rejected_setting_leaves_the_one_before():
    """force checks every argument before it sets any: after calls with a bad one
    (beside good ones), the setting before them still holds, K2 in 4x4 and windows
    of 3 slots (5 launches of K1 and of K2 for 13 slots), where the automatic
    choices are the 4x1w in one pass (96 heads): bitwise the result under
    forced(recurrence_block="4x4", window_slots=3). force() makes every choice
    automatic again."""
    _, g = cuda_inputs(B=1, T=200, H=96, state_dtype=torch.float32)
    with forced(recurrence_block="4x4", window_slots=3):
        want_out, want_final = run_cuda(g)
    try:
        torch.ops.kda_testing.force("4x4", "auto", 3)
        for bad in (("9x9",), ("2x2", "1x1"), ("2x2", "4x2", -2)):
            with pytest.raises(RuntimeError, match="kda_testing.force: "):
                torch.ops.kda_testing.force(*bad)
        (out, final), k1, k2 = kernel_launches(lambda: run_cuda(g))
    finally:
        torch.ops.kda_testing.force()
    assert (k1, k2) == (5, 5)
    assert torch.equal(out, want_out) and torch.equal(final, want_final)
    assert kernel_launches(lambda: run_cuda(g))[1:] == (1, 1)


def test_forced_ends_with_its_block_also_on_an_exception():
    """Leaving forced's block, by an exception too, makes every choice automatic
    again: windows of 3 slots inside (5 launches of K1 and of K2 for 13 slots),
    one pass after."""
    _, g = cuda_inputs(B=1, T=200, H=2)
    with pytest.raises(RuntimeError, match="leaving the block"):
        with forced(window_slots=3):
            assert kernel_launches(lambda: run_cuda(g))[1:] == (5, 5)
            raise RuntimeError("leaving the block")
    assert kernel_launches(lambda: run_cuda(g))[1:] == (1, 1)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_4x1w_refill_points_agree_bitwise(state_dtype):
    """The 4x1w forward issues a step's copies at one of two points, by how many
    blocks it runs (heuristics.cpp, late_refill_pays): a batch of enough
    (sequence, head) pairs takes the later one, each of its sequences alone the
    earlier, and both give the same bits, which match the float64 reference."""
    H = 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    N = (3 * sms + 2 * H - 1) // (2 * H)  # two blocks a (sequence, head): 3 * sms or more
    seqlens = torch.randint(1, 60, (N,)).tolist()
    seqlens[N // 2] = 0
    d, g = cuda_inputs(seqlens=seqlens, H=H, state_dtype=state_dtype)
    with forced(recurrence_block="4x1w"):
        (out, final), names = launched_kernels(lambda: run_cuda(g))
        assert [late for _, out_, late in k2_launches(names) if out_] == [True]  # the batch copies late
        ref_out, ref_final = run_reference(g, lower_bound=-5.0)
        assert rel(out, ref_out) <= 5e-3
        assert rel(final, ref_final) <= (5e-3 if state_dtype == torch.bfloat16 else FP32_STATE_TOL)
        assert_each_sequence_alone_is_bitwise(g, out, final)


@pytest.mark.parametrize("shape", RECURRENCE_BLOCKS)
def test_windows_in_every_block_shape(shape):
    """Windows of 4 slots give one pass's bits in each K2 block shape."""
    d, g = cuda_inputs(seqlens=[70, 0, 33, 129], H=3, state_dtype=torch.float32)
    with forced(recurrence_block=shape, window_slots=0):
        one_out, one_final = run_cuda(g)
    with forced(recurrence_block=shape, window_slots=4):
        out, final = run_cuda(g)
    assert torch.equal(out, one_out) and torch.equal(final, one_final)


@pytest.mark.parametrize("shape", RECURRENCE_BLOCKS)
def test_backward_and_checkpoints_in_every_block_shape(shape):
    """Each K2 block shape in the backward's passes (K2 without output), in
    windows of 5 slots (the checkpoint pass and the carries too): gradients
    against float64; and in the forward's chunk-state stores: bitwise a prefix
    forward's final states, rounded (4000 tokens x 96 heads)."""
    with forced(recurrence_block=shape, window_slots=5):
        d, g = cuda_inputs(B=2, T=300, H=4, state_dtype=torch.float32)
        got, ref = cuda_and_reference_grads(d, g)
        check_grads(shape, got, ref)
        _, g = cuda_inputs(B=1, T=4000, H=96, state_dtype=torch.float32)
        _, _, ckpt, _ = torch.ops.kda._fwd_checkpointed(*positional(g), None, -5.0, g["initial_state"], False, None)
        assert_checkpoints_are_prefix_states(g, ckpt)


@pytest.mark.parametrize("ds_block", DS_BLOCKS)
def test_backward_in_every_ds_block_shape(ds_block):
    """Each block shape of the dS recurrence (forced(ds_block=...)) in the whole
    backward, in windows of 5 slots (dS through the carries), on a varlen batch
    with an empty sequence and partial chunks: gradients against float64."""
    with forced(ds_block=ds_block, window_slots=5):
        d, g = cuda_inputs(seqlens=[37, 0, 100, 16], H=3, state_dtype=torch.float32)
        (got, ref), names = launched_kernels(lambda: cuda_and_reference_grads(d, g))
        check_grads(ds_block, got, ref)
    assert set(ds_launches(names)) == {DS_SHAPE[ds_block]}  # the forced shape ran
