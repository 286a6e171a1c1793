#!/usr/bin/env python3
"""torch_kda quickstart: one tour of the API, checked against a float64 reference.

    python examples/quickstart.py [--device {auto,cpu,cuda}]

1. torch_kda.kda on a fixed-length batch (bounded gate, fp32 initial state)
2. the same op on packed variable-length sequences (cu_seqlens)
3. torch_kda.fwd, the in-place drop-in for flash_kda.fwd
4. a backward pass, with gradients checked against float64 autograd

Forward and backward results are compared with a plain float64 token-by-token
evaluation of the KDA recurrence (torch_kda.naive), printing the relative error
||x - ref|| / ||ref||; the varlen and in-place calls are compared with the plain calls
they must reproduce.
The script exits with status 1 if any check fails.
"""
import argparse
import sys
import time

import torch

import torch_kda
from torch_kda.naive import kda_naive

LOWER_BOUND = -5.0  # bounded gate: lambda = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))
FAILURES = []


def reference_kda(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, state):
    """One sequence through torch_kda.naive (plain PyTorch, token by token), in
    float64. q, k, g [T, H, K]; v [T, H, V]; beta [T, H] (logits); state [H, V, K].
    Returns out [T, H, V] and the final state [H, V, K]. Differentiable."""
    out, final = kda_naive(
        *(x.double()[None] for x in (q, k, v, g, beta)), A_log.double(), dt_bias.double(),
        scale=scale, lower_bound=lower_bound, initial_state=state.double()[None],
    )
    return out[0], final[0]


def rel(x, ref):
    ref = ref.double()
    return ((x.double() - ref).norm() / ref.norm()).item()


