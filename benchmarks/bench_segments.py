"""The forward's time over segments (csrc/segments.h) against one pass, per shape:
what the heuristic's choice (csrc/cuda/heuristics.cpp) is measured against.

For each shape and state dtype: the automatic choice and its time, then the time
with every sequence forced into P segments for each P in --segments (1: one pass),
bounded gate, the same inputs throughout. The best P and the automatic choice's
ratio to it close each row; a row whose automatic time is slower than one pass
(beyond --tolerance) is marked LOSES.

    python benchmarks/bench_segments.py [--shapes 10,12,13,s1] [--segments 1,2,3,4,6,8]

Shapes: the long cases of bench_fwd.py by number, and the extra shapes below
(one to four sequences, 2 to 32 heads, 32k to 1M tokens) by their names.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fwd import CASES, STATE_DTYPES, make_case, run_header, run_torch_kda, segments_of, time_ms  # noqa: E402

from torch_kda.testing import forced  # noqa: E402

# name: (description, sequence lengths, H); beside bench_fwd's cases.
EXTRA = {
    "s1": ("1 x 131072", [131072], 8),
    "s2": ("1 x 524288", [524288], 8),
    "s3": ("varlen 2 x 131072", [131072] * 2, 8),
    "s4": ("1 x 131072", [131072], 16),
    "s5": ("varlen 4 x 32768", [32768] * 4, 8),
    "s6": ("1 x 32768", [32768], 16),
    "s7": ("1 x 65536", [65536], 8),
    "s8": ("1 x 262144", [262144], 4),
    "s9": ("1 x 131072", [131072], 32),
    "s10": ("1 x 32768", [32768], 8),
    "s11": ("1 x 65536", [65536], 4),
    "s12": ("1 x 131072", [131072], 12),
    "s13": ("1 x 1048576", [1048576], 2),
    "s14": ("varlen 3 x 65536", [65536] * 3, 4),
}
DEFAULT_SHAPES = "1,6,7,9,10,12,13,14,15," + ",".join(EXTRA)


def shape(key):
    return CASES[int(key)] if key.isdigit() else EXTRA[key]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--segments", default="1,2,3,4,6,8,12")
    ap.add_argument("--state-dtypes", default="bf16,fp32")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tolerance", type=float, default=0.02, help="relative slack before a row is marked LOSES")
    args = ap.parse_args()
    run_header(no_fla=True)
    Ps = [int(x) for x in args.segments.split(",")]
    print(f"{'shape':<6} {'case':<20} {'H':>3} {'state':>5} {'auto P':>6} {'auto ms':>8} "
          + " ".join(f"{'P=' + str(P):>8}" for P in Ps) + f" {'best P':>6} {'auto/best':>9} {'auto/P1':>8}")
    for key in args.shapes.split(","):
        name, lengths, H = shape(key)
        for sd in args.state_dtypes.split(","):
            c = make_case(lengths, H, state_dtype=STATE_DTYPES[sd])
            fn = run_torch_kda(c)
            auto_P = segments_of(c)
            auto = time_ms(fn, args.repeats)
            times = {}
            for P in Ps:
                with forced(segments=P):
                    times[P] = time_ms(fn, args.repeats)
            best = min(times, key=times.get)
            one = times.get(1, float("nan"))
            mark = "  LOSES" if auto > one * (1 + args.tolerance) else ""
            print(f"{key:<6} {name:<20} {H:>3} {sd:>5} {auto_P:>6} {auto:>8.3f} "
                  + " ".join(f"{times[P]:>8.3f}" for P in Ps)
                  + f" {best:>6} {auto / times[best]:>9.2f} {auto / one:>8.2f}{mark}", flush=True)
            del c, fn
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
