"""Runs torch_kda's forward (or, with --backward, a forward + backward step) on
one case of bench_fwd.py (or, with --config, one row of bench_configs.py: other
head sizes, grouped value heads) a few times, for a kernel profiler (ncu) to
attach to:

    ncu --clock-control none -k regex:"prepare|recurrence" python3 benchmarks/profile_case.py --case 7
    ncu --clock-control none -k regex:"sweep|prepare_backward" --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats python3 benchmarks/profile_case.py --case 6 --backward
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fwd import CASES, make_case, run_torch_kda  # noqa: E402
from bench_bwd import step_torch_kda  # noqa: E402
from bench_configs import CONFIGS, forward_and_step, inputs, torch_kda_call  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--config", help="a bench_configs.py row by its label (in place of --case)")
    ap.add_argument("--backward", action="store_true", help="a forward + backward step per call")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.config is not None:
        rows = [row for row in CONFIGS if row[0] == args.config]
        if not rows:
            ap.error(f"--config: no row labelled {args.config!r}; the labels: {[row[0] for row in CONFIGS]}")
        forward, step = forward_and_step(torch_kda_call, inputs(*rows[0][1:]))
        fn = step if args.backward else forward
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        return
    _, lengths, H = CASES[args.case]
    c = make_case(lengths, H)
    if args.backward:
        grads = [torch.randn_like(c["v"]), torch.randn(c["h0"].shape, device="cuda")]
        fn, _ = step_torch_kda(c, grads)
    else:
        fn = run_torch_kda(c)
    for _ in range(args.calls):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
