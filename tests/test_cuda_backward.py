"""The CUDA backward (K1 for the records, K2 for the chunk-start states, the dS
sweep, K1's backward) against float64 autograd and fla, the states and records
that the forward keeps for it, its windows, and its kernels piece by piece
against torch_kda/reference.py. Skipped where CUDA is absent; tools/gpu_check.sh
runs them on an H200.
"""

import math
import re

import pytest
import torch

import torch_kda
from torch_kda.testing import RECORD_GRAD_FLOATS, RECORD_GRAD_SLICES, forced, record_grad_parts
from conftest import positional, rel
from cuda_helpers import (
    CUDA_MARKS,
    D,
    DEV,
    GRAD_NAMES,
    RECORD_FLOATS,
    WINDOW_CASES,
    assert_checkpoints_are_prefix_states,
    check_grads,
    cuda_and_reference_grads,
    cuda_inputs,
    float64_grads,
    hard_case,
    kernel_launches,
    window_floor,
)

pytestmark = CUDA_MARKS


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
    hard_case(case, d, g)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    got = torch.ops.kda.bwd(grad_out, None, *positional(g), lower_bound=-5.0, initial_state=g["initial_state"])
    check_grads(case, got, float64_grads(g, grad_out, None, -5.0))


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
def test_backward_windows_are_bitwise_one_pass(case, state_dtype):
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
            with forced(window_slots=window):
                return torch.ops.kda.bwd(grad_out, gf, *positional(g), lower_bound=-5.0,
                                         initial_state=g["initial_state"], cu_seqlens=g["cu_seqlens"])
        want = grads(0)
        for window in windows:
            got = grads(window)
            for name, x, y in zip(GRAD_NAMES, got, want):
                assert torch.equal(x, y), (window, gf is None, name)


def test_backward_window_setting_makes_windows():
    """forced(window_slots=...) really cuts the backward: 2 x 300 tokens are 38 slots, so windows
    of 7 slots are 6 launches of the dS recurrence (one per window); 0 is one pass."""
    _, g = cuda_inputs(B=2, T=300, H=2, state_dtype=torch.float32)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)

    def ds_launches():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.ops.kda.bwd(grad_out, None, *positional(g), lower_bound=-5.0, initial_state=g["initial_state"])
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return sum("ds_recurrence_kernel" in n for n in names)

    with forced(window_slots=7):
        assert ds_launches() == 6
    with forced(window_slots=0):
        assert ds_launches() == 1


def test_backward_windows_engage_and_bound_memory():
    """Long few-head calls get windows without any setting: less memory than the
    one-pass scratch (7.75 KB per token and head: 1984 MiB here),
    the one-pass gradients."""
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
    with forced(window_slots=0):
        want = torch.ops.kda.bwd(grad_out, None, *positional(g), **kw)
    for name, x, y in zip(GRAD_NAMES, got, want):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("window,T,H,windows,state_dtype", [
    (None, 10000, 16, 2, torch.float32), (None, 4000, 96, 3, torch.float32), (7, 4000, 96, 36, torch.float32),
    (0, 300, 2, 1, torch.float32), (None, 4000, 96, 3, torch.bfloat16), (None, 10000, 16, 2, torch.bfloat16)])
