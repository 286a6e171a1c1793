"""kda_testing::bwd_chunked (the backward over 16-token chunks written with ATen ops,
the same chunked math as the CUDA backward's kernels) against kda::bwd's token-by-token CPU
kernel, in float64 on fresh random inputs: every gradient, fixed and variable
length, with and without states, both gates."""
import pytest
import torch

import torch_kda  # noqa: F401
from conftest import make_inputs, positional, rel

F64 = torch.float64
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state")


def both(d, grad_final, lower_bound, scale=None):
    grad_out = torch.randn(*d["v"].shape, dtype=d["v"].dtype)
    kw = dict(scale=scale, lower_bound=lower_bound, initial_state=d["initial_state"], cu_seqlens=d["cu_seqlens"])
    gf = None
    if grad_final:
        N = d["initial_state"].shape[0] if d["initial_state"] is not None else (
            d["cu_seqlens"].numel() - 1 if d["cu_seqlens"] is not None else d["q"].shape[0])
        H, K, V = d["q"].shape[2], d["q"].shape[3], d["v"].shape[3]
        gf = torch.randn(N, H, V, K, dtype=d["v"].dtype)
    ref = torch.ops.kda.bwd(grad_out, gf, *positional(d), **kw)
    got = torch.ops.kda_testing.bwd_chunked(grad_out, gf, *positional(d), **kw)
    return ref, got


def assert_close(ref, got, tol):
    for name, r, x in zip(NAMES, ref, got):
        assert x.shape == r.shape and x.dtype == r.dtype, name
        if r.numel() == 0:
            continue
        assert torch.isfinite(x).all(), name
        if torch.count_nonzero(r) == 0:  # e.g. the gate's gradients when nothing decays a state
            assert x.abs().max() <= 1e-12, name
            continue
        assert rel(x, r) <= tol, f"{name}: rel {rel(x, r):.2e}"


@pytest.mark.parametrize("lower_bound", [-5.0, -0.1, None])
@pytest.mark.parametrize("with_state,grad_final", [(False, False), (True, False), (True, True), (False, True)])
@pytest.mark.parametrize("T", [1, 16, 37])
def test_fixed_length_matches_token_kernel(lower_bound, with_state, grad_final, T):
    d = make_inputs(B=2, T=T, H=3, K=8, V=6, dtype=F64, state_dtype=F64 if with_state else None)
    ref, got = both(d, grad_final, lower_bound)
    assert_close(ref, got, 1e-10)


@pytest.mark.parametrize("lower_bound", [-1.0, None])
@pytest.mark.parametrize("cu_dtype", [torch.int64, torch.int32])
def test_varlen_matches_token_kernel(lower_bound, cu_dtype):
    d = make_inputs(seqlens=[5, 0, 16, 33, 1, 0], H=2, K=5, V=7, dtype=F64, state_dtype=F64, cu_dtype=cu_dtype)
    ref, got = both(d, True, lower_bound, scale=0.7)
    assert_close(ref, got, 1e-10)


def test_varlen_gradients_stay_inside_their_sequence():
    """A loss on one sequence's output leaves every other sequence's gradients zero."""
    d = make_inputs(seqlens=[20, 13, 40], H=2, K=4, V=3, dtype=F64, state_dtype=F64)
    grad_out = torch.zeros(*d["v"].shape, dtype=F64)
    grad_out[:, 20:33] = torch.randn(1, 13, 2, 3, dtype=F64)
    dq, dk, dv, dg, dbeta, _, _, dinit = torch.ops.kda_testing.bwd_chunked(
        grad_out, None, *positional(d), lower_bound=-2.0, initial_state=d["initial_state"], cu_seqlens=d["cu_seqlens"])
    for t in (dq, dk, dv, dg, dbeta):
        assert torch.count_nonzero(t[:, :20]) == 0 and torch.count_nonzero(t[:, 33:]) == 0
        assert torch.count_nonzero(t[:, 20:33]) > 0
    assert torch.count_nonzero(dinit[0]) == 0 and torch.count_nonzero(dinit[2]) == 0 and torch.count_nonzero(dinit[1]) > 0


