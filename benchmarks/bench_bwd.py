"""Forward + backward time and peak memory of torch_kda against fla's chunk_kda,
in the same run, on one GPU (cases 1, 4, 6, 9 and 10 of bench_fwd.py by default).

One training step of the op: the forward with an fp32 initial state and the final
state returned, then the backward of (out, final_state) against fixed random
gradients, for every input that has a gradient (q, k, v, g, beta, A_log, dt_bias,
initial_state). Times: CUDA events after warm-up, median of repeats. Peak memory:
the most the caching allocator held during one step, above what it held before
(inputs and incoming gradients are the same for both libraries and not counted).

    FLA_FLASH_KDA=0 python benchmarks/bench_bwd.py [--cases 1,4,6,9,10] [--repeats 10] [--gate softplus]

--gate softplus runs both libraries with the softplus gate (lower_bound=None) on
the bounded case's A_log and dt_bias, as bench_fwd.py's --gate does; fla then runs
without safe_gate, which it allows only with a lower bound.

fla's first backward per shape autotunes for minutes; tools/triton_cache.sh keeps
its results between device calls.
"""
import argparse
import functools
import math
import os
import sys

os.environ.setdefault("FLA_FLASH_KDA", "0")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fwd import CASES, D, GATES, LOWER_BOUND, make_case, run_header, time_ms  # noqa: E402
from bench_fwd import add_forcing_arguments, fla_gate_args, forced_by, skipped  # noqa: E402

import torch_kda  # noqa: E402


def leaves(c, flat_dt_bias):
    """Fresh leaf copies of the case's inputs that require gradients."""
    names = ("q", "k", "v", "g", "beta", "A_log")
    out = {n: c[n].detach().clone().requires_grad_() for n in names}
    dt = c["dt_bias"].flatten() if flat_dt_bias else c["dt_bias"]
    out["dt_bias"] = dt.detach().clone().requires_grad_()
    out["h0"] = c["h0"].float().requires_grad_()
    return out


def step_torch_kda(c, grads, save_for_backward="states_and_records"):
    """A fresh_step of torch_kda on leaf copies of the case's inputs, and the leaves."""
    x = leaves(c, flat_dt_bias=False)
    lower_bound = c.get("lower_bound", LOWER_BOUND)

    def call(x):
        return torch_kda.kda(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
            lower_bound=lower_bound, initial_state=x["h0"], output_final_state=True, cu_seqlens=c["cu"],
            save_for_backward=save_for_backward,
        )

    return fresh_step(call, x, grads), x


def step_fla(c, grads):
    """The same of fla's chunk_kda."""
    from fla.ops.kda import chunk_kda

    # fla returns dt_bias's gradient flat ([H * K]), so its leaf is flat too.
    x = leaves(c, flat_dt_bias=True)
    gate_args = fla_gate_args(c.get("lower_bound", LOWER_BOUND))

    def call(x):
        return chunk_kda(
            x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            state_v_first=True, A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=c["cu"], **gate_args,
        )

    return fresh_step(call, x, grads), x


def fresh_step(call, x, upstream):
    """A training step of call(x) -> (out, final_state) against the upstream gradients,
    x's gradients cleared first: in a model a step's gradients of q, k, v and g are
    new tensors, where a leaf's would be added into its last step's by an elementwise
    pass over every gradient (0.5 ms of a 9.7 ms step at 1 x 8192 x 32 heads of 256)."""
    def step():
        for t in x.values():
            if t is not None:
                t.grad = None
        out, final = call(x)
        torch.autograd.backward([out, final], upstream)

    return step


def step_floor_bytes(c):
    """The least one training step of the op must move: the forward reads q, k, v, g,
    beta and writes out; the backward reads them again with grad_out and writes dq,
    dk, dv, dg, dbeta (bf16); per (sequence, head), the fp32 initial state is read twice,
    the final state written, its gradient read and the initial state's written."""
    per_token_head = (4 * D * 2 + 2 + D * 2) + (4 * D * 2 + 2 + D * 2) + (4 * D * 2 + 2)
    states = 5 * c["N"] * c["H"] * D * D * 4
    return c["T"] * c["H"] * per_token_head + states


