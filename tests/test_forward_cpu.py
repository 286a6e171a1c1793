"""torch_kda.kda forward on the CPU against the tests' float64 reference."""
import pytest
import torch

import torch_kda
from conftest import make_inputs, positional, rel, run_reference

GATES = [-5.0, -1.0, -0.1, None]
GATE_IDS = ["lb-5", "lb-1", "lb-0.1", "softplus"]

# rel(out) bound per input dtype: the op accumulates in fp32 (fp64 for fp64 inputs);
# for 16-bit inputs the error is the rounding of the output to the input dtype.
OUT_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def run_kda(d, **kwargs):
    return torch_kda.kda(
        *positional(d), initial_state=d["initial_state"], cu_seqlens=d["cu_seqlens"], **kwargs
    )


def check_against_reference(d, out_tol, state_tol, **kwargs):
    out, final = run_kda(d, output_final_state=True, **kwargs)
    ref_out, ref_final = run_reference(d, **kwargs)
    assert out.shape == ref_out.shape and out.dtype == d["q"].dtype
    assert final.shape == ref_final.shape
    assert rel(out, ref_out) <= out_tol
    assert rel(final, ref_final) <= state_tol
    return out, final


@pytest.mark.parametrize("lower_bound", GATES, ids=GATE_IDS)
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_forward_matches_reference(lower_bound, with_state, varlen):
    state_dtype = torch.float32 if with_state else None
    if varlen:
        d = make_inputs(H=3, K=16, V=8, seqlens=[17, 1, 0, 33], state_dtype=state_dtype)
    else:
        d = make_inputs(B=2, T=37, H=3, K=16, V=8, state_dtype=state_dtype)
    _, final = check_against_reference(d, 1e-5, 1e-5, lower_bound=lower_bound)
    assert final.dtype == torch.float32


@pytest.mark.parametrize("cu_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("lower_bound", [-1.0, None], ids=["bounded", "softplus"])
def test_varlen_odd_and_empty_sequences(cu_dtype, lower_bound):
    seqlens = [0, 1, 17, 0, 33, 0]
    d = make_inputs(H=2, K=8, V=8, seqlens=seqlens, cu_dtype=cu_dtype, state_dtype=torch.float32)
    assert d["cu_seqlens"].dtype == cu_dtype
    _, final = check_against_reference(d, 1e-5, 1e-5, lower_bound=lower_bound)
    # The state of an empty sequence passes through unchanged.
    for n, length in enumerate(seqlens):
        if length == 0:
            assert torch.equal(final[n], d["initial_state"][n])
        else:
            assert not torch.equal(final[n], d["initial_state"][n])


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_varlen_equals_separate_calls(lower_bound):
    seqlens = [5, 0, 19, 1, 12]
    d = make_inputs(H=2, K=8, V=4, seqlens=seqlens, state_dtype=torch.float32)
    out, final = run_kda(d, lower_bound=lower_bound, output_final_state=True)
    start = 0
    for n, length in enumerate(seqlens):
        part = {name: d[name][:, start : start + length] for name in ("q", "k", "v", "g", "beta")}
        part.update(A_log=d["A_log"], dt_bias=d["dt_bias"], initial_state=d["initial_state"][n : n + 1])
        part["cu_seqlens"] = None
        o, f = run_kda(part, lower_bound=lower_bound, output_final_state=True)
        torch.testing.assert_close(out[:, start : start + length], o, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(final[n : n + 1], f, rtol=1e-6, atol=1e-6)
        start += length


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_input_dtypes(dtype, lower_bound):
    # The reference reads the inputs as given, i.e. already rounded to `dtype`.
    d = make_inputs(B=2, T=29, H=2, K=16, V=16, dtype=dtype)
    state_tol = 1e-12 if dtype == torch.float64 else 1e-5
    _, final = check_against_reference(d, OUT_TOL[dtype], state_tol, lower_bound=lower_bound)
    assert final.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32])
