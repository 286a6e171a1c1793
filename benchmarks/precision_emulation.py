"""What tensor-core operand precision would cost, emulated on the CPU.

The CUDA recurrence (K2) does per chunk of 16: U = U0 - W S, O = Qs S + Aqk U and
S <- diag(exp(G_last)) S + Kd^T U. A tensor-core version rounds the operands of each
product: to bf16, to tf32, or splits each into a bf16 high and low part and sums
three bf16 products (hi*hi + hi*lo + lo*hi). This script runs the chunked recurrence
with each choice (fp32 accumulation throughout) and prints out and state errors
against float64, for the random case and the weak-decay case.

--backward: the backward's dR = T^T dX (T = (I + A)^-1, dX the gradients of W and
U0) formed as a product with T kept in fp32 and its operands rounded as above,
instead of solved by substitution; everything else in float64, so the gradients'
differences from the exact solve are what the product's precision alone costs.

--states: what the backward's kept states cost, by where they are kept and in which
dtype: the chunk-start states S and the state gradients dS either every 16 tokens
(each chunk's gradient reads its own, rounded) or every 64 (each block of four chunks
recomputes its inner states forward from the rounded S at its start, and its inner
dS backward from the rounded dS at its end), in bf16 or fp32, or S as built with dS
alone every 64 in fp32; everything else in float64, so the gradients' differences from
float64 are what the storage alone costs.

    python benchmarks/precision_emulation.py [--T 4096] [--backward | --states]
"""
import argparse

import torch

from torch_kda.naive import kda_naive
from torch_kda.reference import activations, chunk_record, chunk_record_backward, chunk_step, chunk_step_backward

BF16 = torch.bfloat16
C = 16


def to_tf32(x):
    """Round fp32 to tf32 (10 mantissa bits), to nearest."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def product(a, b, mode):
    if mode == "fp32":
        return a @ b
    if mode == "tf32":
        return to_tf32(a) @ to_tf32(b)
    a_hi, b_hi = a.to(BF16).float(), b.to(BF16).float()
    if mode == "bf16":
        return a_hi @ b_hi
    a_lo, b_lo = (a - a_hi).to(BF16).float(), (b - b_hi).to(BF16).float()
    if mode == "bf16x3":
        return a_hi @ b_hi + a_hi @ b_lo + a_lo @ b_hi
    # "<type>x2": the state-side operand b (S or U) split into a hi and a lo part,
    # the record's operand a rounded once: two products.
    low = {"bf16x2": BF16, "fp16x2": torch.float16}[mode]
    a1, b_hi = a.to(low).float(), b.to(low).float()
    return a1 @ b_hi + a1 @ (b - b_hi).to(low).float()


def chunked_forward(q, k, v, g, beta, A_log, dt_bias, h0, lower_bound, mode):
    """One sequence, one head: q, k, g, v [T, 128]; beta [T]; h0 [V, K]. fp32 math."""
    K = q.shape[-1]
    scale = K ** -0.5
    qn, kn, lam, b = activations(q.float()[:, None], k.float()[:, None], g.float()[:, None],
                                 beta.float()[:, None], A_log, dt_bias, lower_bound)
    qn, kn, lam, b = qn[:, 0], kn[:, 0], lam[:, 0], b[:, 0]
    S = h0.float().T.clone()
    outs = []
    for s in range(0, q.shape[0], C):
        Qc, Kc, Vc, bc = qn[s:s + C], kn[s:s + C], v[s:s + C].float(), b[s:s + C]
        G = lam[s:s + C].cumsum(0)
        decay = torch.exp(G[:, None] - G[None])
        A = torch.einsum("id,jd,ijd->ij", Kc, Kc, decay).tril(-1) * bc[:, None]
        Aqk = scale * torch.einsum("id,jd,ijd->ij", Qc, Kc, decay).tril()
        M = torch.linalg.inv(torch.eye(Qc.shape[0]) + A)
        W = M @ (bc[:, None] * torch.exp(G) * Kc)
        U0 = M @ (bc[:, None] * Vc)
        Qs = scale * torch.exp(G) * Qc
        Kd = torch.exp(G[-1] - G) * Kc
        U = U0 - product(W, S, mode)
        outs.append(product(Qs, S, mode) + product(Aqk, U, mode))
        S = torch.exp(G[-1])[:, None] * S + product(Kd.T.contiguous(), U, mode)
    return torch.cat(outs).to(BF16), S.T


def backward_grads(qn, kn, v, lam, b, h0, dout, dfinal, t_product):
    """One sequence, one head, float64: dqn, dkn, dv, dlam, db through the records
    (torch_kda.reference), with chunk_record_backward's T^T products by t_product."""
    scale = qn.shape[-1] ** -0.5
    chunks = [slice(s, s + C) for s in range(0, qn.shape[0], C)]
    S, kept = h0.clone(), []
    for c in chunks:
        rec = chunk_record(qn[c], kn[c], v[c], lam[c], b[c], scale)
        _, S1, U = chunk_step(S, rec)
        kept.append((S, rec, U))
        S = S1
    grads = [torch.zeros_like(x) for x in (qn, kn, v, lam, b)]
    dS = dfinal.clone()
    for c, (S, rec, U) in reversed(list(zip(chunks, kept))):
        dS, drec = chunk_step_backward(S, rec, U, dout[c], dS)
        for acc, d in zip(grads, chunk_record_backward(qn[c], kn[c], v[c], lam[c], b[c], scale, drec, t_product)):
            acc[c] += d
    return grads


