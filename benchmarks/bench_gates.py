"""Forward and forward + backward times of the formula gates beside precomputed gates
(A_log = dt_bias = None; g bf16 or fp32, with and without a lower bound), torch_kda alone:

    python3 benchmarks/bench_gates.py

8192 tokens, 96 and 32 heads, K = V = 128, bf16 inputs, an fp32 initial state and the
final state returned; medians of CUDA events (milliseconds), eager calls.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fwd import time_ms  # noqa: E402

import torch_kda  # noqa: E402

D = 128


def main():
    for T, H in ((8192, 96), (8192, 32)):
        gen = torch.Generator(device="cuda").manual_seed(0)

        def randn(*shape):
            return torch.randn(*shape, device="cuda", generator=gen)

        q, k, v, g = (randn(1, T, H, D).bfloat16() for _ in range(4))
        beta = randn(1, T, H).bfloat16()
        A_log, dt_bias = torch.rand(H, device="cuda"), torch.rand(H, D, device="cuda")
        h0 = randn(1, H, D, D)
        lam = -5.0 * torch.sigmoid(randn(1, T, H, D))  # a log decay >= -5
        cases = {
            "bounded formula": (g, A_log, dt_bias, -5.0),
            "softplus formula": (g, A_log, dt_bias, None),
            "given bf16, L=-5": (lam.bfloat16(), None, None, -5.0),
            "given fp32, L=-5": (lam, None, None, -5.0),
            "given fp32, any": (lam, None, None, None),
        }
        for name, (gate, a, d, lower_bound) in cases.items():
            def forward():
                return torch_kda.kda(q, k, v, gate, beta, a, d, lower_bound=lower_bound, initial_state=h0,
                                     output_final_state=True)

            leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, gate, beta)]

            def step():
                out, state = torch_kda.kda(*leaves, a, d, lower_bound=lower_bound, initial_state=h0,
                                           output_final_state=True)
                torch.autograd.backward([out, state], [torch.ones_like(out), torch.ones_like(state)])

            print(f"T={T} H={H} {name:<18} forward {time_ms(forward, 20):.3f} ms  step {time_ms(step, 10):.3f} ms")


if __name__ == "__main__":
    main()
