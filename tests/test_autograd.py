"""Gradients of torch_kda.kda: gradcheck in float64 on small CPU cases, agreement
with the reference's autograd, and no mixing between packed sequences."""
import pytest
import torch

import torch_kda
from conftest import INPUT_NAMES, make_inputs, positional, rel, run_reference

F64 = torch.float64
GRAD_NAMES = INPUT_NAMES + ("initial_state",)


def _case(varlen, with_state):
    state_dtype = F64 if with_state else None
    if varlen:
        return make_inputs(H=2, K=4, V=3, dtype=F64, seqlens=[3, 0, 5, 1], state_dtype=state_dtype, requires_grad=True)
    return make_inputs(B=2, T=7, H=2, K=4, V=3, dtype=F64, state_dtype=state_dtype, requires_grad=True)


def _grad_inputs(d):
    names = [n for n in GRAD_NAMES if d[n] is not None]
    return names, tuple(d[n] for n in names)


def _fn(d, names, loss_on, **kwargs):
    """A function of the differentiable inputs (in `names` order) for gradcheck."""

    def f(*tensors):
        args = dict(d)
        args.update(zip(names, tensors))
        out, final = torch_kda.kda(
            *positional(args),
            initial_state=args["initial_state"],
            cu_seqlens=args["cu_seqlens"],
            output_final_state=loss_on != "out",
            **kwargs,
        )
        if loss_on == "out":
            assert final is None
            return out
        if loss_on == "final_state":
            return final
        return out, final

    return f


