"""The composition promises on CUDA: graph capture and replay, torch.compile,
and torch.library.opcheck of the forward, the in-place forward and the backward.
Skipped where CUDA is absent; tools/gpu_check.sh runs them on an H200.
"""

import pytest
import torch

import torch_kda
from torch_kda.testing import forced
from conftest import capture_graph, positional, rel
from cuda_helpers import CUDA_MARKS, D, DEV, GRAD_NAMES, RECORD_FLOATS, cuda_inputs, run_cuda

pytestmark = CUDA_MARKS


@pytest.mark.parametrize("window", [0, 3])
def test_cuda_graph_capture_and_replay(window):
    """window 3: the call runs in windows of 3 chunk slots, so the graph holds
    several launches of each kernel and the carry between them."""
    with forced(window_slots=window):
        d, g = cuda_inputs(seqlens=[40, 0, 100, 17], H=2, state_dtype=torch.float32)
        out = torch.empty(1, 157, 2, D, dtype=torch.bfloat16, device=DEV)
        final = torch.empty(4, 2, D, D, dtype=torch.float32, device=DEV)

        def step():
            torch_kda.fwd(g["q"], g["k"], g["v"], g["g"], g["beta"], None, out, g["A_log"], g["dt_bias"], -5.0,
                          initial_state=g["initial_state"], final_state=final, cu_seqlens=g["cu_seqlens"])

        graph, _ = capture_graph(step)

        for lengths in ([40, 0, 100, 17], [1, 60, 60, 36]):
            d2, g2 = cuda_inputs(seqlens=lengths, H=2, state_dtype=torch.float32)
            for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens"):
                g[name].copy_(g2[name])
            out.fill_(float("nan"))
            final.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            eager_out, eager_final = run_cuda(g2)
            assert torch.equal(out, eager_out)
            assert torch.equal(final, eager_final)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_compile_reduce_overhead(lower_bound):
    d, g = cuda_inputs(B=2, T=64, H=2, state_dtype=torch.float32)

    class Model(torch.nn.Module):
        def forward(self, q, k, v, gg, beta, A_log, dt_bias, h0):
            o, s = torch_kda.kda(q, k, v, gg, beta, A_log, dt_bias, lower_bound=lower_bound, initial_state=h0,
                                 output_final_state=True)
            return o.float() * 2, s

    model = Model()
    args = (*positional(g), g["initial_state"])
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        c_out, c_state = compiled(*args)
    e_out, e_state = model(*args)
    assert torch.equal(c_out, e_out) and torch.equal(c_state, e_state)


def test_opcheck_cuda():
    samples = []
    for seqlens, state in (([10, 0, 33], torch.float32), (None, torch.bfloat16), (None, None)):
        kw = {"seqlens": seqlens} if seqlens else {"B": 2, "T": 21}
        _, g = cuda_inputs(H=2, state_dtype=state, **kw)
        samples.append(g)
    for g in samples:
        torch.library.opcheck(
            torch.ops.kda.fwd.default, positional(g),
            {"lower_bound": -5.0, "initial_state": g["initial_state"], "output_final_state": True,
             "cu_seqlens": g["cu_seqlens"]},
        )
        N = g["initial_state"].shape[0] if g["initial_state"] is not None else (
            g["cu_seqlens"].numel() - 1 if g["cu_seqlens"] is not None else g["q"].shape[0])
        out = torch.empty(*g["q"].shape[:3], D, dtype=torch.bfloat16, device=DEV)
        final = torch.empty(N, 2, D, D, dtype=torch.float32, device=DEV)
        if g["initial_state"] is not None:
            final = final.to(g["initial_state"].dtype)
        torch.library.opcheck(
            torch.ops.kda.fwd_.default, (*positional(g), out, final),
            {"lower_bound": -5.0, "initial_state": g["initial_state"], "cu_seqlens": g["cu_seqlens"]},
        )


def test_opcheck_cuda_bwd():
    for seqlens, state in (([10, 0, 33], torch.float32), (None, None)):
        kw = {"seqlens": seqlens} if seqlens else {"B": 2, "T": 21}
        _, g = cuda_inputs(H=2, state_dtype=state, **kw)
        grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
        gf = torch.randn(*g["initial_state"].shape, device=DEV) if state is not None else None
        torch.library.opcheck(
            torch.ops.kda.bwd.default, (grad_out, gf, *positional(g)),
            {"lower_bound": -5.0, "initial_state": g["initial_state"], "cu_seqlens": g["cu_seqlens"]},
        )


