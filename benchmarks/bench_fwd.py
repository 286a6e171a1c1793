"""Forward time of torch_kda against fla's chunk_kda, in the same run, on one GPU.

For each case: torch_kda ms, chunk_kda ms, speedup, the memory floor (bytes that
must move over the device-to-device copy bandwidth measured at start) and
torch_kda over that floor. CUDA events, warm-up first, median of repeats.

    FLA_FLASH_KDA=0 python benchmarks/bench_fwd.py [--cases 1,4,7] [--repeats 20] [--stages]

--stages adds torch_kda's time per kernel (prepare K1, recurrence K2) from the
profiler, to show which stage a change moved.

--graphs times each call as the replay of a CUDA graph that captured it, which takes
the host's launch time out: fla's forward is several Triton launches from Python,
and at 8192 tokens its eager time moved by up to 2x between machines of the same
kind. Where a call cannot be captured (fla's varlen path reads cu_seqlens on the
host), it is timed eagerly and its row says so.
"""
import argparse
import math
import os
import statistics

os.environ.setdefault("FLA_FLASH_KDA", "0")

import torch  # noqa: E402

import torch_kda  # noqa: E402

D = 128
LOWER_BOUND = -5.0

# (name, sequence lengths, H); one length means one fixed-length sequence.
CASES = {
    1: ("1 x 8192", [8192], 96),
    2: ("varlen 6 mixed", [1300, 547, 2048, 963, 271, 3063], 96),
    3: ("varlen 8 x 1024", [1024] * 8, 96),
    4: ("1 x 8192", [8192], 64),
    5: ("varlen 8 x 1024", [1024] * 8, 64),
    6: ("1 x 8192", [8192], 32),
    7: ("1 x 8192", [8192], 16),
    8: ("varlen 8 x 1024", [1024] * 8, 32),
    9: ("varlen 8 x 8192", [8192] * 8, 32),
    10: ("1 x 32768", [32768], 32),
    11: ("varlen 64 x 512", [512] * 64, 32),
    12: ("1 x 65536", [65536], 16),
}


