"""torch_kda.reference.kda_chunked_backward, the hand-derived gradients of the chunked
form (the blueprint for chunked backward kernels), against autograd through the
suite's own float64 token-by-token reference."""
import pytest
import torch

from conftest import make_inputs, positional, reference_kda, rel
from torch_kda.reference import kda_chunked_backward


@pytest.mark.parametrize("lower_bound", [-5.0, -0.1, None])
@pytest.mark.parametrize("chunk_size", [16, 4])
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("with_final_grad", [True, False])
def test_matches_autograd(lower_bound, chunk_size, with_state, with_final_grad):
    d = make_inputs(B=2, T=37, H=2, K=6, V=5, dtype=torch.float64,
                    state_dtype=torch.float64 if with_state else None)
    leaves = [t.clone().requires_grad_() for t in positional(d)]
    init = d["initial_state"].clone().requires_grad_() if with_state else None
    out, final = reference_kda(*leaves, lower_bound=lower_bound, initial_state=init)
    grad_out = torch.randn_like(out)
    grad_final = torch.randn_like(final) if with_final_grad else None
    outputs, grads = (out, final), (grad_out, grad_final if with_final_grad else torch.zeros_like(final))
    expected = torch.autograd.grad(outputs, leaves + ([init] if with_state else []), grads)

    got = kda_chunked_backward(*positional(d), grad_out, grad_final, lower_bound=lower_bound,
                               initial_state=d["initial_state"], chunk_size=chunk_size)
    names = ["dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state"]
    for name, g, e in zip(names, got, expected):
        assert rel(g, e) <= 1e-10, name
    if not with_state:
        assert got[7] is None