def test_opcheck_cuda_fwd_checkpointed():
    for kw, state, slots in ((dict(B=1, T=100), torch.float32, 7), (dict(seqlens=[10, 0, 33]), torch.float32, 6),
                             (dict(B=1, T=21), None, 2)):
        _, g = cuda_inputs(H=2, state_dtype=state, **kw)
        args = [t.detach().requires_grad_() for t in positional(g)]
        torch.library.opcheck(torch.ops.kda._fwd_checkpointed.default,
                              (*args, None, -5.0, g["initial_state"], True, g["cu_seqlens"]))
        out, _, ckpt, records = torch.ops.kda._fwd_checkpointed(*positional(g), None, -5.0, g["initial_state"],
                                                                True, g["cu_seqlens"])
        assert ckpt.shape == (slots, 2, D, D) and records.shape == (slots, 2, RECORD_FLOATS)
        torch.library.opcheck(
            torch.ops.kda.bwd.default, (torch.randn_like(out), None, *positional(g)),
            {"lower_bound": -5.0, "initial_state": g["initial_state"], "cu_seqlens": g["cu_seqlens"],
             "checkpoints": ckpt, "records": records},
        )


@pytest.mark.parametrize("K,V,ds_block", [(128, 128, "auto"), (48, 64, "auto"), (256, 200, "auto"), (256, 200, "8x2")],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("window", [0, 3])
def test_backward_cuda_graph_capture_and_replay(window, K, V, ds_block):
    """The backward captured in a CUDA graph, in one pass and in windows of 3 slots
    (the checkpoint pass, its copies and the carries in the graph; at 256 the
    record gradients' cluster launch too), on the 128-, 64- and 256-wide kernels (at 256
    also the dS recurrence's 8x2, which these two heads would not choose),
    replays the eager gradients for new incoming gradients."""
    with forced(window_slots=window, ds_block=ds_block):
        _, g = cuda_inputs(seqlens=[40, 0, 100, 17], H=2, state_dtype=torch.float32, K=K, V=V)
        grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
        gf = torch.randn(*g["initial_state"].shape, device=DEV)
        kw = dict(lower_bound=-5.0, initial_state=g["initial_state"], cu_seqlens=g["cu_seqlens"])

        def step():
            return torch.ops.kda.bwd(grad_out, gf, *positional(g), **kw)

        graph, got = capture_graph(step)
        for _ in range(2):
            grad_out.copy_(torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16))
            gf.copy_(torch.randn_like(gf))
            for t in got:
                t.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            want = step()
            for name, x, y in zip(GRAD_NAMES, got, want):
                assert torch.equal(x, y), (window, name)


def test_opcheck_cuda_with_gradients():
    for seqlens, state in (([10, 0, 33], torch.float32), (None, torch.bfloat16)):
        kw = {"seqlens": seqlens} if seqlens else {"B": 2, "T": 21}
        _, g = cuda_inputs(H=2, state_dtype=state, **kw)
        args = [t.detach().requires_grad_() if n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias") else t
                for n, t in zip(("q", "k", "v", "g", "beta", "A_log", "dt_bias"), positional(g))]
        init = g["initial_state"].detach().requires_grad_()
        torch.library.opcheck(
            torch.ops.kda.fwd.default, tuple(args),
            {"lower_bound": -5.0, "initial_state": init, "output_final_state": True, "cu_seqlens": g["cu_seqlens"]},
        )


def test_compiled_training_step_equals_eager():
    """torch.compile(fullgraph=True) of the layer, forward and backward, against eager.
    Inductor fuses the bf16 roundings differently unless told to emulate eager's casts."""
    from torch._inductor import config as inductor_config
    from torch_kda.nn import KimiDeltaAttention

    torch.manual_seed(0)
    layer = KimiDeltaAttention(hidden_size=256, num_heads=2, head_dim=D, lower_bound=-5.0).to(DEV)
    x = torch.randn(2, 64, 256, device=DEV)

    def step(module):
        module.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, _ = module(x)
        y.float().square().mean().backward()
        return y.detach().float(), [p.grad.detach().float().clone() for p in module.parameters()]

    y_eager, g_eager = step(layer)
    with inductor_config.patch(emulate_precision_casts=True):
        compiled = torch.compile(layer, fullgraph=True)
        y_comp, g_comp = step(compiled)
    assert rel(y_comp, y_eager) <= 1e-3
    for ge, gc in zip(g_eager, g_comp):
        assert rel(gc, ge) <= 5e-3