def time_ms(fn, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(fn, label):
    """fn captured in a CUDA graph after a warm-up (on a side stream, as capture
    requires), returned as the graph's replay; fn itself where capture fails."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # a host sync inside fn, typically
        torch.cuda.synchronize()
        print(f"    ({label}: not capturable, timed eagerly: {type(exc).__name__}: {str(exc)[:80]})")
        return fn, False
    # The replay keeps fn alive: fn's closure is the last owner of buffers that the
    # graph uses outside its private pool (torch_kda's out and final_state, fla's fp32
    # initial state). The bare graph.replay let them be freed, and with fla's graph
    # captured next our replays faulted (illegal memory access at 8192 x 32 heads;
    # tests/test_bench_graphs.py).
    def replay(graph=graph, fn=fn):
        graph.replay()

    return replay, True


def copy_bandwidth():
    """Device-to-device copy, bytes read plus bytes written per second."""
    n = 1 << 30  # 1 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeats=20)
    return 2 * n / (ms * 1e-3)


def make_case(lengths, H):
    T = sum(lengths)
    N = len(lengths)
    dev, bf = "cuda", torch.bfloat16
    q = torch.nn.functional.normalize(torch.randn(1, T, H, D, device=dev), dim=-1).to(bf)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, D, device=dev), dim=-1).to(bf)
    v = torch.randn(1, T, H, D, device=dev, dtype=bf)
    g = torch.randn(1, T, H, D, device=dev, dtype=bf)
    beta = torch.randn(1, T, H, device=dev, dtype=bf)
    A_log = torch.rand(H, device=dev)
    dt_bias = torch.rand(H, D, device=dev)
    h0 = torch.randn(N, H, D, D, device=dev, dtype=bf)
    cu = torch.tensor([0] + lengths, device=dev).cumsum(0) if N > 1 else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, h0=h0, cu=cu, T=T, N=N, H=H)


def floor_bytes(c):
    per_token_head = 4 * D * 2 + 2 + D * 2  # q, k, v, g and beta read, out written (bf16)
    states = 2 * c["N"] * c["H"] * D * D * 2  # bf16 initial state read, final state written
    return c["T"] * c["H"] * per_token_head + states


def run_torch_kda(c):
    out = torch.empty_like(c["v"])
    final = torch.empty_like(c["h0"])

    def fn():
        torch_kda.fwd(c["q"], c["k"], c["v"], c["g"], c["beta"], None, out, c["A_log"], c["dt_bias"], LOWER_BOUND,
                      initial_state=c["h0"], final_state=final, cu_seqlens=c["cu"])

    return fn


def stage_ms(fn, repeats=5):
    """Mean device time per call of each torch_kda kernel, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.key_averages():
        for stage in ("prepare", "recurrence"):
            if stage in ev.key:
                times[stage] = times.get(stage, 0.0) + ev.device_time_total / 1e3 / repeats
    return times


def run_fla(c):
    from fla.ops.kda import chunk_kda

    h0 = c["h0"].float()
    dt_flat = c["dt_bias"].flatten()

    def fn():
        chunk_kda(c["q"], c["k"], c["v"], c["g"], c["beta"], initial_state=h0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  safe_gate=True, lower_bound=LOWER_BOUND, state_v_first=True, A_log=c["A_log"], dt_bias=dt_flat,
                  cu_seqlens=c["cu"])

    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(str(i) for i in CASES))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--fla-cases", default=None,
                    help="time fla on these cases only (its first call per shape autotunes for minutes)")
    ap.add_argument("--stages", action="store_true", help="print torch_kda's time per kernel")
    ap.add_argument("--graphs", action="store_true", help="time CUDA graph replays (no host launch time)")
    args = ap.parse_args()

    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    bw = copy_bandwidth()
    print(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s")
    have_fla = False
    if not args.no_fla:
        try:
            import fla  # noqa: F401

            have_fla = True
        except ImportError as exc:
            print(f"fla not importable ({exc}): torch_kda only")

    header = f"{'#':>3} {'case':<18} {'H':>3} {'torch_kda ms':>12} {'fla ms':>8} {'speedup':>8} {'floor ms':>9} {'x floor':>8}"
    print(header)
    speedups = []
    fla_cases = None if args.fla_cases is None else {int(x) for x in args.fla_cases.split(",")}
    for idx in [int(x) for x in args.cases.split(",")]:
        name, lengths, H = CASES[idx]
        c = make_case(lengths, H)
        ours_fn, theirs_fn = run_torch_kda(c), None
        floor = floor_bytes(c) / bw * 1e3
        with_fla = have_fla and (fla_cases is None or idx in fla_cases)
        if with_fla:
            theirs_fn = run_fla(c)
        mark = ""
        if args.graphs:
            ours_fn, ok = graphed(ours_fn, "torch_kda")
            mark += "" if ok else " (torch_kda eager)"
            if with_fla:
                theirs_fn, ok = graphed(theirs_fn, "fla")
                mark += "" if ok else " (fla eager)"
        ours = time_ms(ours_fn, args.repeats)
        theirs = time_ms(theirs_fn, args.repeats) if with_fla else float("nan")
        speedup = theirs / ours
        if with_fla:
            speedups.append(speedup)
        row = f"{idx:>3} {name:<18} {H:>3} {ours:>12.3f} {theirs:>8.3f} {speedup:>8.2f} {floor:>9.3f} {ours / floor:>8.2f}"
        if args.stages:
            st = stage_ms(run_torch_kda(c))
            row += f"   K1 {st.get('prepare', float('nan')):.3f} K2 {st.get('recurrence', float('nan')):.3f}"
        print(row + mark)
        del c
        torch.cuda.empty_cache()
    if speedups:
        gmean = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        print(f"speedup over chunk_kda ({len(speedups)} cases): min {min(speedups):.2f}, geometric mean {gmean:.2f}")


if __name__ == "__main__":
    main()