def report(what, value, tol):
    ok = value <= tol
    if not ok:
        FAILURES.append(what)
    print(f"    {what:<36} rel err {value:.2e}  ({'ok' if ok else 'FAIL'}, limit {tol:.0e})")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn, repeats=3):
    """Runs fn once to warm up, then `repeats` times. Returns (last result, median ms)."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        result = fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return result, sorted(times)[len(times) // 2]


def make_inputs(B, T, H, K, V, device, gen):
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    return dict(
        q=randn(B, T, H, K),
        k=randn(B, T, H, K),
        v=randn(B, T, H, V),
        g=randn(B, T, H, K),
        beta=randn(B, T, H),  # logits: the op applies the sigmoid
        A_log=torch.rand(H, generator=gen).to(device),  # fp32
        dt_bias=torch.rand(H, K, generator=gen).to(device),  # fp32
    )


def fixed_length(device, B, T, H, K, V, gen):
    print(f"\n1. torch_kda.kda, fixed length: B={B}, T={T}, H={H}, K={K}, V={V}")
    x = make_inputs(B, T, H, K, V, device, gen)
    h0 = (0.1 * torch.randn(B, H, V, K, generator=gen)).to(device)  # fp32 state [N, H, V, K]
    (out, ht), ms = timed(
        device,
        lambda: torch_kda.kda(
            **x, lower_bound=LOWER_BOUND, initial_state=h0, output_final_state=True
        ),
    )
    print(f"    q {tuple(x['q'].shape)} {x['q'].dtype} -> out {tuple(out.shape)} {out.dtype}")
    print(f"    initial_state {tuple(h0.shape)} {h0.dtype} -> final_state {tuple(ht.shape)} {ht.dtype}")
    print(f"    forward time: {ms:.2f} ms (median of 3)")
    # Check batch row 0 (all heads, all tokens) against the float64 reference.
    r = {n: t[0].cpu() for n, t in x.items() if n not in ("A_log", "dt_bias")}
    ref_out, ref_ht = reference_kda(
        **r, A_log=x["A_log"].cpu(), dt_bias=x["dt_bias"].cpu(), scale=K**-0.5,
        lower_bound=LOWER_BOUND, state=h0[0].cpu(),
    )
    report("out[0] vs float64 reference", rel(out[0].cpu(), ref_out), 5e-3)
    report("final_state[0] vs float64 reference", rel(ht[0].cpu(), ref_ht), 5e-3)
    return x, h0, out, ht


def varlen(device, T, H, K, V, gen):
    lens = [T // 4, 0, T - T // 4]  # an empty sequence is allowed: its state passes through
    cu = torch.tensor([0, lens[0], lens[0] + lens[1], T], dtype=torch.int64, device=device)
    print(f"\n2. torch_kda.kda, varlen: {len(lens)} sequences of lengths {lens} packed in B=1, T={T}")
    x = make_inputs(1, T, H, K, V, device, gen)
    h0 = (0.1 * torch.randn(len(lens), H, V, K, generator=gen)).to(device)
    out, ht = torch_kda.kda(
        **x, lower_bound=LOWER_BOUND, initial_state=h0, output_final_state=True, cu_seqlens=cu
    )
    print(f"    cu_seqlens {cu.tolist()} -> out {tuple(out.shape)}, final_state {tuple(ht.shape)}")
    # Each packed sequence must match the same sequence run on its own.
    worst = 0.0
    for n in range(len(lens)):
        s, e = cu[n].item(), cu[n + 1].item()
        if e == s:
            print(f"    sequence {n} is empty: final_state == initial_state: {torch.equal(ht[n], h0[n])}")
            if not torch.equal(ht[n], h0[n]):
                FAILURES.append("empty sequence state")
            continue
        one = {n_: (t[:, s:e] if t.dim() > 2 else t) for n_, t in x.items()}
        o1, h1 = torch_kda.kda(
            **one, lower_bound=LOWER_BOUND, initial_state=h0[n : n + 1], output_final_state=True
        )
        worst = max(worst, (out[:, s:e] - o1).abs().max().item(), (ht[n] - h1[0]).abs().max().item())
    print(f"    packed vs one-by-one, max abs diff: {worst:.2e}")
    if worst > 1e-2:
        FAILURES.append("varlen vs one-by-one")


def inplace(device, x, h0, out_ref, ht_ref):
    B, T, H, K = x["q"].shape
    print("\n3. torch_kda.fwd: in place, flash_kda-style signature")
    print(f"    get_workspace_size(T_total={B * T}, H={H}, N={B}) = "
          f"{torch_kda.get_workspace_size(B * T, H, B)} (the op allocates its own scratch)")
    out = torch.empty_like(x["v"])
    ht = torch.empty_like(h0)  # same dtype as initial_state (fp32 here; bf16 also works)
    ret = torch_kda.fwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], K**-0.5, out, x["A_log"], x["dt_bias"],
        LOWER_BOUND, initial_state=h0, final_state=ht,
    )
    diff = max((out - out_ref).abs().max().item(), (ht - ht_ref).abs().max().item())
    print(f"    returned {ret}; wrote out {tuple(out.shape)} and final_state {tuple(ht.shape)}")
    print(f"    max abs diff vs torch_kda.kda: {diff:.2e}")
    if diff > 1e-2:
        FAILURES.append("fwd vs kda")


def backward(device, gen):
    B, T, H, K, V = 1, 64, 2, 128, 128
    print(f"\n4. backward on {device.type}: B={B}, T={T}, H={H}, K={K}, V={V}")
    x = make_inputs(B, T, H, K, V, device, gen)
    h0 = (0.1 * torch.randn(B, H, V, K, generator=gen)).to(device)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    h0 = h0.requires_grad_()
    w_out = torch.randn(B, T, H, V, generator=gen).to(device)
    w_ht = torch.randn(B, H, V, K, generator=gen).to(device)

    def step():
        for t in list(leaves.values()) + [h0]:
            t.grad = None
        out, ht = torch_kda.kda(**leaves, lower_bound=LOWER_BOUND, initial_state=h0, output_final_state=True)
        ((out.float() * w_out).sum() + (ht * w_ht).sum()).backward()

    _, ms = timed(device, step)
    print(f"    forward + backward time: {ms:.2f} ms (median of 3)")
    # The same loss through the float64 reference, differentiated by autograd.
    ref = {n: t.detach().cpu().double().requires_grad_() for n, t in leaves.items()}
    ref_h0 = h0.detach().cpu().double().requires_grad_()
    seq = {n: t[0] for n, t in ref.items() if n not in ("A_log", "dt_bias")}
    o, h = reference_kda(**seq, A_log=ref["A_log"], dt_bias=ref["dt_bias"], scale=K**-0.5,
                         lower_bound=LOWER_BOUND, state=ref_h0[0])
    ((o * w_out[0].cpu().double()).sum() + (h * w_ht[0].cpu().double()).sum()).backward()
    for n in leaves:
        report(f"d{n} ({leaves[n].grad.dtype})", rel(leaves[n].grad.cpu(), ref[n].grad), 1e-2)
    report(f"dinitial_state ({h0.grad.dtype})", rel(h0.grad.cpu(), ref_h0.grad), 1e-2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = parser.parse_args()

    cuda_ok = torch.cuda.is_available() and torch_kda.cuda_built()
    why_not = (
        "no CUDA device is visible" if not torch.cuda.is_available()
        else "this build of torch_kda has no CUDA kernels"
    )
    if args.device == "cuda" and not cuda_ok:
        sys.exit(f"--device cuda asked for, but {why_not}")
    name = "cuda" if (args.device == "cuda" or (args.device == "auto" and cuda_ok)) else "cpu"
    device = torch.device(name)

    print(f"torch {torch.__version__}, torch_kda {torch_kda.__version__}, "
          f"CUDA kernels built: {torch_kda.cuda_built()}, CPU threads: {torch.get_num_threads()}")
    if device.type == "cuda":
        print(f"device: cuda ({torch.cuda.get_device_name(device)})")
    else:
        print(f"device: cpu ({'asked for' if args.device == 'cpu' else why_not})")

    gen = torch.Generator().manual_seed(0)
    H, K, V = 4, 128, 128
    try:
        x, h0, out, ht = fixed_length(device, 2, 1000 if device.type == "cuda" else 256, H, K, V, gen)
    except NotImplementedError as e:
        if device.type != "cuda":
            raise
        print(f"\n    The CUDA forward is not available in this build: {str(e).splitlines()[0]}")
        print("    The rest of this demo runs on the CPU instead.")
        device = torch.device("cpu")
        x, h0, out, ht = fixed_length(device, 2, 256, H, K, V, gen)

    varlen(device, x["q"].shape[1], H, K, V, gen)
    inplace(device, x, h0, out, ht)
    try:
        backward(device, gen)
    except NotImplementedError as e:
        if device.type != "cuda":
            raise
        print(f"    The CUDA backward is not available in this build: {str(e).splitlines()[0]}")
        print("    Running the backward on the CPU instead.")
        backward(torch.device("cpu"), gen)

    if FAILURES:
        print(f"\nFAILED: {', '.join(FAILURES)}")
        sys.exit(1)
    print("\nAll checks passed.")


if __name__ == "__main__":
    main()