def test_weak_decay_long_sequence_matches_token_kernel():
    d = make_inputs(B=1, T=300, H=2, K=16, V=16, dtype=F64, state_dtype=F64)
    d["A_log"].fill_(2.0)
    d["dt_bias"].fill_(-8.0)
    ref, got = both(d, True, -5.0)
    assert_close(ref, got, 1e-10)


def test_fp32_inputs_are_computed_in_fp32():
    """bf16/fp32 inputs run in fp32 (the CUDA backward's precision): close to the fp64 result."""
    d64 = make_inputs(B=1, T=200, H=2, K=32, V=32, dtype=F64, state_dtype=F64)
    d32 = {n: (t.float() if t is not None and t.is_floating_point() else t) for n, t in d64.items()}
    grad_out = torch.randn(1, 200, 2, 32, dtype=F64)
    gf = torch.randn(1, 2, 32, 32, dtype=F64)
    ref = torch.ops.kda.bwd(grad_out, gf, *positional(d64), lower_bound=-5.0, initial_state=d64["initial_state"])
    got = torch.ops.kda_testing.bwd_chunked(grad_out.float(), gf.float(), *positional(d32), lower_bound=-5.0,
                                     initial_state=d32["initial_state"])
    for name, r, x in zip(NAMES, ref, got):
        assert x.dtype == torch.float32, name
        assert rel(x.double(), r) <= 1e-4, f"{name}: rel {rel(x.double(), r):.2e}"


def test_varlen_one_long_many_short_matches_token_kernel():
    """Sequences are processed longest first, each only for its own chunks (the
    layout a packed batch of one long and many short documents needs)."""
    d = make_inputs(seqlens=[3, 300, 0] + [16] * 20 + [1, 45], H=2, K=8, V=8, dtype=F64, state_dtype=F64)
    ref, got = both(d, True, -5.0)
    assert_close(ref, got, 1e-10)


def test_inputs_are_not_modified():
    d = make_inputs(B=2, T=20, H=1, K=1, V=1, dtype=F64, state_dtype=F64)
    grad_out = torch.randn(*d["v"].shape, dtype=F64)
    gf = torch.randn(2, 1, 1, 1, dtype=F64)
    before = [t.clone() for t in (grad_out, gf, *(x for x in positional(d)), d["initial_state"])]
    torch.ops.kda_testing.bwd_chunked(grad_out, gf, *positional(d), lower_bound=-1.0, initial_state=d["initial_state"])
    after = (grad_out, gf, *(x for x in positional(d)), d["initial_state"])
    for b, a in zip(before, after):
        assert torch.equal(b, a)


@pytest.mark.parametrize("op", ["kda.bwd", "kda_testing.bwd_chunked"])
def test_backward_with_nan_filled_scratch_is_unchanged(op):
    """The CPU backwards with every uninitialised allocation NaN-filled (their
    outputs and scratch): the same gradients bit for bit, on a varlen batch with an
    empty sequence and partial chunks, so none reads memory it did not write."""
    from conftest import nan_filled_empty

    d = make_inputs(seqlens=[21, 0, 40], H=2, K=8, V=6, dtype=F64, state_dtype=F64)
    grad_out = torch.randn(*d["v"].shape, dtype=F64)
    gf = torch.randn(*d["initial_state"].shape, dtype=F64)
    kw = dict(lower_bound=-5.0, initial_state=d["initial_state"], cu_seqlens=d["cu_seqlens"])
    namespace, name = op.split(".")
    fn = getattr(getattr(torch.ops, namespace), name)
    want = fn(grad_out, gf, *positional(d), **kw)
    with nan_filled_empty():
        probe = torch.empty(3, dtype=F64)
        got = fn(grad_out, gf, *positional(d), **kw)
    assert torch.isnan(probe).all()  # the fill is on: the comparison below could fail
    for name, x, y in zip(NAMES, got, want):
        assert torch.equal(x, y), name