def test_state_dtypes(state_dtype, input_dtype):
    d = make_inputs(H=2, K=16, V=16, seqlens=[21, 3, 40], dtype=input_dtype, state_dtype=state_dtype)
    # A bf16 state is rounded once on the way out; an fp32 state is not rounded.
    state_tol = 1e-2 if state_dtype == torch.bfloat16 else 1e-5
    _, final = check_against_reference(d, OUT_TOL[input_dtype], state_tol, lower_bound=-1.0)
    assert final.dtype == state_dtype


def test_output_final_state_false_returns_none():
    d = make_inputs(B=2, T=7, state_dtype=torch.float32)
    out, final = run_kda(d, lower_bound=-1.0)
    assert final is None
    ref_out, _ = run_reference(d, lower_bound=-1.0)
    assert rel(out, ref_out) <= 1e-5


def test_scale_default_and_given():
    K = 16
    d = make_inputs(B=2, T=19, H=2, K=K, V=8, dtype=torch.float64)
    default, _ = run_kda(d, lower_bound=-1.0)
    explicit, _ = run_kda(d, lower_bound=-1.0, scale=K**-0.5)
    ref_default, _ = run_reference(d, lower_bound=-1.0)  # the reference resolves None itself
    assert rel(default, ref_default) <= 1e-12
    assert rel(explicit, ref_default) <= 1e-12
    scale = 0.3 + torch.rand(()).item()
    given, _ = run_kda(d, lower_bound=-1.0, scale=scale)
    ref_given, _ = run_reference(d, lower_bound=-1.0, scale=scale)
    assert rel(given, ref_given) <= 1e-12
    assert rel(given, ref_default) > 1e-3  # the scale is really used


@pytest.mark.parametrize("K,V", [(16, 8), (8, 16), (5, 3), (128, 128)])
def test_head_sizes(K, V):
    T = 20 if K == 128 else 45
    d = make_inputs(B=1, T=T, H=2, K=K, V=V, state_dtype=torch.float32)
    check_against_reference(d, 1e-5, 1e-5, lower_bound=-1.0)


@pytest.mark.parametrize("T", [1, 15, 17, 63, 65, 100])
def test_lengths_not_multiple_of_chunk(T):
    d = make_inputs(B=2, T=T, H=2, K=16, V=8, state_dtype=torch.float32)
    check_against_reference(d, 1e-5, 1e-5, lower_bound=-5.0)


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_empty_sequence_passes_state_through(state_dtype, varlen):
    if varlen:
        d = make_inputs(H=2, K=8, V=4, seqlens=[0, 0, 0], state_dtype=state_dtype)
    else:
        d = make_inputs(B=3, T=0, H=2, K=8, V=4, state_dtype=state_dtype)
    out, final = run_kda(d, lower_bound=-1.0, output_final_state=True)
    assert out.shape == (d["q"].shape[0], 0, 2, 4)
    if state_dtype is None:
        assert final.dtype == torch.float32
        assert torch.equal(final, torch.zeros(3, 2, 4, 8))
    else:
        assert final.dtype == state_dtype
        assert torch.equal(final, d["initial_state"])
        assert final.data_ptr() != d["initial_state"].data_ptr()  # a new tensor, not an alias


def test_varlen_with_no_sequences():
    d = make_inputs(H=2, K=8, V=4, seqlens=[])
    out, final = run_kda(d, lower_bound=-1.0, output_final_state=True)
    assert out.shape == (1, 0, 2, 4)
    assert final.shape == (0, 2, 4, 8)


def test_empty_batch():
    d = make_inputs(B=0, T=5, H=2, K=8, V=4)
    out, final = run_kda(d, lower_bound=-1.0, output_final_state=True)
    assert out.shape == (0, 5, 2, 4)
    assert final.shape == (0, 2, 4, 8)


