"""torch_kda.reference (the package's plain evaluations, used by the quickstart and the
benchmarks, and the hand-derived gradients of the chunked form, the blueprint for
chunked backward kernels) against the suite's own float64 token-by-token reference."""
import pytest
import torch

from conftest import make_inputs, positional, reference_kda, rel
from torch_kda.reference import kda_chunked, kda_chunked_backward, kda_recurrent


def _strong_decay(d):
    """exp(A_log) = e^4 with the softplus gate: G falls by ~50 per token, so exp(G_i - G_j)
    above the diagonal would overflow if anything formed it."""
    d["A_log"].fill_(4.0)
    return d


@pytest.mark.parametrize("lower_bound,strong", [(-5.0, False), (None, False), (None, True)])
@pytest.mark.parametrize("chunk_size", [16, 5])
def test_package_forward_references(lower_bound, strong, chunk_size):
    d = make_inputs(B=2, T=37, H=2, K=6, V=5, dtype=torch.float64, state_dtype=torch.float64)
    if strong:
        _strong_decay(d)
    ref_out, ref_final = reference_kda(*positional(d), lower_bound=lower_bound, initial_state=d["initial_state"])
    for fn, kw in ((kda_recurrent, {}), (kda_chunked, {"chunk_size": chunk_size})):
        out, final = fn(*positional(d), lower_bound=lower_bound, initial_state=d["initial_state"], **kw)
        assert rel(out, ref_out) <= 1e-12, fn.__name__
        assert rel(final, ref_final) <= 1e-12, fn.__name__


@pytest.mark.parametrize("lower_bound,strong", [(-5.0, False), (-0.1, False), (None, False), (None, True)])
@pytest.mark.parametrize("chunk_size", [16, 4])
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("with_final_grad", [True, False])
def test_chunked_backward_matches_autograd(lower_bound, strong, chunk_size, with_state, with_final_grad):
    d = make_inputs(B=2, T=37, H=2, K=6, V=5, dtype=torch.float64,
                    state_dtype=torch.float64 if with_state else None)
    if strong:
        _strong_decay(d)
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
    # Under strong decay dA_log sums terms far larger than itself: float64 cancellation.
    tol = 1e-8 if strong else 1e-10
    for name, g, e in zip(names, got, expected):
        assert rel(g, e) <= tol, name
    if not with_state:
        assert got[7] is None