def test_forward_checkpoints_serve_the_backward_bitwise(window, T, H, windows, state_dtype):
    """kda._fwd_checkpointed returns fwd's outputs bit for bit, the state at
    every chunk slot's start in bf16 (bitwise a prefix forward's final state,
    rounded) and K1's records, in one pass unless windows are forced. kda.bwd
    given the states runs no K2 (against one pass per window and the checkpoint
    pass without them: K1 once per window, against twice but once), given the
    records too no K1 for the records either, and gives the gradients it gives
    without them, bit for bit, also when called again: the checkpoints and
    records are left as they were. forced(window_slots=7) moves the windows (7
    slots: 36 of them) but not the checkpoints. With a bf16 state (bf16 products; at 96
    heads the 4x1w shape, at 16 the 2x2) too: the backward's own passes recompute the
    forward's states."""
    with forced(window_slots=window):
        _, g = cuda_inputs(B=1, T=T, H=H, state_dtype=state_dtype)
        init = g["initial_state"]
        (out, final, ckpt, records), k1_fwd, _ = kernel_launches(
            lambda: torch.ops.kda._fwd_checkpointed(*positional(g), None, -5.0, init, True, None))
        assert k1_fwd == (36 if window == 7 else 1)
        want_out, want_final = torch.ops.kda.fwd(*positional(g), None, -5.0, init, True, None)
        assert torch.equal(out, want_out) and torch.equal(final, want_final)
        assert ckpt.shape == (math.ceil(T / 16), H, D, D) and ckpt.dtype == torch.bfloat16
        assert records.shape == (math.ceil(T / 16), H, RECORD_FLOATS) and records.dtype == torch.float32
        assert_checkpoints_are_prefix_states(g, ckpt)

        grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
        gf = torch.randn_like(init)
        kw = dict(lower_bound=-5.0, initial_state=init)
        saved, saved_records = ckpt.clone(), records.clone()
        want, k1_without, k2_without = kernel_launches(lambda: torch.ops.kda.bwd(grad_out, gf, *positional(g), **kw))
        got, k1_with, k2_with = kernel_launches(
            lambda: torch.ops.kda.bwd(grad_out, gf, *positional(g), checkpoints=ckpt, **kw))
        both, k1_both, k2_both = kernel_launches(
            lambda: torch.ops.kda.bwd(grad_out, gf, *positional(g), checkpoints=ckpt, records=records, **kw))
        again = torch.ops.kda.bwd(grad_out, gf, *positional(g), checkpoints=ckpt, records=records, **kw)
    assert (k1_with, k2_with) == (windows, 0)
    assert (k1_both, k2_both) == (0, 0)
    assert k1_without == k2_without == 2 * windows - 1
    assert torch.equal(ckpt, saved) and torch.equal(records, saved_records)
    for name, x, y, z, w in zip(GRAD_NAMES, got, want, again, both):
        assert torch.equal(x, y) and torch.equal(z, y) and torch.equal(w, y), name


@pytest.mark.parametrize("window", [0, 5])
def test_forward_checkpoints_serve_a_varlen_backward_bitwise(window):
    """A varlen batch (an empty sequence, partial chunks): kda._fwd_checkpointed's
    checkpoints and records (min(T, ceil(T / 16) + N) slots, the last N zeroed
    before the forward, so that the outputs hold no uninitialised memory:
    NaN-filled allocations here) give kda.bwd the gradients it gives without
    them, bit for bit, in one pass and in windows of 5 slots, with no K2 launch
    (the states alone) and no K1 for the records either (both)."""
    from conftest import nan_filled_empty

    with forced(window_slots=window):
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
        got, _, k2 = kernel_launches(lambda: torch.ops.kda.bwd(grad_out, gf, *positional(g), checkpoints=ckpt, **kw))
        both, k1_both, k2_both = kernel_launches(
            lambda: torch.ops.kda.bwd(grad_out, gf, *positional(g), checkpoints=ckpt, records=records, **kw))
    assert k2 == 0 and (k1_both, k2_both) == (0, 0)
    for name, x, y, z in zip(GRAD_NAMES, got, want, both):
        assert torch.equal(x, y) and torch.equal(z, y), name


