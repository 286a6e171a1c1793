"""torch.compile (fullgraph, dynamic shapes) and torch.export of a module that
calls torch_kda.kda, against eager."""
import pytest
import torch
import torch._dynamo

import torch_kda
from conftest import make_inputs, rel, run_reference

H, K, V = 2, 8, 4


class KDALayer(torch.nn.Module):
    """Owns the per-head gate parameters and a learned initial state.

    The gate is picked by a string so that lower_bound reaches kda() as a constant;
    FloatHyperparameterLayer below holds it (and scale) as float attributes instead.
    """

    def __init__(self, gate):
        super().__init__()
        self.gate = gate
        self.A_log = torch.nn.Parameter(torch.rand(H))
        self.dt_bias = torch.nn.Parameter(torch.rand(H, K))
        self.initial_state = torch.nn.Parameter(torch.randn(1, H, V, K))

    @property
    def lower_bound(self):
        return -5.0 if self.gate == "bounded" else None

    def forward(self, q, k, v, g, beta):
        B = q.shape[0]
        out, final_state = torch_kda.kda(
            q,
            k,
            v,
            g,
            beta,
            self.A_log,
            self.dt_bias,
            lower_bound=self.lower_bound,
            initial_state=self.initial_state.expand(B, -1, -1, -1),
            output_final_state=True,
        )
        return out * 2.0, final_state.sum(0)


class FloatHyperparameterLayer(KDALayer):
    """lower_bound and scale as plain float attributes, as a model config would hold them."""

    def __init__(self, lower_bound, scale):
        super().__init__("bounded")
        self.lb = lower_bound
        self.scale = scale

    def forward(self, q, k, v, g, beta):
        out, final_state = torch_kda.kda(
            q,
            k,
            v,
            g,
            beta,
            self.A_log,
            self.dt_bias,
            scale=self.scale,
            lower_bound=self.lb,
            initial_state=self.initial_state.expand(q.shape[0], -1, -1, -1),
            output_final_state=True,
        )
        return out, final_state


def _activations(B, T, requires_grad=False):
    d = make_inputs(B=B, T=T, H=H, K=K, V=V)
    xs = [d[n] for n in ("q", "k", "v", "g", "beta")]
    if requires_grad:
        for x in xs:
            x.requires_grad_(True)
    return xs


def _forward_backward(model, xs, weights):
    out, final = model(*xs)
    loss = (out * weights[0]).sum() + (final * weights[1]).sum()
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, list(xs) + params)
    return out, final, grads


def _check_layer_against_reference(model, xs, out, final):
    B = xs[0].shape[0]
    ref_out, ref_final = run_reference(
        dict(
            q=xs[0], k=xs[1], v=xs[2], g=xs[3], beta=xs[4], A_log=model.A_log, dt_bias=model.dt_bias,
            initial_state=model.initial_state.expand(B, -1, -1, -1), cu_seqlens=None,
        ),
        lower_bound=model.lower_bound,
    )
    assert rel(out, 2.0 * ref_out) <= 1e-5
    assert rel(final, ref_final.sum(0)) <= 1e-5


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_compile_fullgraph_dynamic_matches_eager(gate):
    torch._dynamo.reset()
    model = KDALayer(gate)
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    first = True
    for B, T in [(3, 19), (5, 33)]:  # new sizes, none 0, 1 or equal to H, K, V: no recompile
        xs = _activations(B, T, requires_grad=True)
        weights = (torch.randn(B, T, H, V), torch.randn(H, V, K))
        with torch._dynamo.config.patch(error_on_recompile=not first):
            c_out, c_final, c_grads = _forward_backward(compiled, xs, weights)
        first = False
        e_out, e_final, e_grads = _forward_backward(model, xs, weights)
        torch.testing.assert_close(c_out, e_out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(c_final, e_final, rtol=1e-6, atol=1e-6)
        for c, e in zip(c_grads, e_grads):
            torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)
        _check_layer_against_reference(model, xs, c_out, c_final)


def test_compile_inductor_matches_eager():
    torch._dynamo.reset()
    model = KDALayer("softplus")
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for i, (B, T) in enumerate([(3, 17), (5, 40)]):
        xs = _activations(B, T, requires_grad=True)
        weights = (torch.randn(B, T, H, V), torch.randn(H, V, K))
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            c_out, c_final, c_grads = _forward_backward(compiled, xs, weights)
        e_out, e_final, e_grads = _forward_backward(model, xs, weights)
        torch.testing.assert_close(c_out, e_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c_final, e_final, rtol=1e-5, atol=1e-5)
        for c, e in zip(c_grads, e_grads):
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)


def test_export_matches_eager():
    model = KDALayer("bounded")
    xs = _activations(2, 21)
    T = torch.export.Dim("T", min=2, max=4096)
    dynamic_shapes = tuple({1: T} if x.dim() >= 2 else None for x in xs)
    ep = torch.export.export(model, tuple(xs), dynamic_shapes=dynamic_shapes)
    targets = {node.target for node in ep.graph.nodes if node.op == "call_function"}
    assert torch.ops.kda.fwd.default in targets
    module = ep.module()
    for T_run in (21, 34):
        xs_run = _activations(2, T_run)
        with torch.no_grad():
            e_out, e_final = model(*xs_run)
        x_out, x_final = module(*xs_run)
        torch.testing.assert_close(x_out, e_out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x_final, e_final, rtol=1e-6, atol=1e-6)
        _check_layer_against_reference(model, xs_run, x_out, x_final)


def test_compile_float_hyperparameters_dynamic():
    # lower_bound and scale held as float attributes: under dynamic=True Dynamo may
    # trace them as symbolic floats, and the wrapper must not graph-break on them.
    torch._dynamo.reset()
    model = FloatHyperparameterLayer(-2.0, 0.4)
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    xs = _activations(1, 13)
    c_out, c_final = compiled(*xs)
    e_out, e_final = model(*xs)
    torch.testing.assert_close(c_out, e_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(c_final, e_final, rtol=1e-6, atol=1e-6)
