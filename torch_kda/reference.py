"""Plain PyTorch evaluations of KDA (README.md, "What it computes"), for documentation,
benchmarks' accuracy reports and debugging, and the hand-derived gradients of
the chunked form (kda_chunked_backward), the blueprint for chunked backward
kernels, and (chunk_record, chunk_step and their backwards) the forward kernels'
per-chunk record with the backward of one chunk step written in its terms;
chunk_record_blocked, the same record for longer chunks built from 16-token blocks
without an exponential that overflows fp32. Slow on purpose: one token (or one chunk) at a time, in whatever dtype
the caller passes (use float64 for a reference). The test suite keeps its own
independent copy of the math.
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
    """The chunked form of the recurrence, fixed length only. exp(G_i - G_j) is
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
            C = end - start
            lower = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), -1)
            # exp(G_i - G_j) only where j <= i: above the diagonal it would overflow.
            causal = (lower | torch.eye(C, dtype=torch.bool, device=q.device))[:, :, None, None]
            decay = torch.exp((G[:, None] - G[None, :]).masked_fill(~causal, float("-inf")))  # [i, j, H, K]
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


def _chunk_terms(qn, kn, lam, b, scale):
    """The chunk-local quantities of the chunked form for one chunk of one head:
    qn, kn [C, K]; lam [C, K]; b [C]. Decays exp(G_i - G_j) come from differences."""
    C = qn.shape[0]
    G = lam.cumsum(0)
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=qn.device), -1)
    incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=qn.device))
    # exp(G_i - G_j) only where j <= i: above the diagonal it would overflow.
    D = torch.exp((G[:, None, :] - G[None, :, :]).masked_fill(~incl[:, :, None], float("-inf")))  # [i, j, K]
    P = torch.einsum("id,jd,ijd->ij", kn, kn, D) * strict
    Pq = torch.einsum("id,jd,ijd->ij", qn, kn, D) * incl
    return dict(G=G, D=D, strict=strict, incl=incl, P=P, A=b[:, None] * P, Aqk=scale * Pq,
                Kg=torch.exp(G) * kn, Qg=torch.exp(G) * qn, Kd=torch.exp(G[-1] - G) * kn, gl=torch.exp(G[-1]))


