"""Gradient accuracy of one training step on the GPU: the relative L2 error of each
of the eight inputs' gradients against float64 autograd through the token-by-token
reference (torch_kda.naive) on the same bf16-rounded inputs, T = 1024, H = 2, both
gates, fp32 and bf16 initial states, three cases: random, weak decay (bounded:
A_log = 2, dt_bias = -8; softplus: A_log = dt_bias = -8) and weak decay with the
beta logits shifted by -6 (tiny beta).

    python benchmarks/accuracy_grads.py [--cache DIR]

The reference's gradients take most of the time; with --cache they are kept in
DIR (keyed by case and seed) so that a second build compares against the same
ones without recomputing them.
"""
import argparse
import os
import sys

import torch

import torch_kda
from torch_kda.naive import kda_naive

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accuracy_cuda import D, INPUTS, rel  # noqa: E402

T, H = 1024, 2
GATES = {"bounded": -5.0, "softplus": None}
CASES = ("random", "weak decay", "weak decay, tiny beta")


def make(gate, case, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16

    def r(*s):
        return torch.randn(*s, device="cuda", generator=gen)

    d = dict(q=r(1, T, H, D).to(bf), k=r(1, T, H, D).to(bf), v=r(1, T, H, D).to(bf), g=r(1, T, H, D).to(bf),
             beta=r(1, T, H).to(bf), A_log=torch.rand(H, device="cuda", generator=gen),
             dt_bias=torch.rand(H, D, device="cuda", generator=gen), h0=r(1, H, D, D))
    if case != "random":
        d["A_log"].fill_(2.0 if gate == "bounded" else -8.0)
        d["dt_bias"].fill_(-8.0)
    if case.endswith("tiny beta"):
        d["beta"] = (d["beta"].float() - 6.0).to(bf)
    # dout in bf16 (out's dtype) on both sides, so that its rounding is no error
    grads = (r(1, T, H, D).to(bf), r(1, H, D, D))
    return d, grads


def step(d, grads, lower_bound, state_dtype, reference):
    x = {n: t.detach().clone() for n, t in d.items()}
    if reference:
        x = {n: t.double() for n, t in x.items()}
    else:
        x["h0"] = x["h0"].to(state_dtype)
    for t in x.values():
        t.requires_grad_()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"])
    if reference:
        out, final = kda_naive(*args, lower_bound=lower_bound, initial_state=x["h0"])
    else:
        out, final = torch_kda.kda(*args, lower_bound=lower_bound, initial_state=x["h0"], output_final_state=True)
    torch.autograd.backward([out, final], [grads[0].to(out.dtype), grads[1].to(final.dtype)])
    # a bf16 initial state's gradient is rounded to bf16: its row says what a bf16 state costs
    return {n: x[n].grad.double() for n in INPUTS}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default=None, help="a folder for the reference's gradients")
    args = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("| gate | case | initial state | " + " | ".join(INPUTS) + " |")
    print("|---|---|---|" + "---|" * len(INPUTS))
    for gate, lower_bound in GATES.items():
        for seed, case in enumerate(CASES):
            d, grads = make(gate, case, seed)
            path = args.cache and os.path.join(args.cache, f"{gate}-{seed}-T{T}-H{H}-D{D}.pt")
            if path and os.path.exists(path):
                ref = torch.load(path)
            else:
                ref = step(d, grads, lower_bound, None, reference=True)
                if path:
                    os.makedirs(args.cache, exist_ok=True)
                    torch.save(ref, path)
            for state_dtype in (torch.float32, torch.bfloat16):
                ours = step(d, grads, lower_bound, state_dtype, reference=False)
                cells = " | ".join(f"{rel(ours[n], ref[n]):.2e}" for n in INPUTS)
                print(f"| {gate} | {case} | {str(state_dtype).replace('torch.', '')} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
