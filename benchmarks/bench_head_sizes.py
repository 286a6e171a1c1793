"""The CUDA forward at head sizes 64, 128 and 256 (K = V), against its HBM floor,
with K2's block shape automatic and forced (2x2 and 4x4 at 64 and 128; 8x4 and 16x4,
two and four 4x4 row groups a block, at 256; the 4x1w is 128 wide):

    python3 benchmarks/bench_head_sizes.py [--sizes 64 128 256] [--repeats 10] [--step]

Bounded gate (lower_bound = -5), bf16 inputs, an fp32 or a bf16 initial state and
the final state returned; torch_kda.kda without gradients, eager, medians of CUDA
events (ms). The floor: q, k, v, g and beta read and out written once (bf16), the
initial state read and the final state written once, at the copy bandwidth
measured at start. --step times forward + backward instead (each step's gradients new tensors), with the dS
recurrence's block shape automatic and each one served at the size forced. fla's
side of these shapes is benchmarks/bench_configs.py.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_bwd import fresh_step  # noqa: E402
from bench_fwd import copy_bandwidth, time_ms  # noqa: E402

import torch_kda  # noqa: E402
from torch_kda.testing import forced  # noqa: E402

# (sequences, tokens each, heads)
SHAPES = [(1, 8192, 32), (8, 1024, 32), (1, 8192, 96), (1, 32768, 8)]
BLOCKS = ("auto", "2x2", "4x4", "8x4", "16x4")  # the table's columns
# The block shapes with kernels at each head size (csrc/cuda/launch.h, has_kernels).
K2_BLOCKS = {64: ("2x2", "4x4"), 128: ("2x2", "4x4"), 256: ("8x4", "16x4")}


def inputs(N, T, H, D, state_dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    c = {n: randn(1, N * T, H, D).bfloat16() for n in ("q", "k", "v", "g")}
    c["beta"] = randn(1, N * T, H).bfloat16()
    c["A_log"] = torch.rand(H, device="cuda", generator=gen)
    c["dt_bias"] = torch.rand(H, D, device="cuda", generator=gen)
    c["h0"] = randn(N, H, D, D).to(state_dtype)
    c["cu"] = torch.arange(0, N * T + 1, T, device="cuda") if N > 1 else None
    return c


def floor_bytes(N, T, H, D, state_bytes):
    return N * T * H * (5 * D * 2 + 2) + 2 * N * H * D * D * state_bytes


DS_BLOCKS = {64: ("auto", "4x1", "4x2", "2x2"), 128: ("auto", "4x1", "4x2", "2x2"), 256: ("auto", "4x2", "2x2", "8x2")}
STATE = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def call(c, leaves=None):
    x = {**c, **(leaves or {})}
    return torch_kda.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], lower_bound=-5.0,
                         initial_state=x["h0"], output_final_state=True, cu_seqlens=x["cu"])


def forward_times(c, D, repeats):
    """The forward with K2's block shape automatic, then each shape forced (None where
    it has no kernels at D)."""
    def forward():
        with torch.no_grad():
            call(c)

    times = []
    for block in BLOCKS:
        if block != "auto" and block not in K2_BLOCKS[D]:
            times.append(None)
            continue
        with forced(recurrence_block=block):
            times.append(time_ms(forward, repeats))
    return times


def step_times(c, D, repeats):
    """Forward + backward of q, k, v, g, beta and the initial state, with the dS
    recurrence's block shape automatic, then each one served at D forced."""
    leaves = {n: c[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "h0")}
    step = fresh_step(lambda x: call(c, x), leaves, [torch.ones_like(c["v"]), torch.ones_like(c["h0"])])

    times = []
    for block in DS_BLOCKS[D]:
        with forced(ds_block=block):
            times.append(time_ms(step, repeats))
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--step", action="store_true",
                    help="time forward + backward by the dS recurrence's block shape instead")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s")
    if args.step:
        print(f"{'shape':<14} {'state':<5} {'D':>4}  step ms, the dS recurrence's shape: automatic, then forced")
    else:
        print(f"{'shape':<14} {'state':<5} {'D':>4} " + " ".join(f"{b:>8}" for b in BLOCKS)
              + f" {'floor':>7} {'x floor':>7}")
    for N, T, H in SHAPES:
        for state_dtype in (torch.float32, torch.bfloat16):
            for D in args.sizes:
                c = inputs(N, T, H, D, state_dtype)
                label = f"{N}x{T} H{H:<5} {STATE[state_dtype]:<5} {D:>4}"
                if args.step:
                    times = step_times(c, D, args.repeats)
                    print(label + " " + " ".join(f"{b}: {t:.3f}" for b, t in zip(DS_BLOCKS[D], times)), flush=True)
                else:
                    times = forward_times(c, D, args.repeats)
                    floor = floor_bytes(N, T, H, D, c["h0"].element_size()) / bw * 1e3
                    print(label + " " + " ".join(f"{t:8.3f}" if t is not None else "       -" for t in times)
                          + f" {floor:7.3f} {times[0] / floor:7.2f}", flush=True)
                del c
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
