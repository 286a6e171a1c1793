"""The chunked form of KDA in plain PyTorch, in the terms of the CUDA kernels: the
chunked forward (kda_chunked), the hand-derived gradients of the chunked form
(kda_chunked_backward), and the kernels' per-chunk record (chunk_record), one chunk
step (chunk_step) and their backwards, which the GPU tests check the kernels'
pieces against. One chunk at a time, in whatever dtype the caller passes (float64
for a reference). The token-by-token reference is torch_kda.naive.
"""
import torch

from torch_kda.naive import gate, l2norm


def activations(q, k, g, beta, A_log, dt_bias, lower_bound):
    """L2-normalised q and k, the log decay lambda (<= 0) and sigmoid(beta), in q's dtype."""
    return l2norm(q), l2norm(k), gate(g, A_log.to(q.dtype), dt_bias.to(q.dtype), lower_bound), torch.sigmoid(beta)


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


def chunk_record_backward(qn, kn, v, lam, b, scale, drec, t_product=None):
    """The backward of chunk_record: from the record's gradients (a dict as
    chunk_step_backward returns, summed over value rows), dqn, dkn [C, K], dv [C, V],
    dlam [C, K] and db [C]. Entries of dAqk above the diagonal, and of the
    implied dA on and above it, do not reach the inputs (they are structural zeros).
    t_product(T^T, X), where given, forms T^T X from T = (I + A)^-1 as a product, as
    a backward that keeps T would (benchmarks/precision_emulation.py rounds it);
    without it T^T X is solved exactly."""
    t = _record_terms(qn, kn, v, lam, b)
    E, Ei, Ke, Ki, Qe, P, IA, W, U0, gl = (t[n] for n in ("E", "Ei", "Ke", "Ki", "Qe", "P", "IA", "W", "U0", "gl"))
    strict, incl = t["strict"], t["incl"]
    # W = T diag(b) Ke and U0 = T diag(b) v with T = (I + A)^-1.
    if t_product is None:
        dRw = torch.linalg.solve_triangular(IA.T, drec["W"], upper=True, unitriangular=True)
        dRu = torch.linalg.solve_triangular(IA.T, drec["U0"], upper=True, unitriangular=True)
    else:
        Tt = torch.linalg.inv(IA).T
        dRw, dRu = t_product(Tt, drec["W"]), t_product(Tt, drec["U0"])
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