def test_save_settings_keep_what_they_name():
    """What _fwd_checkpointed keeps for the backward (`save`, torch_kda.kda's
    save_for_backward): "none" no states and no records (empty outputs), and
    torch_kda.kda's backward recomputes them (K2 and K1 run there); "states"
    the states alone (K1 runs there); "states_and_records", the default, both
    (neither runs); the same gradients bit for bit with each."""
    _, g = cuda_inputs(B=1, T=300, H=2, state_dtype=torch.float32)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")

    def grads_and_launches(save):
        leaves = {n: g[n].detach().clone().requires_grad_() for n in names}
        out, _ = torch_kda.kda(*(leaves[n] for n in names), lower_bound=-5.0, initial_state=g["initial_state"],
                               save_for_backward=save)
        _, k1, k2 = kernel_launches(lambda: out.backward(torch.ones_like(out)))
        return [leaves[n].grad for n in names], (k1, k2)

    args = (*positional(g), None, -5.0, None, False, None)
    _, _, ckpt, records = torch.ops.kda._fwd_checkpointed(*args, save="none")
    assert ckpt.shape == (0, 2, D, D) and records.shape == (0, 2, RECORD_FLOATS)
    _, _, ckpt, records = torch.ops.kda._fwd_checkpointed(*args, save="states")
    assert ckpt.shape == (19, 2, D, D) and records.shape == (0, 2, RECORD_FLOATS)
    for kw in (dict(save="states_and_records"), {}):
        _, _, ckpt, records = torch.ops.kda._fwd_checkpointed(*args, **kw)
        assert ckpt.shape == (19, 2, D, D) and records.shape == (19, 2, RECORD_FLOATS), kw
    off, launches_off = grads_and_launches("none")
    states, launches_states = grads_and_launches("states")
    on, launches_on = grads_and_launches("states_and_records")
    assert (launches_off, launches_states, launches_on) == ((1, 1), (1, 0), (0, 0))
    for name, x, y, z in zip(names, off, states, on):
        assert torch.equal(x, z) and torch.equal(y, z), name


def test_bad_save_setting_raises():
    """A `save` outside the three raises: ValueError from torch_kda.kda, naming
    its keyword, RuntimeError from the op, naming it."""
    _, g = cuda_inputs(B=1, T=40, H=2, state_dtype=torch.float32)
    leaves = [t.detach().clone().requires_grad_() for t in positional(g)]
    choices = "'states_and_records', 'states', 'none', got 'all'"
    with pytest.raises(ValueError, match=re.escape(f"torch_kda.kda: save_for_backward must be one of {choices}")):
        torch_kda.kda(*leaves, lower_bound=-5.0, initial_state=g["initial_state"], save_for_backward="all")
    with pytest.raises(RuntimeError, match=re.escape(f"kda.fwd: save must be one of {choices}")):
        torch.ops.kda._fwd_checkpointed(*positional(g), None, -5.0, None, False, None, save="all")


@pytest.mark.parametrize("ds_block", ["auto", "4x1", "4x2", "2x2"])
@pytest.mark.parametrize("window", [0, 5])
def test_backward_with_nan_filled_scratch_is_unchanged(ds_block, window):
    """kda.bwd with every uninitialised allocation NaN-filled (its outputs and all
    the scratch between its kernels: records, chunk states, dS1, record gradients,
    carries), in one pass and in windows, in the dS recurrence's automatic shape and
    the three forced ones: the gradients bit for bit those of a normal call, so no kernel
    reads an element another did not write."""
    from conftest import nan_filled_empty

    with forced(ds_block=ds_block, window_slots=window):
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


def test_autograd_uses_the_forward_checkpoints():
    """torch_kda.kda with a gradient wanted on CUDA keeps the chunk-start states
    and the records, and its backward (in 3 windows) runs no K2 and no K1 for
    the records: the gradients of kda.bwd without them, bit for bit, again on a
    second backward through the same graph, and with a gradient into the final
    state alone (out's then zero)."""
    _, g = cuda_inputs(B=1, T=4000, H=96, state_dtype=torch.float32)
    assert math.ceil(250 / window_floor(96)) == 3
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
        _, k1, k2 = kernel_launches(lambda: torch.autograd.backward(outputs, grads, retain_graph=True))
        assert (k1, k2) == (0, 0), len(grads)
        for name, t, y in zip(GRAD_NAMES, (*leaves.values(), init), want):
            assert torch.equal(t.grad, y), (len(grads), name)


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