def peak_bytes(fn, x):
    """Most the allocator held during one step, above what it held before it."""
    for t in x.values():
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measure(make_step, c, grads, repeats):
    step, x = make_step(c, grads)
    return time_ms(step, repeats), peak_bytes(step, x)


def print_stages(step, repeats=3, top=8):
    """The device time of one step (a call) by kernel, the largest first, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    rows = sorted(((ev.device_time_total / 1e3 / repeats, ev.count // repeats, ev.key) for ev in prof.key_averages()
                   if ev.device_time_total > 0), reverse=True)
    total = sum(r[0] for r in rows)
    print(f"    device time per step {total:.3f} ms over {sum(r[1] for r in rows)} kernels; largest:")
    for ms, count, name in rows[:top]:
        print(f"    {ms:8.3f} ms  x{count:<5} {name[:90]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1,4,6,9,10")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--fla-cases", default=None,
                    help="time fla only on these cases (its backward autotunes for minutes per new shape)")
    ap.add_argument("--stages", action="store_true", help="print torch_kda's device time per kernel")
    ap.add_argument("--gate", choices=GATES, default="bounded",
                    help="bounded: lower_bound=-5; softplus: lower_bound=None (Kimi-Linear's gate)")
    ap.add_argument("--save-for-backward", choices=("states_and_records", "states", "none"),
                    default="states_and_records", help="what torch_kda's forward keeps for the backward")
    add_forcing_arguments(ap, ds_block=True)
    args = ap.parse_args()
    with forced_by(args):
        run(args)


def run(args):
    softplus = args.gate == "softplus"
    ours_step = functools.partial(step_torch_kda, save_for_backward=args.save_for_backward)

    bw, have_fla = run_header(args.no_fla)

    if softplus:
        print("gate: softplus (lower_bound=None), fla without safe_gate")
    print(f"{'#':>3} {'case':<18} {'H':>3} {'torch_kda ms':>12} {'fla ms':>8} {'speedup':>8} "
          f"{'torch_kda GiB':>13} {'fla GiB':>8} {'floor ms':>9} {'x floor':>8}")
    speedups = []
    for idx in [int(x) for x in args.cases.split(",")]:
        name, lengths, H = CASES[idx]
        c = make_case(lengths, H, args.gate)
        grads = [torch.randn_like(c["v"]), torch.randn(c["h0"].shape, device="cuda")]
        try:
            ours, ours_mem = measure(ours_step, c, grads, args.repeats)
        except NotImplementedError as exc:
            print(f"    torch_kda backward unavailable here: {str(exc).splitlines()[0]}")
            ours, ours_mem = float("nan"), float("nan")
        except (RuntimeError, ValueError) as exc:
            # A build that refuses the softplus gate gives a row of nan, not a stop.
            if not (softplus and skipped(exc, "torch_kda")):
                raise
            ours, ours_mem = float("nan"), float("nan")
        fla_here = have_fla and (args.fla_cases is None or idx in {int(x) for x in args.fla_cases.split(",")})
        theirs, theirs_mem = float("nan"), float("nan")
        if fla_here:
            try:
                theirs, theirs_mem = measure(step_fla, c, grads, args.repeats)
            except (RuntimeError, ValueError, AssertionError) as exc:
                if not (softplus and skipped(exc, "fla")):
                    raise
        speedup = theirs / ours
        if fla_here and math.isfinite(speedup):
            speedups.append(speedup)
        gib = 1 << 30
        floor = step_floor_bytes(c) / bw * 1e3
        print(f"{idx:>3} {name:<18} {H:>3} {ours:>12.3f} {theirs:>8.3f} {speedup:>8.2f} "
              f"{ours_mem / gib:>13.2f} {theirs_mem / gib:>8.2f} {floor:>9.3f} {ours / floor:>8.2f}")
        if args.stages and math.isfinite(ours):
            print_stages(ours_step(c, grads)[0])
        del c, grads
        torch.cuda.empty_cache()
    if speedups:
        gmean = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        gate = ", softplus gate" if softplus else ""
        print(f"fwd+bwd speedup over chunk_kda ({len(speedups)} cases{gate}): min {min(speedups):.2f}, "
              f"geometric mean {gmean:.2f}")


if __name__ == "__main__":
    main()
