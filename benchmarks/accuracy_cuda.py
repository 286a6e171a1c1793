"""Accuracy of torch_kda's CUDA forward and of fla's chunk_kda on the same
inputs, against a float64 token-by-token evaluation (torch_kda.reference, run
on the GPU in float64). Cases: the random case and the hard cases (weak decay, small beta,
several lower bounds, long sequences). Prints a markdown table of rel = ||x - ref|| / ||ref||.

    FLA_FLASH_KDA=0 python benchmarks/accuracy_cuda.py

--gate softplus: the softplus gate (lower_bound=None, Kimi-Linear's) with that
model's parameter ranges (A_log = log U(1, 16) per head, dt_bias ~ N(0, 1) per
channel, g ~ N(0, 1)), H = 4, on random cases of several lengths, strong decay
(g ~ 10 N(0, 1) and g = +1000, a state reset, at a random half of the tokens),
weak decay (g = -1000, a decay of exactly 1, at a random 10, 50 or 90 % of the
tokens; and A_log = dt_bias = -8 everywhere) and packed sequences.
Each case is one row: torch_kda from a bf16 and from an fp32 initial state (the
same values), fla's chunk_kda from the fp32 one (fla takes no other; its output
and final state, without safe_gate, which it allows only with a lower bound).
A last line says whether every case meets: torch_kda's bf16-state out and state
no worse than fla's, fp32-state out <= 5e-3 on the random cases, and every
torch_kda error <= 2e-2. --grads adds the relative error of the gradients of all
eight inputs on five of the cases, for both libraries (fp32 initial state)
against float64 autograd through the same reference, and the ratio torch_kda /
fla. With OUT set, the rows go to $OUT/accuracy_softplus.json.

    FLA_FLASH_KDA=0 python benchmarks/accuracy_cuda.py --gate softplus [--grads]
"""
import argparse
import functools
import json
import math
import os
import sys

os.environ.setdefault("FLA_FLASH_KDA", "0")

import torch  # noqa: E402

import torch_kda  # noqa: E402
from torch_kda.naive import kda_naive  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fwd import fla_gate_args, skipped, softplus_params  # noqa: E402

D = 128
DEV = "cuda"


def rel(x, ref):
    return (torch.linalg.vector_norm(x.double() - ref) / torch.linalg.vector_norm(ref)).item()


def make(B, T, H, state_dtype, weak_decay=False, small_beta=False):
    dev, bf = "cuda", torch.bfloat16
    d = dict(
        q=torch.randn(B, T, H, D, device=dev).to(bf),
        k=torch.randn(B, T, H, D, device=dev).to(bf),
        v=torch.randn(B, T, H, D, device=dev).to(bf),
        g=torch.randn(B, T, H, D, device=dev).to(bf),
        beta=torch.randn(B, T, H, device=dev).to(bf),
        A_log=torch.rand(H, device=dev),
        dt_bias=torch.rand(H, D, device=dev),
        h0=torch.randn(B, H, D, D, device=dev).to(state_dtype),
    )
    if weak_decay:
        d["A_log"].fill_(2.0)
        d["dt_bias"].fill_(-8.0)
    if small_beta:
        d["beta"] = (d["beta"].float() - 6.0).to(bf)
    return d


def fla_run(d, lower_bound):
    from fla.ops.kda import chunk_kda

    return chunk_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["h0"].float(),
                     output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=lower_bound, state_v_first=True,
                     A_log=d["A_log"], dt_bias=d["dt_bias"].flatten())


def bounded_table():
    torch.manual_seed(0)
    cases = [
        ("random", dict(B=2, T=1024, H=4), -5.0, {}),
        ("weak decay", dict(B=1, T=4096, H=2), -5.0, dict(weak_decay=True)),
        ("small beta", dict(B=1, T=4096, H=2), -5.0, dict(small_beta=True)),
        ("lower_bound -0.1", dict(B=1, T=4096, H=2), -0.1, {}),
        ("lower_bound -1", dict(B=1, T=4096, H=2), -1.0, {}),
        ("lower_bound -5", dict(B=1, T=4096, H=2), -5.0, {}),
        ("long T=65536", dict(B=1, T=65536, H=2), -5.0, {}),
    ]
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("| case | state | torch_kda out | torch_kda state | chunk_kda out | chunk_kda state (fp32) |")
    print("|---|---|---|---|---|---|")
    for name, shape, lb, extra in cases:
        for state_dtype in (torch.bfloat16, torch.float32):
            d = make(state_dtype=state_dtype, **shape, **extra)
            out, final = torch_kda.kda(d["q"], d["k"], d["v"], d["g"], d["beta"], d["A_log"], d["dt_bias"],
                                       lower_bound=lb, initial_state=d["h0"], output_final_state=True)
            r_out, r_final = kda_naive(*(d[n].double() for n in ("q", "k", "v", "g", "beta", "A_log",
                                                                      "dt_bias")),
                                           lower_bound=lb, initial_state=d["h0"].double())
            try:
                f_out, f_final = fla_run(d, lb)
                fla_cols = f"{rel(f_out, r_out):.2e} | {rel(f_final, r_final):.2e}"
            except ImportError:
                fla_cols = "n/a | n/a"
            print(f"| {name} | {str(state_dtype).replace('torch.', '')} | {rel(out, r_out):.2e} | "
                  f"{rel(final, r_final):.2e} | {fla_cols} |", flush=True)


