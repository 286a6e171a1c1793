#!/usr/bin/env python3
"""CPU timings of torch_kda: forward and forward + backward.

    python benchmarks/bench_cpu.py [--fwd-T 8192 --fwd-H 8] [--bwd-T 2048 --bwd-H 4] [--repeats 3] [--threads N]

Inputs: B = 1, K = V = 128, q, k, v, g, beta bf16 ~ N(0, 1), A_log and dt_bias fp32 ~ U(0, 1),
bounded gate (lower_bound = -5), fp32 initial state, final state returned.
Each case runs once to warm up, then `--repeats` times; the median is reported.
The backward case times the backward operator torch.ops.kda.bwd alone (given grad_out and
grad_final_state), and a whole autograd step through torch_kda.kda (forward + backward).
"""
import argparse
import os
import platform
import statistics
import time

import torch

import torch_kda


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def inputs(T, H, K=128, V=128, requires_grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_(requires_grad)

    return dict(
        q=randn(1, T, H, K),
        k=randn(1, T, H, K),
        v=randn(1, T, H, V),
        g=randn(1, T, H, K),
        beta=randn(1, T, H),
        A_log=torch.rand(H, generator=gen).requires_grad_(requires_grad),
        dt_bias=torch.rand(H, K, generator=gen).requires_grad_(requires_grad),
        initial_state=randn(1, H, V, K, dtype=torch.float32),
    )


def median_ms(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def call(x):
    return torch_kda.kda(**x, lower_bound=-5.0, output_final_state=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fwd-T", type=int, default=8192)
    parser.add_argument("--fwd-H", type=int, default=8)
    parser.add_argument("--bwd-T", type=int, default=2048)
    parser.add_argument("--bwd-H", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, torch_kda {torch_kda.__version__}")
    print(f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs visible)")
    print(f"torch.get_num_threads(): {torch.get_num_threads()}")
    if hasattr(os, "getloadavg"):
        print("load average before the run (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"warm-up 1, median of {args.repeats}; B=1, K=V=128, bf16 inputs, lower_bound=-5, fp32 state")

    x = inputs(args.fwd_T, args.fwd_H)
    with torch.no_grad():
        ms, all_ms = median_ms(lambda: call(x), args.repeats)
    tok_head = args.fwd_T * args.fwd_H
    print(f"forward  T={args.fwd_T} H={args.fwd_H}: {ms:9.1f} ms   "
          f"({tok_head / ms:.0f} k token-heads/s; runs: {', '.join(f'{t:.1f}' for t in all_ms)})")

    T, H = args.bwd_T, args.bwd_H
    x = inputs(T, H, requires_grad=True)
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(1, T, H, 128, generator=gen).to(torch.bfloat16)
    grad_ht = torch.randn(1, H, 128, 128, generator=gen)
    d = {n: t.detach() for n, t in x.items()}

    def bwd_op():
        return torch.ops.kda.bwd(
            grad_out, grad_ht, d["q"], d["k"], d["v"], d["g"], d["beta"], d["A_log"], d["dt_bias"],
            None, -5.0, d["initial_state"], None,
        )

    def fwd_bwd():
        for t in x.values():
            t.grad = None
        out, ht = call(x)
        torch.autograd.backward([out, ht], [grad_out, grad_ht])

    with torch.no_grad():
        f, _ = median_ms(lambda: call(d), args.repeats)
    b, b_all = median_ms(bwd_op, args.repeats)
    fb, fb_all = median_ms(fwd_bwd, args.repeats)
    print(f"forward  T={T} H={H}: {f:9.1f} ms")
    print(f"backward T={T} H={H}: {b:9.1f} ms   (torch.ops.kda.bwd alone; runs: {', '.join(f'{t:.1f}' for t in b_all)})")
    print(f"fwd+bwd  T={T} H={H}: {fb:9.1f} ms   (autograd step; runs: {', '.join(f'{t:.1f}' for t in fb_all)})")

if __name__ == "__main__":
    main()