def backward_case(case, T, D):
    """One sequence and head of the backward tables, float64 from bf16-rounded inputs:
    qn, kn, v, lam, b, the initial state, dout and the final state's gradient."""
    q, k, g, v = (torch.randn(T, D).to(BF16).double() for _ in range(4))
    beta = torch.randn(T).to(BF16).double()
    A_log, dt_bias = torch.rand(1).double(), torch.rand(1, D).double()
    if case == "weak decay":
        A_log.fill_(2.0)
        dt_bias.fill_(-8.0)
    qn, kn, lam, b = (x[:, 0] for x in activations(q[:, None], k[:, None], g[:, None], beta[:, None], A_log,
                                                   dt_bias, -5.0))
    h0, dfinal = torch.randn(D, D).double(), torch.randn(D, D).double()
    dout = torch.randn(T, D).double()
    return qn, kn, v, lam, b, h0, dout, dfinal


def backward_table(T, D):
    print("| case | T^T products | dq^ | dk^ | dv | dlam | dbeta |")
    print("|---|---|---|---|---|---|---|")
    for case in ("random", "weak decay"):
        qn, kn, v, lam, b, h0, dout, dfinal = backward_case(case, T, D)
        exact = backward_grads(qn, kn, v, lam, b, h0, dout, dfinal, None)
        for mode in ("fp32", "bf16x3", "bf16"):
            def t_product(Tt, X, mode=mode):
                return product(Tt.float(), X.float(), mode).double()
            got = backward_grads(qn, kn, v, lam, b, h0, dout, dfinal, t_product)
            errors = " | ".join(f"{((a - e).norm() / e.norm()).item():.2e}" for a, e in zip(got, exact))
            print(f"| {case} | {mode} | {errors} |")


def rounded(x, dtype):
    """x rounded to dtype (None: kept), or, for "bf16+8", to bf16 and an extension
    byte: the remainder in 1/128ths of the bf16 value's ulp (15 significant bits)."""
    if dtype == "bf16+8":
        hi = x.to(BF16).double()
        e = torch.floor(torch.log2(hi.abs().clamp_min(1e-300)))
        scale = torch.exp2(e - 14)  # ulp(hi) / 128
        return torch.where(hi == 0, hi, hi + torch.round((x - hi) / scale) * scale)
    return x.to(dtype).double() if dtype is not None else x