@pytest.mark.parametrize("case", ["random", "weak_decay"])
def test_prepare_backward_matches_reference(case):
    """K1's backward alone (kda_testing.prepare_bwd) against reference.chunk_record_backward
    in float64, chunk by chunk, on random record gradients; the last chunk of each
    sequence is partial (the padding rows' gradients must not leak into it). Weak
    decay keeps exp(G_last) near 1, where the decay terms weigh most."""
    from torch_kda import reference

    B, T, H = 2, 37, 3
    d, g = cuda_inputs(B=B, T=T, H=H)
    hard_case(case, d, g)
    nch = (T + 15) // 16
    d_record = torch.randn(B * nch, H, RECORD_GRAD_FLOATS, device=DEV)
    got = torch.ops.kda_testing.prepare_bwd(g["q"], g["k"], g["v"], g["g"], g["beta"], g["A_log"], g["dt_bias"],
                                            d_record, None, -5.0)
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
                parts = record_grad_parts(r)
                drec = {n: t if n == "gl" else t[:L, :L] if n == "Aqk" else t[:L] for n, t in parts.items()}
                res = reference.chunk_record_backward(qn[bb, s:e, h], kn[bb, s:e, h], x["v"][bb, s:e, h],
                                                      lam[bb, s:e, h], b[bb, s:e, h], D ** -0.5, drec)
                for w, t in zip(want, res):
                    w[bb, s:e, h] = t
    for name, w, t in zip(names, want, got):
        err = rel(t.cpu(), w)
        print(f"{name}: rel {err:.2e}")
        assert torch.isfinite(t).all(), name
        # fp32 with its 16 x 16 by 16 x 128 products in bf16x3: up to ~1e-5 on the GPU
        assert err <= 2e-5, name


@pytest.mark.parametrize("case, ds_block", [("random", "auto"), ("weak_decay", "auto"), ("random", "4x1"),
                                            ("weak_decay", "4x2"), ("random", "4x2"), ("weak_decay", "4x1")])
def test_sweep_backward_matches_reference(case, ds_block):
    """The backward sweep alone (kda_testing.sweep_bwd, after K1), in the dS recurrence's
    automatic block shape or a forced one (torch_kda.testing.forced), from chunk-start states
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

    B, T, H = 2, 37, 2
    d, g = cuda_inputs(B=B, T=T, H=H, state_dtype=torch.float32)
    hard_case(case, d, g)
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
    with forced(ds_block=ds_block):
        d_record, d_initial, d_states = torch.ops.kda_testing.sweep_bwd(
            g["q"], g["k"], g["v"], g["g"], g["beta"], g["A_log"], g["dt_bias"], states.to(DEV), grad_out,
            grad_final, None, -5.0)
    torch.cuda.synchronize()
    assert d_states.dtype == torch.bfloat16
    got_ds = d_states.double().cpu()
    want_ds = torch.zeros(B * nch, H, D, D, dtype=torch.float64)
    want_rec = torch.zeros(B * nch, H, RECORD_GRAD_FLOATS, dtype=torch.float64)
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
                w = record_grad_parts(want_rec[bb * nch + ci, h])
                for n in ("Qs", "W", "Kd", "U0"):
                    w[n][:L] = dr[n]
                w["Aqk"][:L, :L] = dr["Aqk"]
                w["gl"][:] = dr["gl"]
            want_init[bb, h] = dS
    err = rel(got_ds, want_ds)
    print(f"d_states: rel {err:.2e}")
    assert err <= 3e-3  # bf16's rounding: 1.67e-3 measured on the H200
    for part, cols in RECORD_GRAD_SLICES.items():
        name = "d" + part
        err = rel(d_record[..., cols].cpu(), want_rec[..., cols])
        print(f"{name}: rel {err:.2e}")
        assert err <= 5e-5, name  # the fp32 side's bf16 hi + lo planes keep ~2^-17
    err = rel(d_initial.cpu(), want_init)
    print(f"d_initial: rel {err:.2e}")
    assert err <= 5e-5
