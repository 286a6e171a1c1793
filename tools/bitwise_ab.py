"""Fingerprints of the CUDA ops' results, to compare two builds bit for bit.

    python3 tools/bitwise_ab.py save FILE     # with one build importable (PYTHONPATH)
    python3 tools/bitwise_ab.py compare A B   # every result's bits equal?

The cases reach every automatic choice of the CUDA path without forcing any (so
that builds with different testing hooks run the same choices): K2's 4x1w (with
the early and the late copy point), 2x2 and 4x4, the dS recurrence's 4x1, 4x2 and
2x2, the forward's windows and the backward's, both gates, bf16 and fp32 states,
fixed length and varlen with an empty sequence. Per case: out and the final state
of torch_kda.kda without gradients and with them, and all eight gradients; a SHA-256 of each tensor's
bytes. Inputs come from a fixed seed on the GPU, the same on one machine for both
builds.
"""
import hashlib
import json
import sys

import torch

import torch_kda

D = 128
# name: (sequence lengths, heads, state dtype, gate)
CASES = {
    "4x1w bf16 bounded": ([1000], 96, torch.bfloat16, "bounded"),
    "4x1w fp32 softplus": ([1000], 96, torch.float32, "softplus"),
    "4x1w late copies varlen": ([300, 0, 517, 64, 1, 700, 33, 250], 32, torch.float32, "bounded"),
    "2x2 fp32 bounded": ([777], 32, torch.float32, "bounded"),
    "2x2 bf16 softplus varlen": ([200, 0, 333], 8, torch.bfloat16, "softplus"),
    "4x4 fp32 bounded": ([1025], 16, torch.float32, "bounded"),
    "4x4 fp32 softplus": ([513], 8, torch.float32, "softplus"),
    "forward windows": ([65536], 16, torch.bfloat16, "bounded"),
    "backward windows": ([8192], 16, torch.float32, "bounded"),
}


def inputs(lengths, H, state_dtype, gate, gen):
    T, N = sum(lengths), len(lengths)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    x = dict(q=randn(1, T, H, D), k=randn(1, T, H, D), v=randn(1, T, H, D), g=randn(1, T, H, D),
             beta=randn(1, T, H), A_log=torch.rand(H, generator=gen, device="cuda"),
             dt_bias=torch.rand(H, D, generator=gen, device="cuda"), initial_state=randn(N, H, D, D, dtype=state_dtype))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0) if N > 1 else None
    lower_bound = -5.0 if gate == "bounded" else None
    return x, cu, lower_bound


def fingerprint(t):
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()[:16]


def run_case(lengths, H, state_dtype, gate):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, cu, lower_bound = inputs(lengths, H, state_dtype, gate, gen)
    # The forward alone (kda::fwd: windows where its workspace grows large), then
    # with gradients (kda::_fwd_checkpointed, one pass, and kda::bwd).
    with torch.no_grad():
        fwd_out, fwd_final = torch_kda.kda(*(x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")),
                                           lower_bound=lower_bound, initial_state=x["initial_state"],
                                           output_final_state=True, cu_seqlens=cu)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    out, final = torch_kda.kda(*(leaves[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")),
                               lower_bound=lower_bound, initial_state=leaves["initial_state"],
                               output_final_state=True, cu_seqlens=cu)
    grad_out = torch.randn(out.shape, generator=gen, device="cuda").to(out.dtype)
    grad_final = torch.randn(final.shape, generator=gen, device="cuda").to(final.dtype)
    torch.autograd.backward([out, final], [grad_out, grad_final])
    result = {"fwd out": fingerprint(fwd_out), "fwd final_state": fingerprint(fwd_final),
              "out": fingerprint(out), "final_state": fingerprint(final)}
    result.update({f"d{n}": fingerprint(t.grad) for n, t in leaves.items()})
    return result


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "save":
        results = {name: run_case(*case) for name, case in CASES.items()}
        with open(sys.argv[2], "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, results=results), f, indent=1)
        print(f"wrote {sys.argv[2]}: {len(results)} cases")
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        a, b = (json.load(open(p))["results"] for p in sys.argv[2:])
        differ = [(c, k) for c in a for k in a[c] if b.get(c, {}).get(k) != a[c][k]]
        for c, k in differ:
            print(f"differs: {c}: {k}")
        total = sum(len(v) for v in a.values())
        print(f"{total - len(differ)} of {total} results bitwise equal")
        sys.exit(1 if differ else 0)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
