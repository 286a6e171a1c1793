"""Runs torch_kda's forward on one case of bench_fwd.py a few times, for a
kernel profiler (ncu) to attach to:

    ncu --clock-control none -k regex:"prepare|recurrence" python3 benchmarks/profile_case.py --case 7
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fwd import CASES, make_case, run_torch_kda  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    _, lengths, H = CASES[args.case]
    fn = run_torch_kda(make_case(lengths, H))
    for _ in range(args.calls):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
