"""Grouped value heads on the CPU: q and k [B, T, H, K], v, g, beta, A_log,
dt_bias and the states with HV = G H heads, value head j reading query/key head
j // G (fla's convention). Against the float64 reference with q and k repeated
per value head, forward and every gradient, fixed length and varlen with empty
and odd sequences, both gates; the in-place op and the state pool. On CUDA:
tests/test_cuda_grouped_heads.py."""
import pytest
import torch

import torch_kda
from conftest import make_inputs, positional, rel, run_reference
from torch_kda.naive import kda_naive

F64 = torch.float64
GATES = pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
SHAPES = pytest.mark.parametrize("shape", [
    dict(B=2, T=13, H=2, HV=4),
    dict(B=1, T=9, H=1, HV=3),
    dict(seqlens=[5, 0, 1, 11], H=2, HV=8),
], ids=["fixed_G2", "fixed_G3", "varlen_G4"])


def one_value_head(d, j):
    """Value head j alone, as an ungrouped problem with query/key head j // G."""
    G = d["v"].shape[2] // d["q"].shape[2]
    i = j // G
    x = {n: d[n][:, :, i:i + 1] for n in ("q", "k")}
    x.update({n: d[n][:, :, j:j + 1] for n in ("v", "g", "beta")})
    x.update(A_log=d["A_log"][j:j + 1], dt_bias=d["dt_bias"][j:j + 1], cu_seqlens=d["cu_seqlens"],
             initial_state=d["initial_state"][:, j:j + 1])
    return x


@GATES
@SHAPES
def test_forward_against_the_reference(shape, lower_bound):
    d = make_inputs(K=8, V=6, dtype=F64, state_dtype=F64, **shape)
    out, final = torch_kda.kda(*positional(d), lower_bound=lower_bound, initial_state=d["initial_state"],
                               output_final_state=True, cu_seqlens=d["cu_seqlens"])
    ref_out, ref_final = run_reference(d, lower_bound=lower_bound)
    assert out.shape == d["v"].shape and final.shape == d["initial_state"].shape
    assert rel(out, ref_out) <= 1e-12 and rel(final, ref_final) <= 1e-12
    # The reference's convention, head by head: value head j reads query/key head j // G.
    for j in range(d["v"].shape[2]):
        o, f = run_reference(one_value_head(d, j), lower_bound=lower_bound)
        assert torch.allclose(o[:, :, 0], ref_out[:, :, j]) and torch.allclose(f[:, 0], ref_final[:, j])


@GATES
@SHAPES
def test_gradients_against_the_reference(shape, lower_bound):
    """Every input's gradient (q and k summed over their group) against float64
    autograd through the reference."""
    d = make_inputs(K=4, V=3, dtype=F64, state_dtype=F64, requires_grad=True, **shape)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    out, final = torch_kda.kda(*positional(d), lower_bound=lower_bound, initial_state=d["initial_state"],
                               output_final_state=True, cu_seqlens=d["cu_seqlens"])
    w_out, w_final = torch.randn_like(out), torch.randn_like(final)
    got = torch.autograd.grad((out * w_out).sum() + (final * w_final).sum(), [d[n] for n in names])
    ref_out, ref_final = run_reference(d, lower_bound=lower_bound)
    want = torch.autograd.grad((ref_out * w_out).sum() + (ref_final * w_final).sum(), [d[n] for n in names])
    for n, x, r in zip(names, got, want):
        assert x.shape == d[n].shape, n
        assert rel(x, r) <= 1e-10, n


def test_bf16_inputs_within_the_precision_rules():
    d = make_inputs(B=1, T=64, H=2, HV=4, K=16, V=16, dtype=torch.bfloat16, state_dtype=torch.float32)
    out, final = torch_kda.kda(*positional(d), lower_bound=-5.0, initial_state=d["initial_state"],
                               output_final_state=True)
    ref_out, ref_final = run_reference(d, lower_bound=-5.0)
    assert rel(out, ref_out) <= 5e-3 and rel(final, ref_final) <= 1e-4


@GATES
def test_strong_and_weak_decay_tiny_beta(lower_bound):
    """Hard gates per value head: one head's decay resets the state every token, its
    group neighbour barely decays, and beta is tiny."""
    d = make_inputs(B=1, T=30, H=1, HV=2, K=8, V=8, dtype=F64, state_dtype=F64)
    d["g"][:, :, 0] = 50.0
    d["g"][:, :, 1] = -50.0
    d["beta"] -= 6.0
    out, final = torch_kda.kda(*positional(d), lower_bound=lower_bound, initial_state=d["initial_state"],
                               output_final_state=True)
    ref_out, ref_final = run_reference(d, lower_bound=lower_bound)
    assert rel(out, ref_out) <= 1e-10 and rel(final, ref_final) <= 1e-10


def test_inplace_op_writes_every_element():
    d = make_inputs(seqlens=[3, 0, 7], H=2, HV=6, K=4, V=5, dtype=F64, state_dtype=F64)
    out = torch.full(d["v"].shape, float("nan"), dtype=F64)
    final = torch.full(d["initial_state"].shape, float("nan"), dtype=F64)
    torch_kda.fwd(*positional(d)[:5], None, out, d["A_log"], d["dt_bias"], -1.0,
                  initial_state=d["initial_state"], final_state=final, cu_seqlens=d["cu_seqlens"])
    ref_out, ref_final = run_reference(d, lower_bound=-1.0)
    assert rel(out, ref_out) <= 1e-12 and rel(final, ref_final) <= 1e-12


def test_state_pool_decode():
    """Two decode steps of 3 requests from a pool of HV-head states."""
    d = make_inputs(B=3, T=2, H=2, HV=4, K=4, V=4, dtype=F64)
    pool = torch.randn(5, 4, 4, 4, dtype=F64)
    before = pool.clone()
    idx = torch.tensor([4, 0, 2])
    out = torch_kda.kda_pool(*positional(d), pool, idx, lower_bound=None)
    ref_out, ref_final = kda_naive(*positional(d), lower_bound=None, initial_state=before[idx])
    assert rel(out, ref_out) <= 1e-12 and rel(pool[idx], ref_final) <= 1e-12
    assert torch.equal(pool[[1, 3]], before[[1, 3]])


def test_value_heads_not_a_multiple_are_rejected():
    d = make_inputs(B=1, T=3, H=2, HV=3, K=4, V=4)
    with pytest.raises(RuntimeError, match=r"v must have a number of heads HV \(dim 2\) that is a multiple of q's H = 2"):
        torch_kda.kda(*positional(d))