# --------------------------------------------------------------------------
# The softplus gate.
# --------------------------------------------------------------------------

SP_HEADS = 4
STRONG_T = 1024
WEAK_T = 4096  # thousands of tokens without decay at 90 %
RANDOM_FP32_OUT = 5e-3  # the random case's target, held here by the fp32 state
HARD_LIMIT = 2e-2
INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")
GRAD_CASES = ("random T=500", "random T=1024", "strong decay", "weak decay 50%", "varlen [0, 256, 500, 1000]")


def softplus_cases():
    """(name, group, cu_seqlens or None, sequence lengths, change to g) per case."""
    cases = [(f"random T={T}", "random", None, [T], None) for T in (63, 160, 500, 1000, 1024, 1500, 2048)]
    cases.append(("strong decay", "strong", None, [STRONG_T], ("reset", 0.5)))
    cases += [(f"weak decay {round(f * 100)}%", "weak", None, [WEAK_T], ("hold", f)) for f in (0.1, 0.5, 0.9)]
    cases.append(("weak decay everywhere", "weak", None, [WEAK_T], ("spec", None)))
    for cu in ([0, 15], [0, 256, 500, 1000], [0, 15, 100, 300, 1200, 2000], [0, 100, 300, 1200, 3000, 4096],
               [0, 8192]):
        cases.append((f"varlen {cu}", "varlen", cu, [b - a for a, b in zip(cu[:-1], cu[1:])], None))
    return cases


def make_softplus(seed, cu, lengths, change):
    """One case's inputs, from its own seed (so --grads sees the forward rows' inputs)."""
    torch.manual_seed(seed)
    T, N, H, bf = sum(lengths), len(lengths), SP_HEADS, torch.bfloat16
    d = dict(
        q=torch.randn(1, T, H, D, device=DEV).to(bf),
        k=torch.randn(1, T, H, D, device=DEV).to(bf),
        v=torch.randn(1, T, H, D, device=DEV).to(bf),
        g=torch.randn(1, T, H, D, device=DEV),
        beta=torch.randn(1, T, H, device=DEV).to(bf),
        h0=torch.randn(N, H, D, D, device=DEV).to(bf),
        cu=None if cu is None else torch.tensor(cu, dtype=torch.int64, device=DEV),
    )
    d["A_log"], d["dt_bias"] = softplus_params(H, DEV, "strong")
    kind, frac = change or (None, None)
    if kind == "spec":
        # Weak decay everywhere: lambda ~ -exp(-8) * exp(g - 8), alpha ~ 1 at every token.
        d["A_log"].fill_(-8.0)
        d["dt_bias"].fill_(-8.0)
    elif kind is not None:
        tokens = torch.randperm(T, device=DEV)[: round(frac * T)]
        if kind == "reset":
            # lambda <= -(1000 + dt_bias) there: its decay is 0 even in float64, a state reset.
            d["g"] = 10.0 * d["g"]
            d["g"][:, tokens] = 1000.0
        else:
            # softplus(-1000 + dt_bias) is 0 even in float64: a decay of exactly 1.
            d["g"][:, tokens] = -1000.0
    d["g"] = d["g"].to(bf)
    return d


def reference(x, cu):
    return kda_naive(*(x[n].double() for n in INPUTS[:-1]), lower_bound=None, initial_state=x["h0"].double(),
                         cu_seqlens=cu)


def fla_call(x, cu):
    from fla.ops.kda import chunk_kda

    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     state_v_first=True, A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=cu,
                     **fla_gate_args(None))


