"""Plain PyTorch evaluations of KDA (SPEC section 1), for documentation,
benchmarks' accuracy reports and debugging. Slow on purpose: one token (or one
chunk) at a time, in whatever dtype the caller passes (use float64 for a
reference). The test suite keeps its own independent copy of the math.
"""
import torch
import torch.nn.functional as F


def activations(q, k, g, beta, A_log, dt_bias, lower_bound):
    """L2-normalised q and k, the log decay lambda (<= 0) and sigmoid(beta)."""
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    A = torch.exp(A_log.to(q.dtype))[:, None]
    x = g + dt_bias.to(q.dtype)
    if lower_bound is None:
        lam = -A * F.softplus(x)
    else:
        lam = lower_bound * torch.sigmoid(A * x)
    return qn, kn, lam, torch.sigmoid(beta)


def _sequences(B, T, cu_seqlens):
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    bounds = [int(x) for x in cu_seqlens.tolist()]
    return [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]


def kda_recurrent(q, k, v, g, beta, A_log, dt_bias, *, scale=None, lower_bound=None, initial_state=None,
                  cu_seqlens=None):
    """Token-by-token recurrence. Returns (out [B, T, H, V], final_state [N, H, V, K])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    qn, kn, lam, b = activations(q, k, g, beta, A_log, dt_bias, lower_bound)
    out = torch.zeros(B, T, H, V, dtype=q.dtype, device=q.device)
    seqs = _sequences(B, T, cu_seqlens)
    final = torch.zeros(len(seqs), H, V, K, dtype=q.dtype, device=q.device)
    for n, (row, start, end) in enumerate(seqs):
        S = torch.zeros(H, K, V, dtype=q.dtype, device=q.device)
        if initial_state is not None:
            S = initial_state[n].to(q.dtype).transpose(-1, -2).clone()
        for t in range(start, end):
            S = S * torch.exp(lam[row, t])[..., None]
            pred = torch.einsum("hkv,hk->hv", S, kn[row, t])
            u = b[row, t][:, None] * (v[row, t] - pred)
            S = S + kn[row, t][..., None] * u[:, None, :]
            out[row, t] = scale * torch.einsum("hkv,hk->hv", S, qn[row, t])
        final[n] = S.transpose(-1, -2)
    return out, final


def kda_chunked(q, k, v, g, beta, A_log, dt_bias, *, scale=None, lower_bound=None, initial_state=None,
                chunk_size=16):
    """The chunked form of SPEC section 1, fixed length only. exp(G_i - G_j) is
    formed from differences, never from exp(-G) alone."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    qn, kn, lam, b = activations(q, k, g, beta, A_log, dt_bias, lower_bound)
    out = torch.zeros(B, T, H, V, dtype=q.dtype, device=q.device)
    final = torch.zeros(B, H, V, K, dtype=q.dtype, device=q.device)
    for row in range(B):
        S = torch.zeros(H, K, V, dtype=q.dtype, device=q.device)
        if initial_state is not None:
            S = initial_state[row].to(q.dtype).transpose(-1, -2).clone()
        for start in range(0, T, chunk_size):
            end = min(T, start + chunk_size)
            Qc, Kc, Vc = qn[row, start:end], kn[row, start:end], v[row, start:end]  # [C, H, *]
            G = lam[row, start:end].cumsum(0)  # [C, H, K]
            bc = b[row, start:end]  # [C, H]
            decay = torch.exp(G[:, None] - G[None, :])  # [i, j, H, K]
            C = end - start
            lower = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), -1)
            A_kk = torch.einsum("ihk,jhk,ijhk->hij", Kc, Kc, decay) * bc.T[:, :, None]
            A_kk = A_kk * lower
            A_qk = scale * torch.einsum("ihk,jhk,ijhk->hij", Qc, Kc, decay)
            A_qk = A_qk * (lower | torch.eye(C, dtype=torch.bool, device=q.device))
            eye = torch.eye(C, dtype=q.dtype, device=q.device)
            rhs = bc.T[:, :, None] * (Vc.transpose(0, 1) - torch.einsum("ihk,hkv->hiv", torch.exp(G) * Kc, S))
            U = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True)
            O = scale * torch.einsum("ihk,hkv->hiv", torch.exp(G) * Qc, S) + A_qk @ U
            out[row, start:end] = O.transpose(0, 1)
            G_last = G[-1]  # [H, K]
            S = torch.exp(G_last)[..., None] * S + torch.einsum("ihk,hiv->hkv", torch.exp(G_last - G) * Kc, U)
        final[row] = S.transpose(-1, -2)
    return out, final
