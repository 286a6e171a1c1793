"""torch_kda.reference (the chunked form in the kernels' terms: the chunked forward, its
hand-derived gradients, the per-chunk record and step) against the float64
token-by-token reference, torch_kda.naive."""
import importlib.util
import os

import pytest
import torch

from conftest import make_inputs, positional, reference_kda, rel
from torch_kda import reference
from torch_kda.reference import kda_chunked, kda_chunked_backward


def _strong_decay(d):
    """exp(A_log) = e^4 with the softplus gate: G falls by ~50 per token, so exp(G_i - G_j)
    above the diagonal would overflow if anything formed it."""
    d["A_log"].fill_(4.0)
    return d


@pytest.mark.parametrize("lower_bound,strong", [(-5.0, False), (None, False), (None, True)])
@pytest.mark.parametrize("chunk_size", [16, 5])
def test_package_forward_references(lower_bound, strong, chunk_size):
    d = make_inputs(B=2, T=37, H=2, K=6, V=5, dtype=torch.float64, state_dtype=torch.float64)
    if strong:
        _strong_decay(d)
    ref_out, ref_final = reference_kda(*positional(d), lower_bound=lower_bound, initial_state=d["initial_state"])
    out, final = kda_chunked(*positional(d), lower_bound=lower_bound, initial_state=d["initial_state"],
                             chunk_size=chunk_size)
    assert rel(out, ref_out) <= 1e-12
    assert rel(final, ref_final) <= 1e-12


@pytest.mark.parametrize("lower_bound,strong", [(-5.0, False), (-0.1, False), (None, False), (None, True)])
@pytest.mark.parametrize("chunk_size", [16, 4])
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("with_final_grad", [True, False])
def test_chunked_backward_matches_autograd(lower_bound, strong, chunk_size, with_state, with_final_grad):
    d = make_inputs(B=2, T=37, H=2, K=6, V=5, dtype=torch.float64,
                    state_dtype=torch.float64 if with_state else None)
    if strong:
        _strong_decay(d)
    leaves = [t.clone().requires_grad_() for t in positional(d)]
    init = d["initial_state"].clone().requires_grad_() if with_state else None
    out, final = reference_kda(*leaves, lower_bound=lower_bound, initial_state=init)
    grad_out = torch.randn_like(out)
    grad_final = torch.randn_like(final) if with_final_grad else None
    outputs, grads = (out, final), (grad_out, grad_final if with_final_grad else torch.zeros_like(final))
    expected = torch.autograd.grad(outputs, leaves + ([init] if with_state else []), grads)

    got = kda_chunked_backward(*positional(d), grad_out, grad_final, lower_bound=lower_bound,
                               initial_state=d["initial_state"], chunk_size=chunk_size)
    names = ["dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state"]
    # Under strong decay dA_log sums terms far larger than itself: float64 cancellation.
    tol = 1e-8 if strong else 1e-10
    for name, g, e in zip(names, got, expected):
        assert rel(g, e) <= tol, name
    if not with_state:
        assert got[7] is None


# --------------------------------------------------------------------------
# The forward kernels' record and the backward of one chunk step in its terms
# --------------------------------------------------------------------------


def _chunk_inputs(C, K=8, V=6, lower_bound=-5.0):
    q, k = torch.randn(C, K, dtype=torch.float64), torch.randn(C, K, dtype=torch.float64)
    qn = q / q.norm(dim=-1, keepdim=True)
    kn = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(C, V, dtype=torch.float64)
    lam = lower_bound * torch.rand(C, K, dtype=torch.float64)
    b = torch.rand(C, dtype=torch.float64)
    return qn, kn, v, lam, b


