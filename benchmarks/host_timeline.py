"""Where a forward call's time goes besides its kernels, on one GPU.

For each case of bench_fwd.py: the host time of one torch_kda.fwd call (its
Python, checks and launches), the call's eager time against the replay of a CUDA
graph that captured it (the difference is the host's time before the first
kernel starts), and the kernels' timeline from the profiler: each launch, its
duration and the gap before it.

    python benchmarks/host_timeline.py [--cases 7,12,10,1]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench_fwd  # noqa: E402
import torch_kda  # noqa: E402


def kernel_timeline(fn):
    """(start ns, duration ns, name) of every kernel one call of fn runs, in order."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [(e.start_ns(), e.duration_ns(), e.name()) for e in prof.profiler.kineto_results.events()
              if e.device_type() == torch.autograd.DeviceType.CUDA]
    return sorted(events)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="7,12,10,1")
    ap.add_argument("--show", type=int, default=6, help="kernels listed per case (first and last)")
    args = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  torch_kda from {torch_kda.__file__}")
    for idx in [int(x) for x in args.cases.split(",")]:
        name, lengths, H = bench_fwd.CASES[idx]
        c = bench_fwd.make_case(lengths, H)
        fn = bench_fwd.run_torch_kda(c)
        for _ in range(3):
            fn()
        host = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e6)
        eager = bench_fwd.time_ms(fn, 10)
        replay, captured = bench_fwd.graphed(fn, "torch_kda")
        graph = bench_fwd.time_ms(replay, 10) if captured else float("nan")
        kernels = kernel_timeline(fn)
        busy = sum(d for _, d, _ in kernels) / 1e3
        gaps = [(kernels[i + 1][0] - kernels[i][0] - kernels[i][1]) / 1e3 for i in range(len(kernels) - 1)]
        print(f"case {idx} ({name}, H={H}): host call {statistics.median(host):.1f} us (median), "
              f"eager {eager * 1e3:.1f} us, graph replay {graph * 1e3:.1f} us; {len(kernels)} kernels, "
              f"busy {busy:.1f} us, gaps {sum(gaps):.1f} us (largest {max(gaps, default=0.0):.1f})")
        t0 = kernels[0][0] if kernels else 0
        shown = set(range(min(args.show, len(kernels)))) | set(range(max(len(kernels) - args.show, 0), len(kernels)))
        for i in sorted(shown):
            s, d, kname = kernels[i]
            gap = gaps[i - 1] if i > 0 else 0.0
            print(f"  #{i:<3} +{(s - t0) / 1e3:9.1f} us  gap {gap:6.1f}  {d / 1e3:9.1f} us  {kname[:80]}")
        del c, fn, replay
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