@pytest.mark.parametrize("lower_bound", [-2.0, None], ids=["bounded", "softplus"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("loss_on", ["out", "out_and_final_state", "final_state"])
def test_gradcheck(lower_bound, with_state, varlen, loss_on):
    d = _case(varlen, with_state)
    names, tensors = _grad_inputs(d)
    assert len(names) == (8 if with_state else 7)
    assert torch.autograd.gradcheck(_fn(d, names, loss_on, lower_bound=lower_bound), tensors)


def test_gradcheck_given_scale():
    d = _case(varlen=False, with_state=True)
    names, tensors = _grad_inputs(d)
    scale = 0.5 + torch.rand(()).item()
    assert torch.autograd.gradcheck(_fn(d, names, "out_and_final_state", lower_bound=-0.5, scale=scale), tensors)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_gradients_match_reference(lower_bound, varlen):
    # Longer than gradcheck can afford, against the reference's autograd.
    if varlen:
        d = make_inputs(H=2, K=8, V=6, dtype=F64, seqlens=[20, 0, 37, 1], state_dtype=F64, requires_grad=True)
    else:
        d = make_inputs(B=2, T=40, H=2, K=8, V=6, dtype=F64, state_dtype=F64, requires_grad=True)
    names, tensors = _grad_inputs(d)
    out, final = torch_kda.kda(
        *positional(d),
        initial_state=d["initial_state"],
        cu_seqlens=d["cu_seqlens"],
        output_final_state=True,
        lower_bound=lower_bound,
    )
    ref_out, ref_final = run_reference(d, lower_bound=lower_bound)
    w_out, w_final = torch.randn_like(out), torch.randn_like(final)
    grads = torch.autograd.grad((out * w_out).sum() + (final * w_final).sum(), tensors)
    ref_grads = torch.autograd.grad((ref_out * w_out).sum() + (ref_final * w_final).sum(), tensors)
    for name, g, r in zip(names, grads, ref_grads):
        assert g.dtype == d[name].dtype and g.shape == d[name].shape, name
        assert rel(g, r) <= 1e-10, name


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_low_precision_gradients(state_dtype):
    # Gradients come back in each input's own dtype and stay close to float64 ones.
    d = make_inputs(B=1, T=30, H=2, K=16, V=16, dtype=torch.float32, state_dtype=state_dtype, requires_grad=True)
    names, tensors = _grad_inputs(d)
    out, final = torch_kda.kda(*positional(d), initial_state=d["initial_state"], output_final_state=True)
    ref_out, ref_final = run_reference(d)
    w_out, w_final = torch.randn_like(out), torch.randn_like(final)
    grads = torch.autograd.grad((out * w_out).sum() + (final * w_final).sum(), tensors)
    ref_grads = torch.autograd.grad(
        (ref_out * w_out.double()).sum() + (ref_final * w_final.double()).sum(), tensors
    )
    for name, g, r in zip(names, grads, ref_grads):
        assert g.dtype == d[name].dtype, name
        tol = 1e-2 if (name == "initial_state" and state_dtype == torch.bfloat16) else 1e-4
        assert rel(g, r) <= tol, name


@pytest.mark.parametrize("lower_bound", [-1.0, None], ids=["bounded", "softplus"])
def test_varlen_gradients_do_not_mix(lower_bound):
    seqlens = [6, 0, 5, 4]
    d = make_inputs(H=2, K=4, V=3, dtype=F64, seqlens=seqlens, state_dtype=F64, requires_grad=True)
    out, final = torch_kda.kda(
        *positional(d),
        initial_state=d["initial_state"],
        cu_seqlens=d["cu_seqlens"],
        output_final_state=True,
        lower_bound=lower_bound,
    )
    offsets = d["cu_seqlens"].tolist()
    token_inputs = ("q", "k", "v", "g", "beta")
    for n in range(len(seqlens)):
        s, e = offsets[n], offsets[n + 1]
        loss = (out[:, s:e] * torch.randn_like(out[:, s:e])).sum() + (final[n] * torch.randn_like(final[n])).sum()
        grads = dict(zip(token_inputs + ("initial_state",), torch.autograd.grad(
            loss, [d[name] for name in token_inputs] + [d["initial_state"]], retain_graph=True
        )))
        for name in token_inputs:
            g = grads[name]
            assert torch.count_nonzero(g[:, :s]) == 0, (n, name)
            assert torch.count_nonzero(g[:, e:]) == 0, (n, name)
            if e > s:
                assert torch.count_nonzero(g[:, s:e]) > 0, (n, name)
        gs = grads["initial_state"]
        others = [m for m in range(len(seqlens)) if m != n]
        assert torch.count_nonzero(gs[others]) == 0, n
        assert torch.count_nonzero(gs[n]) > 0, n


def test_empty_sequence_state_gradient_is_identity():
    d = make_inputs(H=2, K=4, V=3, dtype=F64, seqlens=[3, 0, 2], state_dtype=F64, requires_grad=True)
    _, final = torch_kda.kda(
        *positional(d), initial_state=d["initial_state"], cu_seqlens=d["cu_seqlens"], output_final_state=True
    )
    w = torch.randn_like(final[1])
    (g,) = torch.autograd.grad((final[1] * w).sum(), d["initial_state"])
    assert torch.equal(g[1], w)


def test_fixed_batch_gradients_do_not_mix():
    d = make_inputs(B=3, T=6, H=2, K=4, V=3, dtype=F64, state_dtype=F64, requires_grad=True)
    out, final = torch_kda.kda(*positional(d), initial_state=d["initial_state"], output_final_state=True)
    loss = (out[1] * torch.randn_like(out[1])).sum() + (final[1] * torch.randn_like(final[1])).sum()
    names = ("q", "k", "v", "g", "beta", "initial_state")
    grads = torch.autograd.grad(loss, [d[n] for n in names])
    for name, g in zip(names, grads):
        assert torch.count_nonzero(g[[0, 2]]) == 0, name
        assert torch.count_nonzero(g[1]) > 0, name


def test_expanded_and_strided_incoming_gradients():
    # out.sum() hands the backward an expanded (stride 0) grad_out; a transposed
    # weight gives a strided one. Both must be read correctly.
    d = make_inputs(B=2, T=9, H=2, K=4, V=3, dtype=F64, state_dtype=F64, requires_grad=True)
    names, tensors = _grad_inputs(d)
    out, final = torch_kda.kda(*positional(d), initial_state=d["initial_state"], output_final_state=True)
    ref_out, ref_final = run_reference(d)
    w_final = torch.randn(2, 2, 4, 3, dtype=F64).transpose(-1, -2)  # [N, H, V, K], not contiguous
    grads = torch.autograd.grad(out.sum() + (final * w_final).sum(), tensors)
    ref_grads = torch.autograd.grad(ref_out.sum() + (ref_final * w_final).sum(), tensors)
    for name, g, r in zip(names, grads, ref_grads):
        assert rel(g, r) <= 1e-10, name


def test_double_backward_raises():
    """A second-order gradient is not supported: it must raise, not return wrong numbers."""
    d = make_inputs(B=1, T=6, H=2, K=4, V=3, dtype=torch.float64, requires_grad=True)
    out, _ = torch_kda.kda(*positional(d), lower_bound=-2.0)
    (gq,) = torch.autograd.grad((out**2).sum(), d["q"], create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(gq.sum(), (d["k"], d["v"]), allow_unused=True)
