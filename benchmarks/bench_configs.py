"""fla's other KDA configurations against fla's chunk_kda in the same run: head sizes
64, 128 and 256 at 1 x 8192 and 8 x 1024 tokens with 32 heads, and grouped value heads
(HV = 2 H) at 8192 tokens, 96 value heads:

    python3 benchmarks/bench_configs.py [--no-fla] [--fla-backward] [--warm-fla N] [--only D256 ...] [--stages]

Bounded gate (lower_bound = -5), bf16 inputs, an fp32 initial state and the final
state returned; medians of CUDA events (ms), eager calls. Forward: torch_kda.kda
without gradients; step: forward + backward of every input, its gradients new tensors
each step (bench_bwd.fresh_step), not added into the last step's. fla's first backward at
each new shape autotunes for minutes, so its step runs only with --fla-backward;
--warm-fla N first compiles fla's kernels for the chosen configs in N processes
(fla_warm.py), so that its autotuning finds them compiled.
--stages prints torch_kda's step time per kernel (the profiler's) under each row.
"""
import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_bwd import fresh_step, print_stages  # noqa: E402
from bench_fwd import fla_gate_args, time_ms, usable  # noqa: E402
from fla_warm import warm  # noqa: E402

import torch_kda  # noqa: E402

LOWER_BOUND = -5.0
# (label, sequences, tokens each, query/key heads H, value heads HV, K = V)
CONFIGS = [
    ("1x8192 H32 D64", 1, 8192, 32, 32, 64),
    ("8x1024 H32 D64", 8, 1024, 32, 32, 64),
    ("1x8192 H32 D128", 1, 8192, 32, 32, 128),
    ("8x1024 H32 D128", 8, 1024, 32, 32, 128),
    ("1x8192 H32 D256", 1, 8192, 32, 32, 256),
    ("8x1024 H32 D256", 8, 1024, 32, 32, 256),
    ("1x8192 H48 HV96 D128", 1, 8192, 48, 96, 128),
    ("1x8192 H96 D128", 1, 8192, 96, 96, 128),
]


def inputs(N, T, H, HV, D):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    c = {"q": randn(1, N * T, H, D).bfloat16(), "k": randn(1, N * T, H, D).bfloat16(),
         "v": randn(1, N * T, HV, D).bfloat16(), "g": randn(1, N * T, HV, D).bfloat16(),
         "beta": randn(1, N * T, HV).bfloat16(), "A_log": torch.rand(HV, device="cuda"),
         "dt_bias": torch.rand(HV, D, device="cuda"), "h0": randn(N, HV, D, D)}
    c["cu"] = torch.arange(0, N * T + 1, T, device="cuda") if N > 1 else None
    return c


def forward_and_step(call, c):
    """A forward without gradients and a forward + backward of every input, of call(x)
    on the inputs c (a library's call on a dict of them)."""
    def forward():
        with torch.no_grad():
            call(c)

    leaves = {n: t.detach().clone().requires_grad_() if n != "cu" and t is not None else t for n, t in c.items()}
    return forward, fresh_step(call, leaves, [torch.ones_like(c["v"]), torch.ones_like(c["h0"])])


def torch_kda_call(x):
    return torch_kda.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                         lower_bound=LOWER_BOUND, initial_state=x["h0"], output_final_state=True,
                         cu_seqlens=x["cu"])


def fla_call(x):
    from fla.ops.kda import chunk_kda

    # fla takes dt_bias flat ([HV * K]).
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     state_v_first=True, A_log=x["A_log"], dt_bias=x["dt_bias"].flatten(), cu_seqlens=x["cu"],
                     **fla_gate_args(LOWER_BOUND))


def fla_once(label, backward=True):
    """One forward of fla's chunk_kda (and with backward one step) at the config
    labelled so: what fla_warm's processes run."""
    (_, N, T, H, HV, D), = [cfg for cfg in CONFIGS if cfg[0] == label]
    fwd, step = forward_and_step(fla_call, inputs(N, T, H, HV, D))
    fwd()
    if backward:
        step()


def timed(fn, repeats, label):
    """Median ms, or None where the library refused the configuration."""
    fn = usable(fn, label)
    return time_ms(fn, repeats) if fn is not None else None


def fmt(x):
    return f"{x:8.3f}" if x is not None else "       -"


def ratio(a, b):
    return f"{b / a:6.2f}x" if a is not None and b is not None else "      -"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--fla-backward", action="store_true", help="also fla's step (autotunes at each new shape)")
    ap.add_argument("--warm-fla", type=int, default=0, metavar="N",
                    help="compile fla's kernels for the chosen configs in N processes first")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--only", nargs="+", default=[], help="the configs whose labels contain one of these")
    ap.add_argument("--stages", action="store_true", help="print torch_kda's step time per kernel")
    args = ap.parse_args()
    chosen = [cfg for cfg in CONFIGS if not args.only or any(part in cfg[0] for part in args.only)]
    if args.warm_fla and not args.no_fla:
        warm(functools.partial(fla_once, backward=args.fla_backward), [cfg[0] for cfg in chosen], args.warm_fla)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'config':<22} {'fwd ms':>8} {'fla fwd':>8} {'speedup':>7} {'step ms':>8} {'fla step':>8} {'speedup':>7}")
    for label, N, T, H, HV, D in chosen:
        c = inputs(N, T, H, HV, D)
        fwd, step = forward_and_step(torch_kda_call, c)
        ours = timed(fwd, 2 * args.repeats, f"torch_kda {label}"), timed(step, args.repeats, f"torch_kda {label}")
        theirs = None, None
        if not args.no_fla:
            ffwd, fstep = forward_and_step(fla_call, c)
            theirs = (timed(ffwd, 2 * args.repeats, f"fla {label}"),
                      timed(fstep, args.repeats, f"fla {label}") if args.fla_backward else None)
        print(f"{label:<22} {fmt(ours[0])} {fmt(theirs[0])} {ratio(ours[0], theirs[0])} "
              f"{fmt(ours[1])} {fmt(theirs[1])} {ratio(ours[1], theirs[1])}", flush=True)
        if args.stages:
            print_stages(step)
        del c
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
