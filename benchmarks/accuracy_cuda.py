"""Accuracy of torch_kda's CUDA forward and of fla's chunk_kda on the same
inputs, against a float64 token-by-token evaluation (torch_kda.reference, run
on the GPU in float64). Cases: the random case and the hard cases of SPEC
section 4. Prints a markdown table of rel = ||x - ref|| / ||ref||.

    FLA_FLASH_KDA=0 python benchmarks/accuracy_cuda.py
"""
import os

os.environ.setdefault("FLA_FLASH_KDA", "0")

import torch  # noqa: E402

import torch_kda  # noqa: E402
from torch_kda.reference import kda_recurrent  # noqa: E402

D = 128


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


def main():
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
            r_out, r_final = kda_recurrent(*(d[n].double() for n in ("q", "k", "v", "g", "beta", "A_log",
                                                                      "dt_bias")),
                                           lower_bound=lb, initial_state=d["h0"].double())
            try:
                f_out, f_final = fla_run(d, lb)
                fla_cols = f"{rel(f_out, r_out):.2e} | {rel(f_final, r_final):.2e}"
            except ImportError:
                fla_cols = "n/a | n/a"
            print(f"| {name} | {str(state_dtype).replace('torch.', '')} | {rel(out, r_out):.2e} | "
                  f"{rel(final, r_final):.2e} | {fla_cols} |", flush=True)


if __name__ == "__main__":
    main()
