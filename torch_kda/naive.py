"""The one plain reference of KDA: the recurrence of README.md ("What it computes"),
token by token, in float64, written to be read rather than fast. Every test compares
against it (tests/conftest.py), and so do the benchmarks' accuracy reports and the
quickstart. Differentiable, so it serves gradient checks too. It shares no code with
the CPU and CUDA kernels it checks.
"""
import torch

NORM_EPS = 1e-6  # q^ = q / sqrt(sum(q^2) + 1e-6), the same for k


def l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + NORM_EPS)


def gate(g, A_log, dt_bias, lower_bound):
    """Natural-log decay lambda <= 0 for g [..., H, K], A_log [H], dt_bias [H, K];
    with A_log and dt_bias None, g is that decay already (a precomputed gate)."""
    if A_log is None:
        return g
    A = torch.exp(A_log)[:, None]
    x = g + dt_bias
    if lower_bound is None:
        # softplus(x) = log(1 + exp(x)), written without overflow.
        return -A * torch.logaddexp(x, torch.zeros_like(x))
    return lower_bound * torch.sigmoid(A * x)


def sequence_bounds(B, T, cu_seqlens):
    """[(batch row, start, end)] of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    assert B == 1
    offsets = [int(x) for x in cu_seqlens.tolist()]
    return [(0, offsets[i], offsets[i + 1]) for i in range(len(offsets) - 1)]


def kda_naive(
    q, k, v, g, beta, A_log, dt_bias, *, scale=None, lower_bound=None, initial_state=None, cu_seqlens=None
):
    """Float64 token-by-token KDA. Differentiable (used for gradient checks too).

    q, k [B, T, H_qk, K]; v [B, T, H, V] with H a multiple of H_qk (grouped value
    heads: value head j reads query/key head j // (H / H_qk)); g [B, T, H, K];
    beta [B, T, H]; A_log [H]; dt_bias [H, K], or both None: g is the log decay.
    Returns (out [B, T, H, V], final_state [N, H, V, K]), both float64.
    """
    q, k, v, g, beta, A_log, dt_bias = (
        None if x is None else x.to(torch.float64) for x in (q, k, v, g, beta, A_log, dt_bias))
    B, T, H, V = v.shape
    K = q.shape[-1]
    group = H // q.shape[2]
    assert q.shape[2] * group == H, "v's heads must be a multiple of q's"
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    if scale is None:
        scale = K**-0.5
    bounds = sequence_bounds(B, T, cu_seqlens)

    per_row = {b: [] for b in range(B)}  # outputs of each batch row, in token order
    finals = []
    for n, (b, start, end) in enumerate(bounds):
        if initial_state is None:
            S = torch.zeros(H, K, V, dtype=torch.float64, device=q.device)
        else:
            # The API's state is V-first: state[n, h, v, k] = S[k, v].
            S = initial_state[n].to(torch.float64).transpose(-1, -2)
        for t in range(start, end):
            qn = l2norm(q[b, t])  # [H, K]
            kn = l2norm(k[b, t])  # [H, K]
            alpha = torch.exp(gate(g[b, t], A_log, dt_bias, lower_bound))  # [H, K]
            bt = torch.sigmoid(beta[b, t])  # [H]
            S = alpha[:, :, None] * S  # S' = Diag(alpha) S
            pred = (S * kn[:, :, None]).sum(1)  # S'^T k  [H, V]
            u = bt[:, None] * (v[b, t] - pred)  # [H, V]
            S = S + kn[:, :, None] * u[:, None, :]  # S' + k u^T
            per_row[b].append(scale * (S * qn[:, :, None]).sum(1))  # S^T q  [H, V]
        finals.append(S.transpose(-1, -2))

    rows = []
    for b in range(B):
        if per_row[b]:
            rows.append(torch.stack(per_row[b]))
        else:
            rows.append(torch.zeros(0, H, V, dtype=torch.float64, device=q.device))
    out = torch.stack(rows) if rows else torch.zeros(0, T, H, V, dtype=torch.float64, device=q.device)
    assert out.shape == (B, T, H, V)
    final = torch.stack(finals) if finals else torch.zeros(0, H, V, K, dtype=torch.float64, device=q.device)
    return out, final
