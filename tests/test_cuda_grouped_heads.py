"""Grouped value heads on the CUDA kernels: q and k [B, T, H, 128], v, g, beta,
A_log, dt_bias and the states with HV = G H heads, value head j reading query/key
head j // G. Against the float64 reference (forward) and the float64 CPU kernels
(gradients, the pool), fixed length and varlen with an empty and odd sequences,
both gates and a precomputed gate, G in {2, 4}.
"""
import pytest
import torch

import torch_kda
from conftest import positional, rel, run_reference
from cuda_helpers import CUDA_MARKS, DEV, GRAD_NAMES, GRAD_TOL, cuda_inputs, to_cpu64

pytestmark = CUDA_MARKS

BF16, F32 = torch.bfloat16, torch.float32
GATES = pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
SHAPES = pytest.mark.parametrize("shape", [dict(B=2, T=50, H=2, HV=4), dict(seqlens=[17, 0, 40, 1], H=1, HV=4)],
                                 ids=["fixed_G2", "varlen_G4"])


def run(g, lower_bound):
    return torch_kda.kda(*positional(g), lower_bound=lower_bound, initial_state=g["initial_state"],
                         output_final_state=True, cu_seqlens=g["cu_seqlens"])


@GATES
@SHAPES
@pytest.mark.parametrize("state_dtype", [F32, BF16], ids=["fp32_state", "bf16_state"])
def test_forward_matches_the_reference(shape, lower_bound, state_dtype):
    _, g = cuda_inputs(state_dtype=state_dtype, **shape)
    out, final = run(g, lower_bound)
    ref_out, ref_final = run_reference(g, lower_bound=lower_bound)
    assert out.shape == g["v"].shape and final.shape == g["initial_state"].shape
    e_out, e_final = rel(out, ref_out), rel(final, ref_final)
    print(f"\nout {e_out:.2e}, final {e_final:.2e}", end="")
    assert e_out <= (5e-3 if state_dtype == F32 else 1e-2)
    assert e_final <= (1e-4 if state_dtype == F32 else 1e-2)


@GATES
@SHAPES
def test_backward_matches_the_cpu_kernels(shape, lower_bound):
    """kda.bwd, and the autograd step (the forward's kept states): dq and dk sum their group's parts."""
    _, g = cuda_inputs(state_dtype=F32, **shape)
    grad_out = torch.randn(g["v"].shape, device=DEV).to(BF16)
    grad_final = torch.randn(g["initial_state"].shape, device=DEV)
    g64 = to_cpu64(g)
    want = torch.ops.kda.bwd(grad_out.cpu().double(), grad_final.cpu().double(), *positional(g64),
                             lower_bound=lower_bound, initial_state=g64["initial_state"], cu_seqlens=g64["cu_seqlens"])
    got = torch.ops.kda.bwd(grad_out, grad_final, *positional(g), lower_bound=lower_bound,
                            initial_state=g["initial_state"], cu_seqlens=g["cu_seqlens"])
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    leaves = {n: g[n].detach().clone().requires_grad_(True) for n in names}
    out, final = run({**g, **leaves}, lower_bound)
    torch.autograd.backward([out, final], [grad_out, grad_final])
    for label, result in (("bwd", got), ("autograd", [leaves[n].grad for n in names])):
        for name, x, w in zip(GRAD_NAMES, result, want):
            assert x.shape == w.shape, (label, name)
            e = rel(x.cpu(), w)
            print(f" {label} {name} {e:.1e}", end="")
            assert e <= GRAD_TOL[name], f"{label} {name}: rel {e:.2e}"


def test_precomputed_gate_and_pool():
    """A precomputed fp32 gate, G = 2: the forward; then one decode token a request from a pool."""
    _, g = cuda_inputs(state_dtype=F32, B=2, T=40, H=2, HV=4)
    g = {**g, "g": -5.0 * torch.sigmoid(g["g"].float()), "A_log": None, "dt_bias": None}
    out, final = run(g, -5.0)
    ref_out, ref_final = run_reference(g, lower_bound=-5.0)
    assert rel(out, ref_out) <= 5e-3 and rel(final, ref_final) <= 1e-4
    _, d = cuda_inputs(B=5, T=1, H=2, HV=4)
    pool = torch.randn(12, 4, 128, 128, device=DEV)
    idx = torch.randperm(12, device=DEV)[:5]
    cpu_pool = pool.cpu().double()
    got = torch_kda.kda_pool(*positional(d), pool, idx, lower_bound=None)
    d64 = to_cpu64(d)
    want = torch_kda.kda_pool(*positional(d64), cpu_pool, idx.cpu(), lower_bound=None)
    assert rel(got.cpu(), want) <= 5e-3 and rel(pool.cpu(), cpu_pool) <= 1e-5
