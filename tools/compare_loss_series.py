#!/usr/bin/env python3
"""Compare the loss series of two train_tiny_lm.py --loss-file records, step by step.

    python tools/compare_loss_series.py A.json B.json [--rtol 2e-2]

Prints both series, the largest absolute and relative difference, the median step
time of each run (step 1, which compiles, left out) and exits 1 if any step differs
by more than rtol relative to A. bf16 compute rounds at 2^-8 = 3.9e-3 per operation,
so two runs that sum the same gradients in another order drift apart by a few of those.
"""
import argparse
import json
import statistics
import sys


def main():
    p = argparse.ArgumentParser()
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rtol", type=float, default=2e-2)
    args = p.parse_args()
    ra, rb = (json.load(open(f)) for f in (args.a, args.b))
    la, lb = ra["loss"], rb["loss"]
    if len(la) != len(lb):
        print(f"different numbers of steps: {len(la)} vs {len(lb)}")
        return 1
    worst_abs = worst_rel = 0.0
    for i, (x, y) in enumerate(zip(la, lb), 1):
        d = abs(x - y)
        worst_abs, worst_rel = max(worst_abs, d), max(worst_rel, d / abs(x))
        print(f"step {i:3d}  {x:.5f}  {y:.5f}  diff {d:.2e}")
    for name, r in (("A", ra), ("B", rb)):
        times = r.get("step_time_s", [])[1:]
        med = f"{1e3 * statistics.median(times):.1f} ms" if times else "-"
        rate = f"{r['tokens_per_s']:,.0f} tokens/s" if r.get("tokens_per_s") else "- tokens/s"
        print(f"{name}: {(r['args'].get('fsdp') and 'fsdp') or (r['args'].get('cp') and 'cp') or 'single'} median step time {med}, {rate}")
    ok = worst_rel <= args.rtol
    print(f"max |diff| {worst_abs:.3e}, max relative {worst_rel:.3e} (rtol {args.rtol:g}): {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
