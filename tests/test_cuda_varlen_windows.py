"""The CUDA forward on packed sequences (cu_seqlens) and in windows (the
forward's schedule: K1 and K2 window by window, the states carried in fp32):
against the reference, against each sequence run alone, and bitwise against
one pass. Skipped where CUDA is absent; tools/gpu_check.sh runs them on an H200.
"""

import pytest
import torch

import torch_kda
from torch_kda.testing import forced
from conftest import fla_chunk_kda, positional, rel, run_reference
from cuda_helpers import (
    CUDA_MARKS,
    D,
    DEV,
    FP32_STATE_TOL,
    WINDOW_CASES,
    assert_each_sequence_alone_is_bitwise,
    cuda_inputs,
    errors,
    kernel_launches,
    run_cuda,
    run_windowed,
)

pytestmark = CUDA_MARKS


def test_varlen_agrees_with_fla_chunk_kda():
    seqlens = [300, 1, 0, 77, 1024, 16, 33]
    d, g = cuda_inputs(seqlens=seqlens, H=4, state_dtype=torch.float32)
    out, final = run_cuda(g)
    fla_out, fla_final = fla_chunk_kda(g, -5.0)
    assert rel(out.float(), fla_out.float()) <= 1e-2
    assert rel(final.float(), fla_final.float()) <= 1e-2


@pytest.mark.parametrize("cu_dtype", [torch.int64, torch.int32])
def test_varlen_matches_reference(cu_dtype):
    seqlens = [1, 17, 0, 33, 15, 16, 100, 0]
    d, g = cuda_inputs(seqlens=seqlens, H=2, cu_dtype=cu_dtype)
    e_out, e_state, _, _ = errors(d, g)
    assert e_out <= 5e-3 and e_state <= 1e-3


def test_varlen_equals_separate_calls_bitwise():
    """Each sequence computed alone gives bitwise the varlen result: the padded
    tail rows of a partial chunk never leak into the next sequence. (Both calls
    run one block shape, forced: across shapes the low bits may differ, see
    docs/ARCHITECTURE.md.)"""
    seqlens = [5, 16, 0, 31, 1, 47]
    d, g = cuda_inputs(seqlens=seqlens, H=2)
    with forced(recurrence_block="4x4"):
        out, final = run_cuda(g)
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


def test_empty_sequences_pass_state_through():
    d, g = cuda_inputs(seqlens=[0, 5, 0], H=2, state_dtype=torch.float32)
    _, final = run_cuda(g)
    assert torch.equal(final[0], g["initial_state"][0])
    assert torch.equal(final[2], g["initial_state"][2])
    assert not torch.equal(final[1], g["initial_state"][1])


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


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32, None])
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_windows_are_bitwise_one_pass(case, state_dtype):
    """Windows split the call but not the arithmetic: the states wait between
    windows in fp32, as they do on chip, so every window size gives the
    one-pass result bit for bit; sequences start, end and are empty at and
    across window edges."""
    kw, windows = WINDOW_CASES[case]
    d, g = cuda_inputs(state_dtype=state_dtype or torch.float32, **kw)
    if state_dtype is None:
        g["initial_state"] = None
    one_out, one_final = run_windowed(g, 0)
    for window in windows:
        out, final = run_windowed(g, window)
        assert torch.equal(out, one_out), window
        assert torch.equal(final, one_final), window


def test_window_setting_makes_windows():
    """forced(window_slots=...) really cuts the call: 2 x 300 tokens are 38 slots,
    so windows of 7 slots are 6 launches of each kernel; 0 is one pass."""
    d, g = cuda_inputs(B=2, T=300, H=2)
    with forced(window_slots=7):
        assert kernel_launches(lambda: run_cuda(g))[1:] == (6, 6)
    with forced(window_slots=0):
        assert kernel_launches(lambda: run_cuda(g))[1:] == (1, 1)


def test_outputs_overlapping_inputs_keep_one_pass():
    """out may share memory with the inputs (one pass reads every input before it
    writes): with windows forced, a later window's K1 would read q where an earlier
    window's K2 had written out, so the call stays in one pass."""
    T, S, H = 200, 64, 2
    d, g = cuda_inputs(B=1, T=T, H=H, state_dtype=torch.float32)
    clean_out, clean_final = run_windowed(g, 0)
    buf = torch.empty(1, T + S, H, D, dtype=torch.bfloat16, device=DEV)
    buf[:, :T] = g["q"]
    q_view, out_view = buf[:, :T], buf[:, S:]
    final = torch.full_like(clean_final, float("nan"))
    with forced(window_slots=2):
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


def test_windows_write_every_element_and_allow_inplace_state():
    """Poisoned outputs, and final_state given as the initial state's own buffer:
    window 0 reads it, the last window writes it."""
    d, g = cuda_inputs(seqlens=[3, 40, 0, 45, 19], H=2, state_dtype=torch.float32)
    ref_out, ref_final = run_reference(d, lower_bound=-5.0)
    state = g["initial_state"].clone()
    out = torch.full((1, 107, 2, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    with forced(window_slots=2):
        torch_kda.fwd(g["q"], g["k"], g["v"], g["g"], g["beta"], None, out, g["A_log"], g["dt_bias"], -5.0,
                      initial_state=state, final_state=state, cu_seqlens=g["cu_seqlens"])
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    assert rel(out.cpu(), ref_out) <= 5e-3
    assert rel(state.cpu(), ref_final) <= FP32_STATE_TOL


@pytest.mark.parametrize("T,H", [(65536, 16), (32768, 32)])
def test_automatic_windows_match_reference(T, H):
    """Few heads and many tokens: a one-pass workspace of 1.8 GB, so the call
    runs in windows by itself (test_automatic_windows_bound_memory); same bits
    as one pass, and the reference's values. Without segments, which the
    heuristics take for 16 heads of 65,536 tokens (test_cuda_segments.py)."""
    d, g = cuda_inputs(B=1, T=T, H=H, state_dtype=torch.float32)
    with forced(segments=1):
        e_out, e_state, out, final = errors(d, g)
    print(f"H={H} in windows: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= 5e-3 and e_state <= FP32_STATE_TOL
    one_out, one_final = run_windowed(g, 0)
    assert torch.equal(out, one_out) and torch.equal(final, one_final)


def test_automatic_windows_bound_memory():
    T, H = 65536, 16
    d, g = cuda_inputs(B=1, T=T, H=H, state_dtype=torch.float32)
    one_pass_workspace = (T // 16) * H * 27136
    peaks = {}
    for window in (None, 0):  # None: the automatic windows (segments off: they run in one pass)
        with forced(window_slots=window, segments=1):
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
    with forced(segments=1):
        assert kernel_launches(lambda: run_cuda(g))[1:] == (2, 2)
