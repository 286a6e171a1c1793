"""Decode from a state pool: torch_kda.kda_pool against fla's fused_recurrent_kda_fwd, side by side.

    python3 benchmarks/bench_decode.py [--repeats 50] [--gate bounded|softplus|both] [--pool fp32|bf16|both]

Per case (N requests x H heads, K = V = 128; a pool of 2N slots, the requests
in a random permutation of half of them): one token per request, four, and four
with speculative decoding (state_indices [N, 4], num_accepted_tokens random in
[1, 4], the state written after every token). Both sides run in CUDA graphs,
so host time is left out. The floor: the state's bytes at the device-to-device
copy bandwidth measured in the same run, read once and written once (N * H * V
* K * 2 * bytes per element), or, speculative, read once and written after
each of the four tokens (five passes); x floor is the ratio to it.

fla is timed on one token and on speculative decoding only: given four tokens a
request and one slot each, its kernel writes the state after token t into slot
indices[n + t] (the next requests' slots), which is not the same work as
continuing each request from its slot and writing its final state back.
"""
import argparse
import os
import sys

os.environ.setdefault("FLA_FLASH_KDA", "0")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fwd import graphed, run_header, time_ms  # noqa: E402

import torch_kda  # noqa: E402

D = 128
CASES = [(n, h) for n in (64, 256, 1024) for h in (32, 96)]


def make_case(N, H, tokens, pool_dtype, gate, speculative):
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(N, tokens, H, D, device=dev, dtype=bf)
    k = torch.randn(N, tokens, H, D, device=dev, dtype=bf)
    v = torch.randn(N, tokens, H, D, device=dev, dtype=bf)
    g = torch.randn(N, tokens, H, D, device=dev, dtype=bf)
    beta = torch.randn(N, tokens, H, device=dev, dtype=bf)
    A_log = torch.rand(H, device=dev)
    dt_bias = torch.rand(H, D, device=dev)
    pool = torch.randn(max(2 * N, N * tokens), H, D, D, device=dev).to(pool_dtype)
    slots = torch.randperm(pool.shape[0], device=dev)
    indices = slots[: N * tokens].view(N, tokens) if speculative else slots[:N]
    accepted = torch.randint(1, tokens + 1, (N,), device=dev) if speculative else None
    out = torch.empty_like(v)
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, pool=pool, indices=indices,
                accepted=accepted, out=out, lower_bound=-5.0 if gate == "bounded" else None)


def ours(c):
    def fn():
        torch_kda.kda_pool(c["q"], c["k"], c["v"], c["g"], c["beta"], c["A_log"], c["dt_bias"], c["pool"],
                           c["indices"], lower_bound=c["lower_bound"], num_accepted_tokens=c["accepted"],
                           out=c["out"])
    return fn


def theirs(c):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    dt_flat = c["dt_bias"].reshape(-1)
    out = torch.empty_like(c["v"])

    def fn():
        fused_recurrent_kda_fwd(
            c["q"], c["k"], c["v"], c["g"], c["beta"], A_log=c["A_log"], dt_bias=dt_flat,
            initial_state=c["pool"], inplace_final_state=True, state_v_first=True,
            ssm_state_indices=c["indices"], num_accepted_tokens=c["accepted"], use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=c["lower_bound"], out=out)
    return fn


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--gate", choices=("bounded", "softplus", "both"), default="both")
    ap.add_argument("--pool", choices=("fp32", "bf16", "both"), default="fp32")
    ap.add_argument("--no-fla", action="store_true")
    args = ap.parse_args()
    gates = ("bounded", "softplus") if args.gate == "both" else (args.gate,)
    pools = {"fp32": (torch.float32,), "bf16": (torch.bfloat16,), "both": (torch.float32, torch.bfloat16)}[args.pool]
    bw, have_fla = run_header(args.no_fla)
    print(f"{'gate':<9} {'pool':<5} {'tok':>5} {'N':>5} {'H':>3} {'torch_kda ms':>12} {'fla ms':>8} "
          f"{'speedup':>8} {'floor ms':>9} {'x floor':>8}")
    for gate in gates:
        for pool_dtype in pools:
            for tokens, speculative in ((1, False), (4, False), (4, True)):
                for N, H in CASES:
                    c = make_case(N, H, tokens, pool_dtype, gate, speculative)
                    ms = time_ms(graphed(ours(c), "torch_kda")[0], args.repeats)
                    fla_ms = float("nan")
                    if have_fla and (tokens == 1 or speculative):
                        fla_ms = time_ms(graphed(theirs(c), "fla")[0], args.repeats)
                    passes = 1 + tokens if speculative else 2
                    floor = N * H * D * D * passes * c["pool"].element_size() / bw * 1e3
                    name = "fp32" if pool_dtype == torch.float32 else "bf16"
                    tok = f"{tokens}{'s' if speculative else ''}"
                    print(f"{gate:<9} {name:<5} {tok:>5} {N:>5} {H:>3} {ms:>12.4f} {fla_ms:>8.4f} "
                          f"{fla_ms / ms:>8.2f} {floor:>9.4f} {ms / floor:>8.2f}")
                    del c
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