def kda_chunked_backward(q, k, v, g, beta, A_log, dt_bias, grad_out, grad_final_state=None, *, scale=None,
                         lower_bound=None, initial_state=None, chunk_size=16):
    """Gradients of the chunked form written out by hand, fixed length: a blueprint for
    chunked backward kernels. Chunk-start states are recomputed by a forward pass; the
    state gradient then runs backward over chunks, and each chunk's local gradients
    follow from its dU = Aqk^T dO + Kd dS1 and dR = (I + A)^-T dU. The L2 norms, the
    gate and the sigmoid are differentiated by autograd.

    Returns dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinitial_state (None without one)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    leaves = [x.detach().requires_grad_() for x in (q, k, g, beta, A_log, dt_bias)]
    qn, kn, lam, b = activations(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], lower_bound)
    dqn, dkn, dlam, db = (torch.zeros_like(x) for x in (qn, kn, lam, b))
    dv = torch.zeros_like(v)
    dinit = torch.zeros(B, H, V, K, dtype=q.dtype, device=q.device)
    starts = list(range(0, T, chunk_size))
    for row in range(B):
        for h in range(H):
            S = torch.zeros(K, V, dtype=q.dtype, device=q.device)
            if initial_state is not None:
                S = initial_state[row, h].to(q.dtype).T.clone()
            chunk_states = []
            for s in starts:  # forward: the state at each chunk start
                e = min(T, s + chunk_size)
                chunk_states.append(S)
                t = _chunk_terms(qn[row, s:e, h].detach(), kn[row, s:e, h].detach(), lam[row, s:e, h].detach(),
                                 b[row, s:e, h].detach(), scale)
                eye = torch.eye(e - s, dtype=q.dtype, device=q.device)
                R = b[row, s:e, h].detach()[:, None] * (v[row, s:e, h] - t["Kg"] @ S)
                U = torch.linalg.solve_triangular(eye + t["A"], R, upper=False, unitriangular=True)
                S = t["gl"][:, None] * S + t["Kd"].T @ U
            dS = torch.zeros(K, V, dtype=q.dtype, device=q.device)
            if grad_final_state is not None:
                dS = grad_final_state[row, h].to(q.dtype).T.clone()
            for s, S0 in reversed(list(zip(starts, chunk_states))):
                e = min(T, s + chunk_size)
                Qc, Kc, bc = qn[row, s:e, h].detach(), kn[row, s:e, h].detach(), b[row, s:e, h].detach()
                t = _chunk_terms(Qc, Kc, lam[row, s:e, h].detach(), bc, scale)
                eye = torch.eye(e - s, dtype=q.dtype, device=q.device)
                W = v[row, s:e, h] - t["Kg"] @ S0
                U = torch.linalg.solve_triangular(eye + t["A"], bc[:, None] * W, upper=False, unitriangular=True)
                dO = grad_out[row, s:e, h].to(q.dtype)
                dU = t["Aqk"].T @ dO + t["Kd"] @ dS
                dR = torch.linalg.solve_triangular((eye + t["A"]).T, dU, upper=True, unitriangular=True)
                dA = -(dR @ U.T) * t["strict"]
                dPq = scale * (dO @ U.T) * t["incl"]
                dP = bc[:, None] * dA
                dW = bc[:, None] * dR
                db[row, s:e, h] += (dR * W).sum(1) + (dA * t["P"]).sum(1)
                dv[row, s:e, h] += dW
                dKg = -dW @ S0.T
                dQg = scale * dO @ S0.T
                dKd = U @ dS.T
                dS0 = -t["Kg"].T @ dW + scale * t["Qg"].T @ dO + t["gl"][:, None] * dS
                dgl = (S0 * dS).sum(1)
                # P_ij = sum_d k_id k_jd D_ijd and Pq_ij = sum_d q_id k_jd D_ijd.
                D = t["D"]
                dQ = torch.einsum("ij,jd,ijd->id", dPq, Kc, D)
                dK = torch.einsum("ij,id,ijd->jd", dPq, Qc, D) + torch.einsum("ij,id,ijd->jd", dP, Kc, D) \
                    + torch.einsum("ij,jd,ijd->id", dP, Kc, D)
                terms = torch.einsum("ij,id,jd,ijd->ijd", dPq, Qc, Kc, D) + torch.einsum("ij,id,jd,ijd->ijd", dP, Kc, Kc, D)
                dG = terms.sum(1) - terms.sum(0)
                E, Ed = torch.exp(t["G"]), torch.exp(t["G"][-1] - t["G"])
                dK = dK + E * dKg + Ed * dKd
                dQ = dQ + E * dQg
                dG = dG + t["Kg"] * dKg + t["Qg"] * dQg - t["Kd"] * dKd
                dG[-1] += (t["Kd"] * dKd).sum(0) + t["gl"] * dgl
                dqn[row, s:e, h] += dQ
                dkn[row, s:e, h] += dK
                dlam[row, s:e, h] += dG.flip(0).cumsum(0).flip(0)  # G = cumsum(lam)
                dS = dS0
            dinit[row, h] = dS.T
    dq, dk, dg, dbeta, dA_log, ddt_bias = torch.autograd.grad(
        (qn, kn, lam, b), leaves, (dqn, dkn, dlam, db), allow_unused=True)
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, (dinit if initial_state is not None else None)


# --------------------------------------------------------------------------
# The forward kernels' per-chunk record (csrc/cuda/params.h) and the backward of
# one chunk step in its terms: the blueprint for backward kernels that reuse the
# forward's records. One chunk of one head; states are V-first, S[v, k].
# --------------------------------------------------------------------------


def _record_terms(qn, kn, v, lam, b):
    """What K1 computes on the way to a chunk's record (chunk_record), formed as K1
    forms it, from exp(G) and exp(-G) (finite for 16-token chunks with
    lower_bound >= -5): a dict with E = exp(G), Ei = exp(-G), Ke, Ki, Qe, the masks,
    P (strictly lower), I + A, W, U0 and gl."""
    C = qn.shape[0]
    G = lam.cumsum(0)
    E, Ei = torch.exp(G), torch.exp(-G)
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=qn.device), -1)
    incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=qn.device))
    Ke, Ki, Qe = E * kn, Ei * kn, E * qn
    P = (Ke @ Ki.T) * strict
    IA = torch.eye(C, dtype=qn.dtype, device=qn.device) + b[:, None] * P
    W = torch.linalg.solve_triangular(IA, b[:, None] * Ke, upper=False, unitriangular=True)
    U0 = torch.linalg.solve_triangular(IA, b[:, None] * v, upper=False, unitriangular=True)
    return dict(E=E, Ei=Ei, Ke=Ke, Ki=Ki, Qe=Qe, strict=strict, incl=incl, P=P, IA=IA, W=W, U0=U0,
                gl=torch.exp(G[-1]))


def chunk_record(qn, kn, v, lam, b, scale):
    """The record K1 writes for one chunk: qn, kn [C, K]; v [C, V]; lam [C, K]
    (log decays); b [C] (beta). Returns a dict with Qs, W, Kd [C, K]; Aqk [C, C];
    U0 [C, V]; gl [K]."""
    t = _record_terms(qn, kn, v, lam, b)
    return dict(Qs=scale * t["Qe"], W=t["W"], Kd=t["gl"] * t["Ei"] * kn, Aqk=scale * (t["Qe"] @ t["Ki"].T) * t["incl"],
                U0=t["U0"], gl=t["gl"])


def chunk_record_blocked(qn, kn, v, lam, b, scale, block=16):
    """chunk_record for a long chunk (64 tokens, say) built from blocks of `block`
    tokens, in the same terms (so chunk_step takes it unchanged), with every
    exponential that is formed at most 1 or, within a block, at most exp(80) at
    lower_bound = -5: a plan for a recurrence with fewer, longer steps (issue 4),
    whose cumulative log decays over 64 tokens reach -320, where exp(-G) overflows
    fp32 and exp(G) underflows to zero.
    - Inside a diagonal block, G is taken from the block's start (as K1 does for a
      16-token chunk): exp(G') and exp(-G') stay finite.
    - For rows in block a and columns in an earlier block c, exp(G_i - G_j) =
      exp(G_i - G_r) exp(G_r - G_j) with r the last token of block c: both
      exponents <= 0, the second >= -5 * (block - 1); the first may underflow,
      where the true product is below fp32's range too.
    - (I + A)^-1 by block forward substitution from the diagonal blocks' solves.
    Qs, W and Kd take exp(G) and exp(G_last - G) over the whole chunk, both <= 1."""
    C = qn.shape[0]
    G = lam.cumsum(0)
    starts = list(range(0, C, block))
    A = torch.zeros(C, C, dtype=qn.dtype, device=qn.device)
    Aqk = torch.zeros(C, C, dtype=qn.dtype, device=qn.device)
    for ai, a0 in enumerate(starts):
        a1 = min(C, a0 + block)
        base = G[a0 - 1] if a0 > 0 else torch.zeros_like(G[0])
        Gb = G[a0:a1] - base  # within the block: |Gb| <= 5 * block
        Ke, Ki, Qe = torch.exp(Gb) * kn[a0:a1], torch.exp(-Gb) * kn[a0:a1], torch.exp(Gb) * qn[a0:a1]
        n = a1 - a0
        strict = torch.tril(torch.ones(n, n, dtype=torch.bool, device=qn.device), -1)
        incl = torch.tril(torch.ones(n, n, dtype=torch.bool, device=qn.device))
        A[a0:a1, a0:a1] = b[a0:a1, None] * (Ke @ Ki.T) * strict
        Aqk[a0:a1, a0:a1] = scale * (Qe @ Ki.T) * incl
        for c0 in starts[:ai]:
            c1 = c0 + block
            r = G[c1 - 1]  # the last token of block c
            left_k = torch.exp(G[a0:a1] - r) * kn[a0:a1]
            left_q = torch.exp(G[a0:a1] - r) * qn[a0:a1]
            right = torch.exp(r - G[c0:c1]) * kn[c0:c1]
            A[a0:a1, c0:c1] = b[a0:a1, None] * (left_k @ right.T)
            Aqk[a0:a1, c0:c1] = scale * (left_q @ right.T)
    # X = (I + A)^-1 Y by blocks: X_a = (I + A_aa)^-1 (Y_a - sum_{c < a} A_ac X_c).
    eye = torch.eye(C, dtype=qn.dtype, device=qn.device)
    IA = eye + A
    E = torch.exp(G)

    def solve(Y):
        X = torch.zeros_like(Y)
        for a0 in starts:
            a1 = min(C, a0 + block)
            R = Y[a0:a1] - IA[a0:a1, :a0] @ X[:a0]
            X[a0:a1] = torch.linalg.solve_triangular(IA[a0:a1, a0:a1], R, upper=False, unitriangular=True)
        return X

    gl = E[-1]
    return dict(Qs=scale * E * qn, W=solve(b[:, None] * E * kn), Kd=torch.exp(G[-1] - G) * kn, Aqk=Aqk,
                U0=solve(b[:, None] * v), gl=gl)


def chunk_step(S, rec):
    """K2's step: the chunk's output O [C, V] and the next state S1 [V, K] from the
    chunk-start state S [V, K]; also U [C, V], which the backward reuses."""
    U = rec["U0"] - rec["W"] @ S.T
    O = rec["Qs"] @ S.T + rec["Aqk"] @ U
    S1 = S * rec["gl"] + U.T @ rec["Kd"]
    return O, S1, U


def chunk_step_backward(S, rec, U, dO, dS1):
    """The backward of chunk_step: from dO [C, V] and dS1 [V, K], the chunk-start
    state's gradient dS [V, K] and the record's (dQs, dW, dKd, dAqk, dU0, dgl).
    dU, dS and dU0 stay per value row; dQs, dW, dKd, dAqk and dgl sum over the
    value rows (across a kernel's row groups)."""
    dU = rec["Aqk"].T @ dO + rec["Kd"] @ dS1.T
    dS = dS1 * rec["gl"] + dO.T @ rec["Qs"] - dU.T @ rec["W"]
    drec = dict(Qs=dO @ S, W=-dU @ S, Kd=U @ dS1, Aqk=dO @ U.T, U0=dU, gl=(S * dS1).sum(0))
    return dS, drec


def chunk_record_backward(qn, kn, v, lam, b, scale, drec):
    """The backward of chunk_record: from the record's gradients (a dict as
    chunk_step_backward returns, summed over value rows), dqn, dkn [C, K], dv [C, V],
    dlam [C, K] and db [C]. Entries of dAqk above the diagonal, and of the
    implied dA on and above it, do not reach the inputs (they are structural zeros)."""
    t = _record_terms(qn, kn, v, lam, b)
    E, Ei, Ke, Ki, Qe, P, IA, W, U0, gl = (t[n] for n in ("E", "Ei", "Ke", "Ki", "Qe", "P", "IA", "W", "U0", "gl"))
    strict, incl = t["strict"], t["incl"]
    # W = T diag(b) Ke and U0 = T diag(b) v with T = (I + A)^-1.
    dRw = torch.linalg.solve_triangular(IA.T, drec["W"], upper=True, unitriangular=True)
    dRu = torch.linalg.solve_triangular(IA.T, drec["U0"], upper=True, unitriangular=True)
    dA = -(dRw @ W.T + dRu @ U0.T) * strict
    db = (dRw * Ke).sum(1) + (dRu * v).sum(1) + (dA * P).sum(1)
    dv = b[:, None] * dRu
    dP = b[:, None] * dA
    dPq = scale * drec["Aqk"] * incl
    dKe = b[:, None] * dRw + dP @ Ki
    dKi = dP.T @ Ke + dPq.T @ Qe
    dQe = scale * drec["Qs"] + dPq @ Ki
    dKd = drec["Kd"]
    dqn = E * dQe
    dkn = E * dKe + Ei * dKi + gl * Ei * dKd
    dG = E * (qn * dQe + kn * dKe) - Ei * (kn * dKi + gl * kn * dKd)
    dG[-1] += gl * (drec["gl"] + (Ei * kn * dKd).sum(0))
    dlam = dG.flip(0).cumsum(0).flip(0)  # G = cumsum(lam)
    return dqn, dkn, dv, dlam, db
