"""torch_kda.fwd, the flash_kda drop-in: writes the caller's out / final_state,
returns None, and touches nothing else."""
import pytest
import torch

import torch_kda
from conftest import make_inputs, positional, rel, run_reference

BF16, F32 = torch.bfloat16, torch.float32


def _num_seqs(d):
    return d["q"].shape[0] if d["cu_seqlens"] is None else d["cu_seqlens"].numel() - 1


def _clone_all(d):
    return {n: (None if t is None else t.clone()) for n, t in d.items()}


def _call_fwd(d, out, final_state, scale, lower_bound):
    return torch_kda.fwd(
        d["q"],
        d["k"],
        d["v"],
        d["g"],
        d["beta"],
        scale,
        out,
        d["A_log"],
        d["dt_bias"],
        lower_bound,
        initial_state=d["initial_state"],
        final_state=final_state,
        cu_seqlens=d["cu_seqlens"],
    )


def _functional(d, scale, lower_bound):
    return torch_kda.kda(
        *positional(d),
        scale=scale,
        lower_bound=lower_bound,
        initial_state=d["initial_state"],
        output_final_state=True,
        cu_seqlens=d["cu_seqlens"],
    )


def _assert_inputs_unchanged(d, before):
    for name, t in d.items():
        if t is not None:
            assert torch.equal(t, before[name]), f"{name} was modified"


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
@pytest.mark.parametrize("state_dtype", [None, BF16, F32], ids=["no_state", "bf16_state", "fp32_state"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_fwd_writes_out_and_final_state(lower_bound, state_dtype, varlen):
    # flash_kda.fwd's shapes: bf16 activations, K = V = 128.
    if varlen:
        d = make_inputs(H=2, K=128, V=128, dtype=BF16, seqlens=[9, 0, 14], state_dtype=state_dtype)
    else:
        d = make_inputs(B=2, T=13, H=2, K=128, V=128, dtype=BF16, state_dtype=state_dtype)
    scale = 128**-0.5
    before = _clone_all(d)
    out = torch.full((*d["q"].shape[:3], 128), float("nan"), dtype=BF16)
    final_state = torch.full((_num_seqs(d), 2, 128, 128), float("nan"), dtype=state_dtype or F32)

    assert _call_fwd(d, out, final_state, scale, lower_bound) is None

    assert not out.isnan().any() and not final_state.isnan().any()
    _assert_inputs_unchanged(d, before)
    exp_out, exp_final = _functional(d, scale, lower_bound)
    assert torch.equal(out, exp_out)
    assert torch.equal(final_state, exp_final)
    ref_out, ref_final = run_reference(d, scale=scale, lower_bound=lower_bound)
    assert rel(out, ref_out) <= 1e-2
    assert rel(final_state, ref_final) <= (1e-2 if state_dtype == BF16 else 1e-5)


def test_fwd_without_final_state():
    d = make_inputs(B=2, T=10, H=2, K=16, V=8, state_dtype=F32)
    before = _clone_all(d)
    out = torch.full((2, 10, 2, 8), float("nan"))
    assert _call_fwd(d, out, None, None, -1.0) is None
    _assert_inputs_unchanged(d, before)
    exp_out, _ = _functional(d, None, -1.0)
    assert torch.equal(out, exp_out)


def test_fwd_non_contiguous_destinations_stay_in_bounds():
    d = make_inputs(B=2, T=11, H=3, K=8, V=6, state_dtype=F32)
    sentinel = -777.0
    # out: every other column of a wider buffer, stored [B, H, T, 2V].
    out_buf = torch.full((2, 3, 11, 12), sentinel)
    out = out_buf[..., ::2].transpose(1, 2)
    out.fill_(float("nan"))
    # final_state: K-first storage, every other row of a taller buffer.
    fs_buf = torch.full((2, 3, 16, 6), sentinel)
    final_state = fs_buf[:, :, ::2, :].transpose(-1, -2)
    final_state.fill_(float("nan"))
    assert not out.is_contiguous() and not final_state.is_contiguous()

    assert _call_fwd(d, out, final_state, None, -1.0) is None

    exp_out, exp_final = _functional(d, None, -1.0)
    torch.testing.assert_close(out, exp_out, rtol=0, atol=0)
    torch.testing.assert_close(final_state, exp_final, rtol=0, atol=0)
    # The elements between the views were not written.
    assert torch.equal(out_buf[..., 1::2], torch.full((2, 3, 11, 6), sentinel))
    assert torch.equal(fs_buf[:, :, 1::2, :], torch.full((2, 3, 8, 6), sentinel))


def test_fwd_state_updated_in_place():
    # Serving pattern: the same buffer is the initial and the final state.
    d = make_inputs(H=2, K=16, V=8, seqlens=[7, 0, 12], state_dtype=F32)
    exp_out, exp_final = _functional(d, None, -5.0)
    state = d["initial_state"].clone()
    out = torch.full((1, 19, 2, 8), float("nan"))
    d_alias = dict(d, initial_state=state)
    assert _call_fwd(d_alias, out, state, None, -5.0) is None
    assert torch.equal(out, exp_out)
    assert torch.equal(state, exp_final)


def test_fwd_empty_sequence_passes_state_through():
    d = make_inputs(B=2, T=0, H=2, K=8, V=4, state_dtype=BF16)
    out = torch.empty(2, 0, 2, 4)
    final_state = torch.full((2, 2, 4, 8), float("nan"), dtype=BF16)
    assert _call_fwd(d, out, final_state, None, -1.0) is None
    assert torch.equal(final_state, d["initial_state"])


def test_get_workspace_size_returns_int():
    for args in [(1024, 16), (8192, 96, 4), (0, 1, 1)]:
        size = torch_kda.get_workspace_size(*args)
        assert isinstance(size, int) and size >= 0
    assert isinstance(torch_kda.get_workspace_size(T_total=4096, H=8, N=2), int)
