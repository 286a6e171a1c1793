"""Checks of the reference (torch_kda.naive) against second,
independently written formulations of the recurrence (README.md, "What it computes"): the chunked form, the
closed form of the first token, and the product form of the state update."""
import pytest
import torch

from conftest import make_inputs, positional, rel, run_reference
from torch_kda.naive import gate as reference_gate
from torch_kda.naive import sequence_bounds

F64 = torch.float64


def _l2(x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _neumann_inverse16(L):
    """(I + L)^-1 for a strictly lower triangular 16 x 16 L: (I - L)(I + L^2)(I + L^4)(I + L^8)."""
    eye = torch.eye(L.shape[-1], dtype=L.dtype)
    L2 = L @ L
    L4 = L2 @ L2
    L8 = L4 @ L4
    return (eye - L) @ (eye + L2) @ (eye + L4) @ (eye + L8)


def chunked_kda(q, k, v, g, beta, A_log, dt_bias, *, scale, lower_bound, initial_state, cu_seqlens, chunk):
    """The chunked form (docs/ARCHITECTURE.md), one (sequence, head) at a time, float64.

    exp(G_i - G_j) is computed from the differences directly (safe for both gates).
    For chunk == 16 the inverse of (I + A_kk) is the Neumann product, otherwise a
    triangular solve.
    """
    q, k, v, g, beta, A_log, dt_bias = (x.to(F64) for x in (q, k, v, g, beta, A_log, dt_bias))
    B, T, H, K = q.shape
    V = v.shape[-1]
    out = torch.full((B, T, H, V), float("nan"), dtype=F64)
    bounds = sequence_bounds(B, T, cu_seqlens)
    final = torch.full((len(bounds), H, V, K), float("nan"), dtype=F64)
    lam_all = reference_gate(g, A_log, dt_bias, lower_bound)  # [B, T, H, K]
    for n, (b, start, end) in enumerate(bounds):
        for h in range(H):
            S = torch.zeros(K, V, dtype=F64) if initial_state is None else initial_state[n, h].to(F64).T.clone()
            for c0 in range(start, end, chunk):
                c1 = min(c0 + chunk, end)
                C = c1 - c0
                Qh = _l2(q[b, c0:c1, h])  # [C, K]
                Kh = _l2(k[b, c0:c1, h])
                Vh = v[b, c0:c1, h]  # [C, V]
                bh = torch.sigmoid(beta[b, c0:c1, h])  # [C]
                G = lam_all[b, c0:c1, h].cumsum(0)  # [C, K]
                D = torch.exp(G[:, None, :] - G[None, :, :])  # D[i, j, d] = exp(G_i[d] - G_j[d])
                strict = torch.ones(C, C, dtype=torch.bool).tril(-1)
                causal = torch.ones(C, C, dtype=torch.bool).tril(0)
                Akk = bh[:, None] * torch.einsum("id,jd,ijd->ij", Kh, Kh, D.masked_fill(~strict[..., None], 0.0))
                Aqk = scale * torch.einsum("id,jd,ijd->ij", Qh, Kh, D.masked_fill(~causal[..., None], 0.0))
                rhs = bh[:, None] * (Vh - (torch.exp(G) * Kh) @ S)
                if C == 16:
                    U = _neumann_inverse16(Akk) @ rhs
                else:
                    U = torch.linalg.solve_triangular(
                        torch.eye(C, dtype=F64) + Akk, rhs, upper=False, unitriangular=True
                    )
                out[b, c0:c1, h] = scale * (torch.exp(G) * Qh) @ S + Aqk @ U
                S = torch.exp(G[-1])[:, None] * S + (torch.exp(G[-1] - G) * Kh).T @ U
            final[n, h] = S.T
    return out, final


@pytest.mark.parametrize("chunk", [16, 4])
@pytest.mark.parametrize("lower_bound", [-5.0, -1.0, -0.1, None])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_reference_matches_chunked_form(chunk, lower_bound, varlen):
    if varlen:
        d = make_inputs(H=2, K=8, V=6, dtype=F64, seqlens=[37, 0, 5, 16, 1], state_dtype=F64)
    else:
        d = make_inputs(B=2, T=41, H=2, K=8, V=6, dtype=F64, state_dtype=F64)
    scale = 0.3 + torch.rand(()).item()
    ref_out, ref_final = run_reference(d, scale=scale, lower_bound=lower_bound)
    out, final = chunked_kda(
        *positional(d),
        scale=scale,
        lower_bound=lower_bound,
        initial_state=d["initial_state"],
        cu_seqlens=d["cu_seqlens"],
        chunk=chunk,
    )
    assert not out.isnan().any() and not final.isnan().any()
    assert rel(ref_out, out) <= 1e-12
    assert rel(ref_final, final) <= 1e-12


def test_neumann_product_inverts_unit_lower_triangular():
    L = (0.5 * torch.randn(16, 16, dtype=F64)).tril(-1)
    inv = _neumann_inverse16(L)
    eye = torch.eye(16, dtype=F64)
    assert rel((eye + L) @ inv, eye) <= 1e-12


@pytest.mark.parametrize("lower_bound", [-1.0, None])
def test_reference_first_token_closed_form(lower_bound):
    # From a zero state, S_1 = beta k^ v^T, so o_1 = scale * beta * (q^ . k^) v.
    d = make_inputs(B=3, T=1, H=2, K=5, V=4, dtype=F64)
    scale = 0.7
    out, final = run_reference(d, scale=scale, lower_bound=lower_bound)
    qn, kn = _l2(d["q"][:, 0]), _l2(d["k"][:, 0])  # [B, H, K]
    b = torch.sigmoid(d["beta"][:, 0])  # [B, H]
    expect_out = scale * (b * (qn * kn).sum(-1))[..., None] * d["v"][:, 0]
    expect_final = b[..., None, None] * d["v"][:, 0, :, :, None] * kn[:, :, None, :]  # [B, H, V, K]
    assert rel(out[:, 0], expect_out) <= 1e-13
    assert rel(final, expect_final) <= 1e-13


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_reference_matches_product_form(lower_bound):
    # S_t = (I - beta k^ k^T) Diag(alpha) S_{t-1} + beta k^ v^T, o_t = scale S_t^T q^.
    d = make_inputs(B=2, T=13, H=3, K=6, V=5, dtype=F64, state_dtype=F64)
    out, final = run_reference(d, lower_bound=lower_bound)
    B, T, H, K = d["q"].shape
    lam = reference_gate(d["g"], d["A_log"], d["dt_bias"], lower_bound)
    eye = torch.eye(K, dtype=F64)
    expect = torch.empty_like(out)
    for bi in range(B):
        for h in range(H):
            S = d["initial_state"][bi, h].T
            for t in range(T):
                kn = _l2(d["k"][bi, t, h])
                qn = _l2(d["q"][bi, t, h])
                bt = torch.sigmoid(d["beta"][bi, t, h])
                S = (eye - bt * torch.outer(kn, kn)) @ torch.diag(torch.exp(lam[bi, t, h])) @ S + bt * torch.outer(
                    kn, d["v"][bi, t, h]
                )
                expect[bi, t, h] = K**-0.5 * S.T @ qn
            assert rel(final[bi, h], S.T) <= 1e-13
    assert rel(out, expect) <= 1e-13