def kept_state_grads(qn, kn, v, lam, b, h0, dout, dfinal, every, dtype, exact_du=False, ds_every=None,
                     ds_dtype="as S", ds1_dtype=None, inner_dtype=None, walk_dtype=None):
    """One sequence, one head, float64, as backward_grads, but each chunk's gradient
    reads S and dS as a backward that keeps them every `every` tokens in `dtype`
    (None: exact) would have them: the stored ones rounded, the inner ones
    recomputed from those (S forward from its block's start, dS backward from its
    block's end). dS may be kept otherwise: every `ds_every` tokens in `ds_dtype`;
    and ds1_dtype rounds each chunk's dS1 where it meets the record's products (a
    kernel that walks dS in fp32 but multiplies by it in bf16). exact_du: dU, and
    dW = -dU S from it, come from the exact dS, as the dS recurrence hands dU to
    the record gradients in fp32. inner_dtype rounds each inner S again as it is
    recomputed (a walk that keeps S in a bf16 plane between its chunks); walk_dtype
    keeps the stored S otherwise for the walk than for the products (which read it
    in `dtype`, with U formed from that). Also returns the initial state's gradient."""
    ds_every = ds_every or every
    ds_dtype = dtype if ds_dtype == "as S" else ds_dtype
    scale = qn.shape[-1] ** -0.5
    chunks = [slice(s, s + C) for s in range(0, qn.shape[0], C)]
    recs = [chunk_record(qn[c], kn[c], v[c], lam[c], b[c], scale) for c in chunks]
    states, us, S = [], [], h0.clone()
    for rec in recs:
        states.append(S)
        _, S, U = chunk_step(S, rec)
        us.append(U)
    dS, dstates = dfinal.clone(), [None] * len(chunks)
    for i in reversed(range(len(chunks))):
        dstates[i] = dS  # the gradient of the state after chunk i
        dS = chunk_step_backward(states[i], recs[i], us[i], dout[chunks[i]], dS)[0]
    dinit = dS

    def blocks(per):
        return [range(first, min(first + per, len(chunks))) for first in range(0, len(chunks), per)]

    kept_s, kept_u = [None] * len(chunks), [None] * len(chunks)
    for block in blocks(every // C):
        S = rounded(states[block[0]], walk_dtype or dtype)
        for i in block:
            kept_s[i] = rounded(S, dtype) if walk_dtype else S
            _, after, kept_u[i] = chunk_step(kept_s[i], recs[i])
            if walk_dtype:  # the walk steps its own S, not the products' rounding of it
                after = chunk_step(S, recs[i])[1]
            S = rounded(after, inner_dtype)
    kept_ds1 = [None] * len(chunks)
    for block in blocks(ds_every // C):
        dS = rounded(dstates[block[-1]], ds_dtype)
        for i in reversed(block):
            kept_ds1[i] = dS
            dS = chunk_step_backward(kept_s[i], recs[i], kept_u[i], dout[chunks[i]], dS)[0]
    grads = [torch.zeros_like(x) for x in (qn, kn, v, lam, b)]
    for i, c in enumerate(chunks):
        S = kept_s[i]
        drec = chunk_step_backward(S, recs[i], kept_u[i], dout[c], rounded(kept_ds1[i], ds1_dtype))[1]
        if exact_du:
            drec["U0"] = recs[i]["Aqk"].T @ dout[c] + recs[i]["Kd"] @ dstates[i].T
            drec["W"] = -drec["U0"] @ S
        for acc, d in zip(grads, chunk_record_backward(qn[c], kn[c], v[c], lam[c], b[c], scale, drec)):
            acc[c] += d
    return grads + [dinit]


def states_table(T, D):
    rows = (
        ("every 16, bf16, dU fp32 (as built)", dict(every=16, dtype=BF16, exact_du=True)),
        ("every 16, bf16", dict(every=16, dtype=BF16)),
        ("every 64, bf16", dict(every=64, dtype=BF16)),
        ("every 16, fp32", dict(every=16, dtype=torch.float32)),
        ("every 64, fp32", dict(every=64, dtype=torch.float32)),
        # dS alone kept in fp32 every 64 (S as built), walked through each block in
        # fp32 and met by the products rounded to bf16, or split (exact).
        ("S every 16, bf16; dS every 64, fp32, bf16 in the products; dU fp32",
         dict(every=16, dtype=BF16, exact_du=True, ds_every=64, ds_dtype=torch.float32, ds1_dtype=BF16)),
        ("S every 16, bf16; dS every 64, fp32; dU fp32",
         dict(every=16, dtype=BF16, exact_du=True, ds_every=64, ds_dtype=torch.float32)),
        # S kept every 32 or 64 tokens in bf16 and walked forward by the record
        # gradients in a bf16 plane (each inner S rounded again); dS as built.
        ("S every 32, bf16, inner rounded to bf16; dS every 16, bf16; dU fp32",
         dict(every=32, dtype=BF16, exact_du=True, ds_every=16, inner_dtype=BF16)),
        ("S every 64, bf16, inner rounded to bf16; dS every 16, bf16; dU fp32",
         dict(every=64, dtype=BF16, exact_du=True, ds_every=16, inner_dtype=BF16)),
        # ... the stored S with an extension byte a value for the walk.
        ("S every 32, bf16 + extension byte, inner rounded to bf16; dS every 16, bf16; dU fp32",
         dict(every=32, dtype=BF16, walk_dtype="bf16+8", exact_du=True, ds_every=16, inner_dtype=BF16)),
        ("S every 64, bf16 + extension byte, walked with it; dS every 16, bf16; dU fp32",
         dict(every=64, dtype=BF16, walk_dtype="bf16+8", exact_du=True, ds_every=16, inner_dtype="bf16+8")),
    )
    print("| case | states kept | dq^ | dk^ | dv | dlam | dbeta |")
    print("|---|---|---|---|---|---|---|")
    for case in ("random", "weak decay"):
        qn, kn, v, lam, b, h0, dout, dfinal = backward_case(case, T, D)
        exact = kept_state_grads(qn, kn, v, lam, b, h0, dout, dfinal, C, None)
        for name, kept in rows:
            got = kept_state_grads(qn, kn, v, lam, b, h0, dout, dfinal, **kept)
            errors = " | ".join(f"{((a - e).norm() / e.norm()).item():.2e}" for a, e in zip(got[:5], exact[:5]))
            print(f"| {case} | {name} | {errors} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--backward", action="store_true", help="the backward's T^T products instead of the forward")
    ap.add_argument("--states", action="store_true", help="the backward's kept states, by spacing and dtype")
    args = ap.parse_args()
    torch.manual_seed(0)
    T, D = args.T, 128
    if args.backward:
        backward_table(T, D)
        return
    if args.states:
        states_table(T, D)
        return
    print("| case | operands | out rel | state rel |")
    print("|---|---|---|---|")
    for case in ("random", "weak decay"):
        q, k, g, v = (torch.randn(T, D).to(BF16) for _ in range(4))
        beta = torch.randn(T).to(BF16)
        A_log, dt_bias, h0 = torch.rand(1), torch.rand(1, D), torch.randn(D, D)
        if case == "weak decay":
            A_log.fill_(2.0)
            dt_bias.fill_(-8.0)
        ref_out, ref_state = kda_naive(
            *(x.double()[None, :, None] for x in (q, k, v, g, beta)), A_log.double(), dt_bias.double(),
            lower_bound=-5.0, initial_state=h0.double()[None, None])
        ref_out, ref_state = ref_out[0, :, 0], ref_state[0, 0]
        for mode in ("fp32", "bf16x3", "fp16x2", "bf16x2", "tf32", "bf16"):
            out, state = chunked_forward(q, k, v, g, beta, A_log, dt_bias, h0, -5.0, mode)
            e_out = ((out.double() - ref_out).norm() / ref_out.norm()).item()
            e_state = ((state.double() - ref_state).norm() / ref_state.norm()).item()
            print(f"| {case} | {mode} | {e_out:.2e} | {e_state:.2e} |")


if __name__ == "__main__":
    main()