def _one_sequence(T, H, K, V):
    """float64 inputs of one sequence and an initial state."""
    q, k, v, g = (torch.randn(1, T, H, d, dtype=torch.float64) for d in (K, K, V, K))
    beta, A_log, dt_bias = (torch.randn(1, T, H, dtype=torch.float64), torch.rand(H, dtype=torch.float64),
                            torch.rand(H, K, dtype=torch.float64))
    return q, k, v, g, beta, A_log, dt_bias, torch.randn(1, H, V, K, dtype=torch.float64)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_chunk_records_compose_to_the_recurrence(lower_bound):
    """Record + step, chunk after chunk, is the token-by-token recurrence (a last
    partial chunk included)."""
    T, H, K = 37, 2, 8
    q, k, v, g, beta, A_log, dt_bias, h0 = _one_sequence(T, H, K, V=6)
    ref_out, ref_final = reference_kda(q, k, v, g, beta, A_log, dt_bias, lower_bound=lower_bound,
                                                 initial_state=h0)
    qn, kn, lam, b = reference.activations(q, k, g, beta, A_log, dt_bias, lower_bound)
    scale = K ** -0.5
    out = torch.full_like(ref_out, float("nan"))
    for h in range(H):
        S = h0[0, h].clone()
        for s in range(0, T, 16):
            e = min(T, s + 16)
            rec = reference.chunk_record(qn[0, s:e, h], kn[0, s:e, h], v[0, s:e, h], lam[0, s:e, h], b[0, s:e, h],
                                         scale)
            out[0, s:e, h], S, _ = reference.chunk_step(S, rec)
        assert torch.allclose(S, ref_final[0, h], rtol=1e-10, atol=1e-12)
    assert torch.allclose(out, ref_out, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("C", [16, 5])
def test_chunk_step_backward_matches_autograd(C):
    K, V = 8, 6
    S = torch.randn(V, K, dtype=torch.float64, requires_grad=True)
    rec = dict(Qs=torch.randn(C, K), W=torch.randn(C, K), Kd=torch.randn(C, K), Aqk=torch.randn(C, C).tril(),
               U0=torch.randn(C, V), gl=torch.rand(K))
    rec = {n: t.double().requires_grad_() for n, t in rec.items()}
    dO, dS1 = torch.randn(C, V, dtype=torch.float64), torch.randn(V, K, dtype=torch.float64)
    O, S1, U = reference.chunk_step(S, rec)
    names = list(rec)
    grads = torch.autograd.grad((O * dO).sum() + (S1 * dS1).sum(), [S] + [rec[n] for n in names])
    dS, drec = reference.chunk_step_backward(S.detach(), {n: t.detach() for n, t in rec.items()}, U.detach(), dO,
                                             dS1)
    assert torch.allclose(dS, grads[0], rtol=1e-12, atol=1e-12)
    for n, g in zip(names, grads[1:]):
        assert torch.allclose(drec[n], g, rtol=1e-12, atol=1e-12), n


@pytest.mark.parametrize("C", [16, 5])
@pytest.mark.parametrize("lower_bound", [-5.0, -0.1])
def test_chunk_record_backward_matches_autograd(C, lower_bound):
    inputs = [t.requires_grad_() for t in _chunk_inputs(C, lower_bound=lower_bound)]
    scale = 8 ** -0.5
    rec = reference.chunk_record(*inputs, scale)
    drec = {n: torch.randn_like(t) for n, t in rec.items()}
    loss = sum((rec[n] * drec[n]).sum() for n in rec)
    grads = torch.autograd.grad(loss, inputs)
    mine = reference.chunk_record_backward(*(t.detach() for t in inputs), scale, drec)
    # T^T X as a product with T = (I + A)^-1 (precision_emulation.py rounds it): the same.
    by_product = reference.chunk_record_backward(*(t.detach() for t in inputs), scale, drec,
                                                 t_product=lambda Tt, X: Tt @ X)
    for name, a, p, g in zip(("dqn", "dkn", "dv", "dlam", "db"), mine, by_product, grads):
        assert torch.allclose(a, g, rtol=1e-10, atol=1e-10), name
        assert torch.allclose(p, g, rtol=1e-10, atol=1e-10), name


@pytest.mark.parametrize("T", [87, 64, 9])
@pytest.mark.parametrize("every, ds_every", [(16, None), (64, None), (16, 64), (32, 16)])
def test_kept_state_backward_matches_autograd(T, every, ds_every):
    """benchmarks/precision_emulation.py's backward from states and state gradients
    kept every 16 or 64 tokens, the states every 16 and their gradients every 64,
    or the states every 32 and their gradients every 16 (the inner ones recomputed:
    forward from a block's start state, backward from its end gradient), with nothing
    rounded, gives autograd's gradients through chunk_record and chunk_step, the
    initial state's too."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "precision_emulation.py")
    spec = importlib.util.spec_from_file_location("precision_emulation", path)
    emulation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulation)
    K, V = 8, 6
    leaves = [t.requires_grad_() for t in _chunk_inputs(T, K, V)]
    h0 = torch.randn(V, K, dtype=torch.float64, requires_grad=True)
    dout, dfinal = torch.randn(T, V, dtype=torch.float64), torch.randn(V, K, dtype=torch.float64)
    S, loss = h0, 0.0
    for s in range(0, T, 16):
        c = slice(s, s + 16)
        O, S, _ = reference.chunk_step(S, reference.chunk_record(*(x[c] for x in leaves), K ** -0.5))
        loss = loss + (O * dout[c]).sum()
    grads = torch.autograd.grad(loss + (S * dfinal).sum(), leaves + [h0])
    mine = emulation.kept_state_grads(*(x.detach() for x in leaves), h0.detach(), dout, dfinal, every, None,
                                      ds_every=ds_every)
    for name, a, g in zip(("dqn", "dkn", "dv", "dlam", "db", "dh0"), mine, grads):
        assert torch.allclose(a, g, rtol=1e-10, atol=1e-10), name