def ours_call(x, h0):
    return torch_kda.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], lower_bound=None,
                         initial_state=h0, output_final_state=True, cu_seqlens=x["cu"])


def have_fla():
    try:
        import fla  # noqa: F401
    except ImportError as exc:
        print(f"fla not importable ({exc}): torch_kda only")
        return False
    return True


def attempt(fn, label):
    """fn()'s result, or None where the library refused the case (it says so)."""
    try:
        return fn()
    except (RuntimeError, ValueError, NotImplementedError, AssertionError) as exc:
        if not skipped(exc, label):
            raise
        return None


def no_worse(ours, theirs):
    """ours <= theirs, where a non-finite error of fla's counts as the worst."""
    return math.isfinite(ours) and (not math.isfinite(theirs) or ours <= theirs)


def fmt(x):
    return f"{x:.2e}" if x is not None else "n/a"


def jsonable(x):
    """x with nan and inf as strings, which JSON has no numbers for."""
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def forward_row(name, group, d, with_fla):
    nan = float("nan")
    with torch.no_grad():
        r_out, r_final = reference(d, d["cu"])
        row = dict(case=name, group=group, T=d["q"].shape[1], N=d["h0"].shape[0], H=SP_HEADS,
                   cu_seqlens=None if d["cu"] is None else d["cu"].tolist())
        for state, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            got = attempt(functools.partial(ours_call, d, d["h0"].to(state)), f"torch_kda {tag} state")
            row[f"torch_kda_{tag}_out"] = rel(got[0], r_out) if got else nan
            row[f"torch_kda_{tag}_state"] = rel(got[1], r_final) if got else nan
        row["fla_out"] = row["fla_state"] = None
        if with_fla:
            x = dict(d, h0=d["h0"].float(), dt_bias=d["dt_bias"].flatten())
            got = attempt(lambda: fla_call(x, d["cu"]), "fla")
            row["fla_out"] = rel(got[0], r_out) if got else nan
            row["fla_state"] = rel(got[1], r_final) if got else nan
    ours = [row[f"torch_kda_{t}_{w}"] for t in ("bf16", "fp32") for w in ("out", "state")]
    meets = {"within_2e-2": all(math.isfinite(x) and x <= HARD_LIMIT for x in ours)}
    if group == "random":
        fp32_out = row["torch_kda_fp32_out"]
        meets["fp32_out_5e-3"] = math.isfinite(fp32_out) and fp32_out <= RANDOM_FP32_OUT
    if with_fla:
        meets["bf16_no_worse_than_fla"] = (no_worse(row["torch_kda_bf16_out"], row["fla_out"])
                                           and no_worse(row["torch_kda_bf16_state"], row["fla_state"]))
    row["meets"] = meets
    return row


def grad_row(name, d, with_fla):
    """rel of each input's gradient for torch_kda and fla (fp32 initial state, both)
    against float64 autograd through the reference, and their ratio."""
    torch.manual_seed(1)
    grads = [torch.randn_like(d["v"]), torch.randn(d["h0"].shape, device=DEV)]

    def run(step, dtype=None, flat_dt_bias=False):
        """The input gradients of one step; leaves in dtype, else as given (the
        initial state in fp32), so that the reference's are float64 throughout."""
        x = {n: d[n] for n in INPUTS}
        x["h0"] = x["h0"].float()
        if flat_dt_bias:
            x["dt_bias"] = x["dt_bias"].flatten()
        x = {n: t.detach().to(dtype or t.dtype, copy=True).requires_grad_() for n, t in x.items()}
        out, final = step(x)
        torch.autograd.backward([out, final], [grads[0].to(out.dtype), grads[1].to(final.dtype)])
        return {n: x[n].grad.reshape(d[n].shape) for n in INPUTS}

    ref = run(lambda x: reference(x, d["cu"]), dtype=torch.float64)
    ours = attempt(lambda: run(lambda x: ours_call(dict(x, cu=d["cu"]), x["h0"])), "torch_kda backward")
    theirs = None
    if with_fla:
        theirs = attempt(lambda: run(lambda x: fla_call(x, d["cu"]), flat_dt_bias=True), "fla backward")
    rows = []
    for n in INPUTS:
        o = grad_rel(ours[n], ref[n]) if ours else float("nan")
        f = grad_rel(theirs[n], ref[n]) if theirs else float("nan")
        rows.append(dict(case=name, input="initial_state" if n == "h0" else n, torch_kda=o, fla=f,
                         ratio=o / f if f > 0 else (1.0 if o == 0 else float("inf"))))
    return rows


