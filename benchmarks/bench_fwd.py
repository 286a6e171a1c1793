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

--gate softplus times the softplus gate (lower_bound=None, Kimi-Linear's) for both
libraries instead of the bounded one (lower_bound=-5). --softplus-params picks its
A_log and dt_bias: "same" (the default) keeps the bounded case's, U(0, 1), so that
the two gates differ in the gate alone; "strong" draws exp(A_log) ~ U(1, 16) per head
and dt_bias ~ N(0, 1) per channel (Kimi-Linear's ranges), whose chunks mostly decay
past 2^-100 (K1's slower, level-by-level products); "resets" adds g ~ 10 N(0, 1) with
half the tokens at +1000 (state resets), for both gates. fla then runs without safe_gate, which it allows
only with a lower bound.
--both-gates times torch_kda with both gates on the same q, k, v, g, beta and
initial state, and fla with the softplus gate:

    FLA_FLASH_KDA=0 python benchmarks/bench_fwd.py --both-gates [--graphs]
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
GATES = ("bounded", "softplus")
STATE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

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
    13: ("1 x 262144", [262144], 8),
    14: ("varlen 4 x 65536", [65536] * 4, 16),
    15: ("1 x 65536 + 63 x 512", [65536] + [512] * 63, 32),
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


def run_header(no_fla):
    """Seeds, prints the GPU and the copy bandwidth, and says whether fla is there:
    (bandwidth in bytes per second, fla importable and wanted)."""
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    bw = copy_bandwidth()
    print(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s")
    if no_fla:
        return bw, False
    try:
        import fla  # noqa: F401
    except ImportError as exc:
        print(f"fla not importable ({exc}): torch_kda only")
        return bw, False
    return bw, True


def copy_bandwidth():
    """Device-to-device copy, bytes read plus bytes written per second."""
    n = 1 << 30  # 1 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeats=20)
    return 2 * n / (ms * 1e-3)


def make_case(lengths, H, gate="bounded", softplus_params_kind="same", state_dtype=torch.bfloat16):
    T = sum(lengths)
    N = len(lengths)
    dev, bf = "cuda", torch.bfloat16
    q = torch.nn.functional.normalize(torch.randn(1, T, H, D, device=dev), dim=-1).to(bf)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, D, device=dev), dim=-1).to(bf)
    v = torch.randn(1, T, H, D, device=dev, dtype=bf)
    g = torch.randn(1, T, H, D, device=dev)
    if softplus_params_kind == "resets":
        # Both gates see these g: 10 N(0, 1), and half the tokens at +1000, whose
        # softplus decay underflows (a state reset) and whose bounded decay is the bound.
        g = torch.where(torch.rand(1, T, H, 1, device=dev) < 0.5, torch.full_like(g, 1000.0), 10 * g)
    g = g.to(bf)
    beta = torch.randn(1, T, H, device=dev, dtype=bf)
    A_log = torch.rand(H, device=dev)
    dt_bias = torch.rand(H, D, device=dev)
    h0 = torch.randn(N, H, D, D, device=dev).to(state_dtype)
    cu = torch.tensor([0] + lengths, device=dev).cumsum(0) if N > 1 else None
    c = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, h0=h0, cu=cu, T=T, N=N, H=H,
             gate="bounded", lower_bound=LOWER_BOUND)
    # The bounded parameters are drawn either way, so that a softplus run sees the
    # same q, k, v, g, beta and initial state as a bounded run of the same seed.
    return with_gate(c, gate, softplus_params_kind)


# The softplus gate's parameters (--softplus-params): "same", the bounded
# case's A_log, dt_bias ~ U(0, 1) (the specified random inputs: about 2 nats of decay a
# token); "strong", exp(A_log) ~ U(1, 16) per head and dt_bias ~ N(0, 1) per
# channel (about 9 nats a token: most chunks decay by more than 2^-100, where
# K1 forms its products level by level); "resets", strong's A_log and dt_bias
# with g ~ 10 N(0, 1) and half the tokens at g = +1000 (make_case draws g so
# for both gates).
SOFTPLUS_PARAMS = ("same", "strong", "resets")


def softplus_params(H, device, kind):
    if kind == "same":
        return torch.rand(H, device=device), torch.rand(H, D, device=device)
    A_log = torch.empty(H, device=device).uniform_(1.0, 16.0).log()
    dt_bias = torch.randn(H, D, device=device)
    return A_log, dt_bias


def with_gate(c, gate, softplus_params_kind="same"):
    """c with the parameters of `gate`; the other tensors are shared, not copied."""
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    if gate == c["gate"]:
        return c
    if gate == "bounded":
        raise ValueError("a softplus case has no bounded parameters: make the case with the bounded gate")
    if softplus_params_kind == "same":
        return dict(c, gate="softplus", lower_bound=None)
    A_log, dt_bias = softplus_params(c["H"], c["q"].device, softplus_params_kind)
    return dict(c, A_log=A_log, dt_bias=dt_bias, gate="softplus", lower_bound=None)


def fla_gate_args(lower_bound):
    """chunk_kda's gate arguments for torch_kda's lower_bound: fla takes safe_gate
    (its 16-row tensor-core path) only with a lower bound in [-5, 0), and its
    softplus gate, -exp(A_log) * softplus(g + dt_bias), is lower_bound=None."""
    return dict(safe_gate=lower_bound is not None, lower_bound=lower_bound)


def skipped(exc, label):
    """For an error from a gate that a library refuses: True (and says so) unless
    the error is the device's own, which leaves the context unusable."""
    text = str(exc).strip()
    if "CUDA error" in text or "illegal memory access" in text:
        return False
    first = text.splitlines()[0][:160] if text else ""
    print(f"    ({label} refused: {type(exc).__name__}: {first})")
    return True


def usable(fn, label):
    """fn after one call that succeeded, or None where the library refused the case."""
    try:
        fn()
        torch.cuda.synchronize()
    except (RuntimeError, ValueError, NotImplementedError, AssertionError) as exc:
        if not skipped(exc, label):
            raise
        return None
    return fn


def floor_bytes(c):
    per_token_head = 4 * D * 2 + 2 + D * 2  # q, k, v, g and beta read, out written (bf16)
    states = 2 * c["N"] * c["H"] * D * D * c["h0"].element_size()  # initial state read, final state written
    return c["T"] * c["H"] * per_token_head + states


def run_torch_kda(c):
    out = torch.empty_like(c["v"])
    final = torch.empty_like(c["h0"])

    lower_bound = c.get("lower_bound", LOWER_BOUND)

    def fn():
        torch_kda.fwd(c["q"], c["k"], c["v"], c["g"], c["beta"], None, out, c["A_log"], c["dt_bias"], lower_bound,
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
    gate_args = fla_gate_args(c.get("lower_bound", LOWER_BOUND))

    def fn():
        chunk_kda(c["q"], c["k"], c["v"], c["g"], c["beta"], initial_state=h0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  state_v_first=True, A_log=c["A_log"], dt_bias=dt_flat, cu_seqlens=c["cu"], **gate_args)

    return fn


def prepare(fn, label, graphs, probe):
    """fn ready to time and a note for its row: (None, "") where the library refused
    the case (tried first when probe is set), else fn or, with graphs, its replay."""
    if probe and usable(fn, label) is None:
        return None, ""
    if not graphs:
        return fn, ""
    fn, ok = graphed(fn, label)
    return fn, "" if ok else f" ({label} eager)"


def time_or_nan(fn, repeats):
    return time_ms(fn, repeats) if fn is not None else float("nan")


def gmean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def segments_of(c):
    """The segments a sequence of case c runs in under the heuristics (and any forcing
    in effect), from torch_kda's own plan (kda_testing::forward_plan)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bf16_state = c["h0"].dtype == torch.bfloat16
    return torch.ops.kda_testing.forward_plan(c["N"], c["T"], c["cu"] is not None, c["H"], sms, bf16_state, False)[3]


def stages_note(c):
    st = stage_ms(run_torch_kda(c))
    note = f"K1 {st.get('prepare', float('nan')):.3f} K2 {st.get('recurrence', float('nan')):.3f}"
    segments = segments_of(c)
    return note + (f" (3 K2 passes over {segments} segments a sequence)" if segments > 1 else "")


def one_gate(args, bw, have_fla, fla_cases):
    """The table for one gate: torch_kda against fla, and against the memory floor."""
    softplus = args.gate == "softplus"
    if softplus:
        print("gate: softplus (lower_bound=None), fla without safe_gate")
    header = f"{'#':>3} {'case':<18} {'H':>3} {'torch_kda ms':>12} {'fla ms':>8} {'speedup':>8} {'floor ms':>9} {'x floor':>8}"
    print(header)
    speedups, rows = [], []
    for idx in [int(x) for x in args.cases.split(",")]:
        name, lengths, H = CASES[idx]
        c = make_case(lengths, H, args.gate, args.softplus_params, STATE_DTYPES[args.state_dtype])
        floor = floor_bytes(c) / bw * 1e3
        with_fla = have_fla and (fla_cases is None or idx in fla_cases)
        ours_fn, theirs_fn = run_torch_kda(c), run_fla(c) if with_fla else None
        # fla may refuse a gate (a row of nan, not a stop); torch_kda serves both.
        ours_fn, mark = prepare(ours_fn, "torch_kda", args.graphs, probe=False)
        if with_fla:
            theirs_fn, note = prepare(theirs_fn, "fla", args.graphs, probe=softplus)
            mark += note
        ours = time_or_nan(ours_fn, args.repeats)
        theirs = time_or_nan(theirs_fn, args.repeats)
        speedup = theirs / ours
        if with_fla and math.isfinite(speedup):
            speedups.append(speedup)
        row = f"{idx:>3} {name:<18} {H:>3} {ours:>12.3f} {theirs:>8.3f} {speedup:>8.2f} {floor:>9.3f} {ours / floor:>8.2f}"
        if args.stages and ours_fn is not None:
            row += "   " + stages_note(c)
        print(row + mark)
        rows.append(dict(case=idx, name=name, H=H, torch_kda_ms=ours, fla_ms=theirs if with_fla else None,
                         floor_ms=floor))
        del c
        torch.cuda.empty_cache()
    if speedups:
        gate = ", softplus gate" if softplus else ""
        print(f"speedup over chunk_kda ({len(speedups)} cases{gate}): min {min(speedups):.2f}, "
              f"geometric mean {gmean(speedups):.2f}")
    return rows


def run_metadata(args, bw):
    """What a table made from this run must say: date, GPU, software, build, command."""
    import datetime
    import subprocess
    import sys

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    try:
        import fla

        fla_version = getattr(fla, "__version__", "unknown")
    except ImportError:
        fla_version = None
    commit = git("rev-parse", "--short", "HEAD")
    if commit is not None and git("status", "--porcelain", "--untracked-files=no"):
        commit += " (with local changes)"
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                gpu=torch.cuda.get_device_name(), torch=torch.__version__, fla=fla_version, commit=commit,
                command=" ".join(["python benchmarks/bench_fwd.py", *sys.argv[1:]]), gate=args.gate,
                copy_bandwidth_tb_s=round(bw / 1e12, 3))


def both_gates(args, bw, have_fla, fla_cases):
    """torch_kda with each gate on the same tensors (the softplus gate's cost over the
    bounded one), and fla with the softplus gate, the one both libraries run unbounded."""
    print(f"gates: bounded (lower_bound={LOWER_BOUND}) and softplus (lower_bound=None) on the same q, k, v, g, beta, "
          f"initial state; fla with softplus, without safe_gate")
    print(f"{'#':>3} {'case':<18} {'H':>3} {'bounded ms':>10} {'softplus ms':>11} {'sp/bd':>6} "
          f"{'fla sp ms':>9} {'speedup':>8} {'floor ms':>9}   ({args.state_dtype} states, softplus parameters "
          f"{args.softplus_params!r})")
    ratios, speedups = [], []
    for idx in [int(x) for x in args.cases.split(",")]:
        name, lengths, H = CASES[idx]
        cb = make_case(lengths, H, "bounded", args.softplus_params, STATE_DTYPES[args.state_dtype])
        cs = with_gate(cb, "softplus", args.softplus_params)
        floor = floor_bytes(cb) / bw * 1e3
        with_fla = have_fla and (fla_cases is None or idx in fla_cases)
        bounded_fn, softplus_fn = run_torch_kda(cb), run_torch_kda(cs)
        theirs_fn = run_fla(cs) if with_fla else None
        bounded_fn, mark = prepare(bounded_fn, "torch_kda bounded", args.graphs, probe=False)
        softplus_fn, note = prepare(softplus_fn, "torch_kda softplus", args.graphs, probe=False)
        mark += note
        if with_fla:
            theirs_fn, note = prepare(theirs_fn, "fla softplus", args.graphs, probe=True)
            mark += note
        bounded = time_or_nan(bounded_fn, args.repeats)
        ours = time_or_nan(softplus_fn, args.repeats)
        theirs = time_or_nan(theirs_fn, args.repeats)
        ratio, speedup = ours / bounded, theirs / ours
        if math.isfinite(ratio):
            ratios.append(ratio)
        if with_fla and math.isfinite(speedup):
            speedups.append(speedup)
        row = (f"{idx:>3} {name:<18} {H:>3} {bounded:>10.3f} {ours:>11.3f} {ratio:>6.2f} "
               f"{theirs:>9.3f} {speedup:>8.2f} {floor:>9.3f}")
        if args.stages:
            row += "   bounded " + stages_note(cb)
            if softplus_fn is not None:
                row += ", softplus " + stages_note(cs)
        print(row + mark)
        del cb, cs
        torch.cuda.empty_cache()
    if ratios:
        print(f"torch_kda softplus / bounded ({len(ratios)} cases): max {max(ratios):.2f}, "
              f"geometric mean {gmean(ratios):.2f}")
    if speedups:
        print(f"speedup over chunk_kda, softplus gate ({len(speedups)} cases): min {min(speedups):.2f}, "
              f"geometric mean {gmean(speedups):.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(str(i) for i in CASES))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--fla-cases", default=None,
                    help="time fla on these cases only (its first call per shape autotunes for minutes)")
    ap.add_argument("--stages", action="store_true", help="print torch_kda's time per kernel")
    ap.add_argument("--graphs", action="store_true", help="time CUDA graph replays (no host launch time)")
    ap.add_argument("--gate", choices=GATES, default="bounded",
                    help="bounded: lower_bound=-5; softplus: lower_bound=None (Kimi-Linear's gate)")
    ap.add_argument("--both-gates", action="store_true",
                    help="torch_kda with both gates and fla with softplus, per case in one row (overrides --gate)")
    ap.add_argument("--json", default=None,
                    help="also write the rows and the run's date, GPU, software, commit and command here "
                         "(one gate; benchmarks/render_results.py makes the README's table and chart from it)")
    ap.add_argument("--softplus-params", choices=SOFTPLUS_PARAMS, default="same",
                    help="same: the bounded case's A_log and dt_bias; strong: exp(A_log) ~ U(1, 16), dt_bias ~ N(0, 1)")
    ap.add_argument("--state-dtype", choices=tuple(STATE_DTYPES), default="bf16",
                    help="the initial and final states' dtype (fp32: K2's bf16x3 products)")
    add_forcing_arguments(ap)
    args = ap.parse_args()
    if args.json and args.both_gates:
        ap.error("--json writes one gate's table: leave out --both-gates")
    with forced_by(args):
        run(args)


def add_forcing_arguments(ap, ds_block=False):
    """Options that force the CUDA path's choices for the whole run (torch_kda.testing), for A/B runs."""
    ap.add_argument("--recurrence-block", default="auto", help="K2's block shape: 4x1w, 2x2 or 4x4")
    if ds_block:
        ap.add_argument("--ds-block", default="auto", help="the dS recurrence's block shape: 4x1, 4x2 or 2x2")
    ap.add_argument("--window-slots", type=int, default=None, help="0: one pass; n: windows of n chunk slots")
    ap.add_argument("--segments", type=int, default=None,
                    help="cut every sequence of a forward into this many segments (1: none)")


def forced_by(args):
    import contextlib

    from torch_kda.testing import forced

    shapes = (args.recurrence_block, getattr(args, "ds_block", "auto"))
    if shapes == ("auto", "auto") and args.window_slots is None and args.segments is None:
        return contextlib.nullcontext()
    return forced(*shapes, args.window_slots, segments=args.segments)


def run(args):
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

    fla_cases = None if args.fla_cases is None else {int(x) for x in args.fla_cases.split(",")}
    if args.both_gates:
        both_gates(args, bw, have_fla, fla_cases)
    else:
        rows = one_gate(args, bw, have_fla, fla_cases)
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump(dict(run=run_metadata(args, bw), rows=rows), f, indent=1, allow_nan=True)
            print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
