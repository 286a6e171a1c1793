"""One rank's share of a context-parallel forward + backward, measured on one GPU.

    python benchmarks/bench_context_parallel.py [--tokens 1048576] [--heads 32] [--ranks 8]

A sequence of --tokens tokens split over --ranks ranks: every rank holds tokens /
ranks of them. This times what a middle rank computes in torch_kda.distributed's
context_parallel_kda (its two map passes, the fold, its slice's forward, the two
backward passes and the unfold) with the collective replaced by stacking the rank's
own tensors W times (the shapes and the fold's work of the real thing, no network),
beside torch_kda.kda's forward + backward on the slice alone. It prints the times,
their ratio, the peak memory of each, and the bytes the real run's collectives move
per rank and layer. Bounded gate unless --gate softplus; bf16 inputs, K = V = 128,
an fp32 initial state on rank 0 only (a middle rank has none).
"""
import argparse
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fwd import LOWER_BOUND, time_ms  # noqa: E402

import torch_kda  # noqa: E402
import torch_kda.distributed as cp  # noqa: E402

D = 128


def slice_inputs(tokens, H, requires_grad=True):
    dev, bf = "cuda", torch.bfloat16
    q = torch.nn.functional.normalize(torch.randn(1, tokens, H, D, device=dev), dim=-1).to(bf)
    k = torch.nn.functional.normalize(torch.randn(1, tokens, H, D, device=dev), dim=-1).to(bf)
    v = torch.randn(1, tokens, H, D, device=dev, dtype=bf)
    g = torch.randn(1, tokens, H, D, device=dev, dtype=bf)
    beta = torch.randn(1, tokens, H, device=dev, dtype=bf)
    A_log = torch.rand(H, device=dev)
    dt_bias = torch.rand(H, D, device=dev)
    xs = [q, k, v, g, beta, A_log, dt_bias]
    for x in xs:
        x.requires_grad_(requires_grad)
    return xs


def step(fn, xs, grad_out):
    """fn's forward on xs, then the backward of every input."""
    for x in xs:
        x.grad = None
    out = fn(*xs)
    out.backward(grad_out)


def measure(fn, xs, grad_out, repeats):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = time_ms(lambda: step(fn, xs, grad_out), repeats)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--gate", choices=("bounded", "softplus"), default="bounded")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.ranks < 3 or args.tokens % args.ranks:
        sys.exit("--ranks must be at least 3 (a middle rank) and divide --tokens")
    torch.manual_seed(0)
    W, H, L = args.ranks, args.heads, args.tokens // args.ranks
    lower_bound = LOWER_BOUND if args.gate == "bounded" else None
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{args.tokens} tokens x {H} heads over {W} ranks: {L} tokens a rank, {args.gate} gate")
    xs = slice_inputs(L, H)
    grad_out = torch.randn(1, L, H, D, device="cuda", dtype=torch.bfloat16)

    def alone(*xs):
        return torch_kda.kda(*xs, lower_bound=lower_bound)[0]

    def middle_rank(*xs):
        return cp.context_parallel_kda(*xs, group=object(), lower_bound=lower_bound)[0]

    fake_gather = lambda x, group: torch.stack([x] * W)  # noqa: E731
    with mock.patch.object(cp, "_gather", fake_gather), \
         mock.patch.object(cp.dist, "get_rank", lambda group=None: 1), \
         mock.patch.object(cp.dist, "get_world_size", lambda group=None: W):
        cp_ms, cp_gib = measure(middle_rank, xs, grad_out, args.repeats)
    alone_ms, alone_gib = measure(alone, xs, grad_out, args.repeats)

    maps = H * (D * D + D * D) * 8  # A [K, K] and B [V, K] per head, float64
    back = 2 * H * D * D * 8  # C and the final state's gradient
    print(f"{'':<32} {'ms':>8} {'peak GiB':>9}")
    print(f"{'the slice alone (kda fwd + bwd)':<32} {alone_ms:>8.2f} {alone_gib:>9.2f}")
    print(f"{'a middle rank of the split':<32} {cp_ms:>8.2f} {cp_gib:>9.2f}")
    print(f"ratio {cp_ms / alone_ms:.2f}; collectives per rank and layer: forward sends {maps / 2**20:.0f} MiB, "
          f"receives {W * maps / 2**20:.0f} MiB; backward sends {back / 2**20:.0f} MiB, receives "
          f"{W * back / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