def grad_rel(x, ref):
    """rel, except that a gradient of exact zeros (the initial state's, where a
    reset at the first token cuts it off) is met only by zeros: 0, else inf."""
    if torch.count_nonzero(ref).item() == 0:
        return 0.0 if torch.count_nonzero(x).item() == 0 else float("inf")
    return rel(x, ref)


def softplus_tables(args):
    with_fla = have_fla()
    cases = softplus_cases()
    print(f"softplus gate (lower_bound=None), H={SP_HEADS}, K=V={D}, bf16 inputs; rel = ||x - ref|| / ||ref|| "
          f"against float64 token by token")
    print("| case | T | N | torch_kda bf16-state out | state | torch_kda fp32-state out | state | "
          "chunk_kda out | state (fp32) | meets |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for seed, (name, group, cu, lengths, change) in enumerate(cases):
        d = make_softplus(seed, cu, lengths, change)
        row = forward_row(name, group, d, with_fla)
        rows.append(row)
        missed = [k for k, ok in row["meets"].items() if not ok]
        print(f"| {name} | {row['T']} | {row['N']} | {fmt(row['torch_kda_bf16_out'])} | "
              f"{fmt(row['torch_kda_bf16_state'])} | {fmt(row['torch_kda_fp32_out'])} | "
              f"{fmt(row['torch_kda_fp32_state'])} | {fmt(row['fla_out'])} | {fmt(row['fla_state'])} | "
              f"{'yes' if not missed else 'no: ' + ', '.join(missed)} |", flush=True)
        del d
        torch.cuda.empty_cache()
    failing = []
    for r in rows:
        missed = [k for k, ok in r["meets"].items() if not ok]
        if missed:
            failing.append(f"{r['case']} ({', '.join(missed)})")
    checks = "bf16-state out and state <= fla's, " if with_fla else ""
    verdict = (f"every case meets {checks}fp32-state out <= {RANDOM_FP32_OUT:g} on the random cases and "
               f"every torch_kda error <= {HARD_LIMIT:g}: " + ("YES" if not failing else "NO, " + "; ".join(failing)))
    if not with_fla:
        verdict += " (no comparison with fla: fla missing)"
    print(verdict)
    result = dict(gate="softplus", device=torch.cuda.get_device_name(), torch=torch.__version__, heads=SP_HEADS,
                  rows=rows, failing=failing, verdict=verdict)

    if args.grads:
        print()
        print("gradients, fp32 initial state, against float64 autograd: rel per input and torch_kda / fla")
        print("| case | input | torch_kda rel | chunk_kda rel | torch_kda / fla |")
        print("|---|---|---|---|---|")
        grad_rows = []
        for seed, (name, _group, cu, lengths, change) in enumerate(cases):
            if name not in GRAD_CASES:
                continue
            d = make_softplus(seed, cu, lengths, change)
            for r in grad_row(name, d, with_fla):
                grad_rows.append(r)
                print(f"| {name} | {r['input']} | {fmt(r['torch_kda'])} | {fmt(r['fla'])} | {r['ratio']:.2f} |",
                      flush=True)
            del d
            torch.cuda.empty_cache()
        ratios = [r for r in grad_rows if not math.isnan(r["ratio"])]
        if ratios:
            worst = max(ratios, key=lambda r: r["ratio"])
            print(f"max torch_kda / fla over {len(ratios)} gradients: {worst['ratio']:.2f} "
                  f"({worst['case']}, {worst['input']})")
        else:
            print("no ratio torch_kda / fla: one of them gave no gradients")
        result["grads"] = grad_rows
        result["max_grad_ratio"] = worst["ratio"] if ratios else None

    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "accuracy_softplus.json")
        with open(path, "w") as f:
            json.dump(jsonable(result), f, indent=1)
        print(f"rows written to {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gate", choices=("bounded", "softplus"), default="bounded",
                    help="bounded: the hard cases (lower_bound < 0); softplus: lower_bound=None, Kimi-Linear's gate")
    ap.add_argument("--grads", action="store_true",
                    help="with --gate softplus: the gradients of all eight inputs on five of the cases")
    args = ap.parse_args()
    if args.grads and args.gate != "softplus":
        ap.error("--grads needs --gate softplus")
    if args.gate == "bounded":
        bounded_table()
    else:
        print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
        softplus_tables(args)


if __name__ == "__main__":
    main()