def _strided_copy(x, perm):
    """A non-contiguous tensor equal to x: stored permuted by `perm`, every other element."""
    stored = x.permute(perm).contiguous()
    poison = float("nan") if stored.is_floating_point() else -12345
    wide = torch.stack([stored, torch.full_like(stored, poison)], dim=-1).flatten(-2)
    y = wide[..., ::2].permute(tuple(perm.index(i) for i in range(x.dim())))
    assert torch.equal(y, x) and not y.is_contiguous()
    return y


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_non_contiguous_inputs(varlen):
    if varlen:
        d = make_inputs(H=3, K=8, V=6, seqlens=[11, 0, 20], state_dtype=torch.float32)
    else:
        d = make_inputs(B=2, T=23, H=3, K=8, V=6, state_dtype=torch.float32)
    strided = {
        "q": d["q"].transpose(1, 2).contiguous().transpose(1, 2),  # [B, H, T, K] storage
        "k": _strided_copy(d["k"], (0, 2, 1, 3)),
        "v": _strided_copy(d["v"], (0, 1, 3, 2)),
        "g": _strided_copy(d["g"], (3, 2, 1, 0)),
        "beta": _strided_copy(d["beta"], (2, 0, 1)),
        "A_log": _strided_copy(d["A_log"], (0,)),
        "dt_bias": d["dt_bias"].T.contiguous().T,
        "initial_state": _strided_copy(d["initial_state"], (0, 1, 3, 2)),
        "cu_seqlens": None if d["cu_seqlens"] is None else _strided_copy(d["cu_seqlens"], (0,)),
    }
    assert not any(t.is_contiguous() for t in strided.values() if t is not None and t.dim() > 1)
    out_c, final_c = run_kda(d, lower_bound=-1.0, output_final_state=True)
    out_s, final_s = run_kda(strided, lower_bound=-1.0, output_final_state=True)
    torch.testing.assert_close(out_s, out_c, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(final_s, final_c, rtol=1e-6, atol=1e-6)
    ref_out, ref_final = run_reference(d, lower_bound=-1.0)
    assert rel(out_s, ref_out) <= 1e-5
    assert rel(final_s, ref_final) <= 1e-5


@pytest.mark.parametrize(
    "state_dtype,state_tol", [(torch.bfloat16, 5e-3), (torch.float32, 1e-4)], ids=["bf16_state", "fp32_state"]
)
def test_accuracy_target_random_case(state_dtype, state_tol):
    # The random case's targets: bf16 inputs, lower_bound = -5, T >= 1024, K = V = 128.
    d = make_inputs(B=1, T=1024, H=2, K=128, V=128, dtype=torch.bfloat16, state_dtype=state_dtype)
    out, final = check_against_reference(d, 5e-3, state_tol, lower_bound=-5.0)
    assert final.dtype == state_dtype


@pytest.mark.parametrize(
    "case",
    ["weak_decay_bounded", "weak_decay_softplus", "small_beta", "lb-0.1"],
)
def test_accuracy_hard_cases(case):
    # The hard cases, kept short for the CPU: every one must stay inside 2e-2.
    d = make_inputs(B=1, T=1024, H=2, K=64, V=64, dtype=torch.bfloat16, state_dtype=torch.float32)
    lower_bound = -5.0
    if case == "weak_decay_bounded":
        d["A_log"] = torch.full_like(d["A_log"], 2.0)
        d["dt_bias"] = torch.full_like(d["dt_bias"], -8.0)
    elif case == "weak_decay_softplus":
        d["A_log"] = torch.full_like(d["A_log"], -8.0)
        d["dt_bias"] = torch.full_like(d["dt_bias"], -8.0)
        lower_bound = None
    elif case == "small_beta":
        d["beta"] = (d["beta"].float() - 6.0).bfloat16()
    else:
        lower_bound = -0.1
    check_against_reference(d, 2e-2, 2e-2, lower_bound=lower_bound)
