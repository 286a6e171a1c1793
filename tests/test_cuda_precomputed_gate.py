"""A precomputed gate (A_log=None, dt_bias=None: g is the log decay itself) on the
CUDA kernels, against the float64 token recurrence (conftest's reference_kda) and
the float64 CPU kernels: forward, both backward paths (with the forward's kept
states, and recomputing them), the pool's decode and kda::fwd_'s decode shapes,
bitwise causality, and the values TORCH_KDA_CHECK=1 rejects.

lower_bound picks the kernels: -5 (the caller's promise g >= -5) the bounded
gate's factoring, None or a promise below -5 the softplus gate's, which takes any
decay. g comes in bf16 or fp32 (the op takes fp32 g with bf16 q, k, v, beta).
"""
import pytest
import torch

import torch_kda
from conftest import capture_graph, nan_filled_empty, positional, rel, run_reference
from cuda_helpers import CUDA_MARKS, DEV, cuda_inputs, float64_grads, launched_kernels, to_cpu64
from torch_kda.testing import forced

pytestmark = CUDA_MARKS

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
BOUNDS = pytest.mark.parametrize("lower_bound", [-5.0, None, -8.0], ids=["bounded", "any", "promised_below_5"])
G_DTYPES = pytest.mark.parametrize("g_dtype", [BF16, F32], ids=["g_bf16", "g_fp32"])
SHAPES = pytest.mark.parametrize("shape", [dict(B=2, T=100, H=2), dict(seqlens=[5, 0, 33, 16, 70], H=2)],
                                 ids=["fixed", "varlen"])


def given_gate(g, lower_bound, g_dtype, hard=True):
    """The inputs with A_log and dt_bias None and g a log decay: L sigmoid(g) for a
    lower bound L (at least L, as promised), else -6 sigmoid(g) with, where hard, a
    tenth of the tokens' channels at -1000 (the state resets) and a tenth at -1e-7
    (no decay)."""
    x = g["g"].double()
    if lower_bound is not None:
        lam = lower_bound * torch.sigmoid(x)
    else:
        lam = -6.0 * torch.sigmoid(x)
        if hard:
            pick = torch.rand(x.shape, device=x.device)
            lam = torch.where(pick < 0.1, torch.full_like(lam, -1000.0), lam)
            lam = torch.where(pick > 0.9, torch.full_like(lam, -1e-7), lam)
    return {**g, "g": lam.to(g_dtype), "A_log": None, "dt_bias": None}


def run(g, lower_bound, **kw):
    return torch_kda.kda(*positional(g), lower_bound=lower_bound, initial_state=g["initial_state"],
                         output_final_state=True, cu_seqlens=g["cu_seqlens"], **kw)


@BOUNDS
@G_DTYPES
@SHAPES
@pytest.mark.parametrize("state_dtype", [F32, BF16], ids=["fp32_state", "bf16_state"])
def test_forward_matches_the_reference(shape, g_dtype, lower_bound, state_dtype):
    _, g = cuda_inputs(state_dtype=state_dtype, **shape)
    g = given_gate(g, lower_bound, g_dtype)
    out, final = run(g, lower_bound)
    torch.cuda.synchronize()
    ref_out, ref_final = run_reference(g, lower_bound=lower_bound)
    e_out, e_final = rel(out, ref_out), rel(final, ref_final)
    print(f"\nout {e_out:.2e}, final {e_final:.2e}", end="")
    assert out.dtype == BF16 and final.dtype == state_dtype
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert e_out <= (5e-3 if state_dtype == F32 else 1e-2)
    assert e_final <= (1e-4 if state_dtype == F32 else 1e-2)


def reference_grads(g, grad_out, grad_final, lower_bound):
    return dict(zip(BWD_NAMES, float64_grads(g, grad_out, grad_final, lower_bound)))


GRAD_TOL = dict(dq=5e-3, dk=5e-3, dv=5e-3, dg=5e-3, dbeta=5e-3, dinitial_state=1e-4)
BWD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state")


def check_grads(got, want):
    """got and want: gradient name -> tensor, for the names in GRAD_TOL."""
    for name, tol in GRAD_TOL.items():
        e = rel(got[name].cpu(), want[name])
        print(f" {name} {e:.1e}", end="")
        assert torch.isfinite(got[name]).all(), name
        assert e <= tol, f"{name}: rel {e:.2e}"


@BOUNDS
@G_DTYPES
@SHAPES
def test_backward_matches_the_cpu_kernels(shape, g_dtype, lower_bound):
    """kda.bwd recomputing the forward's states, against the CPU's in float64."""
    _, g = cuda_inputs(state_dtype=F32, **shape)
    g = given_gate(g, lower_bound, g_dtype)
    grad_out = torch.randn(g["v"].shape, device=DEV).to(BF16)
    grad_final = torch.randn(g["initial_state"].shape, device=DEV)
    with nan_filled_empty():  # every gradient element a kernel leaves unwritten shows as NaN
        got = torch.ops.kda.bwd(grad_out, grad_final, *positional(g), lower_bound=lower_bound,
                                initial_state=g["initial_state"], cu_seqlens=g["cu_seqlens"])
    got = dict(zip(BWD_NAMES, got))
    assert got["dg"].dtype == g_dtype and got["dg"].shape == g["g"].shape
    assert got["dA_log"].numel() == 0 and got["ddt_bias"].numel() == 0  # a precomputed gate has neither
    check_grads(got, reference_grads(g, grad_out, grad_final, lower_bound))


@BOUNDS
@G_DTYPES
def test_autograd_step_matches_the_cpu_kernels(g_dtype, lower_bound):
    """torch_kda.kda under autograd: the forward keeps its states and records for the backward."""
    _, g = cuda_inputs(state_dtype=F32, seqlens=[40, 0, 95, 17], H=2)
    g = given_gate(g, lower_bound, g_dtype)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = {n: g[n].detach().clone().requires_grad_(True) for n in names}
    out, final = run({**g, **leaves}, lower_bound)
    grad_out = torch.randn_like(out)
    grad_final = torch.randn_like(final)
    torch.autograd.backward([out, final], [grad_out, grad_final])
    check_grads({"d" + n: leaves[n].grad for n in names}, reference_grads(g, grad_out, grad_final, lower_bound))


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "any"])
@pytest.mark.parametrize("pool_dtype", [F32, BF16], ids=["fp32_pool", "bf16_pool"])
@G_DTYPES
def test_pool_decode_matches_the_cpu_kernel(g_dtype, pool_dtype, lower_bound):
    """One token a request, and speculative decoding, against the CPU's kda_pool."""
    N, H, D = 5, 2, 128
    pool = torch.randn(4 * N, H, D, D, device=DEV).to(pool_dtype)
    for tokens, accepted in ((1, None), (4, torch.tensor([1, 4, 2, 3, 1], device=DEV))):
        _, g = cuda_inputs(B=N, T=tokens, H=H)
        g = given_gate(g, lower_bound, g_dtype)
        idx = torch.randperm(4 * N, device=DEV)
        idx = idx[:N] if accepted is None else idx.view(N, tokens)
        cpu_pool = pool.cpu().double()
        out = torch_kda.kda_pool(*positional(g), pool, idx, lower_bound=lower_bound, num_accepted_tokens=accepted)
        g64 = to_cpu64(g)
        want = torch_kda.kda_pool(*positional(g64), cpu_pool, idx.cpu(), lower_bound=lower_bound,
                                  num_accepted_tokens=accepted.cpu() if accepted is not None else None)
        tol = 1e-2 if pool_dtype == BF16 else 5e-3
        assert rel(out.cpu(), want) <= tol, tokens
        assert rel(pool.cpu(), cpu_pool) <= (1e-2 if pool_dtype == BF16 else 1e-5), tokens
    # Varlen, a request of 6 tokens (past the first tile of 4) among short ones: still the decode kernel.
    _, g = cuda_inputs(seqlens=[6, 1, 2], H=H)
    g = given_gate(g, lower_bound, g_dtype)
    idx = torch.randperm(4 * N, device=DEV)[:3]
    cpu_pool = pool.cpu().double()
    out, names = launched_kernels(
        lambda: torch_kda.kda_pool(*positional(g), pool, idx, lower_bound=lower_bound, cu_seqlens=g["cu_seqlens"]))
    assert any("pool_decode_kernel" in n for n in names) and not any("prepare_kernel" in n for n in names)
    g64 = to_cpu64(g)
    want = torch_kda.kda_pool(*positional(g64), cpu_pool, idx.cpu(), lower_bound=lower_bound,
                              cu_seqlens=g64["cu_seqlens"])
    assert rel(out.cpu(), want) <= (1e-2 if pool_dtype == BF16 else 5e-3)
    assert rel(pool.cpu(), cpu_pool) <= (1e-2 if pool_dtype == BF16 else 1e-5)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "any"])
@G_DTYPES
def test_fwd_inplace_decode_shapes(g_dtype, lower_bound):
    """kda::fwd_ with one token a sequence (the decode kernel), against the float64 reference."""
    _, g = cuda_inputs(state_dtype=F32, B=6, T=1, H=2)
    g = given_gate(g, lower_bound, g_dtype)
    out = torch.full_like(g["v"], float("nan"))
    final = torch.full_like(g["initial_state"], float("nan"))
    torch_kda.fwd(*positional(g)[:5], None, out, None, None, lower_bound, initial_state=g["initial_state"],
                  final_state=final)
    ref_out, ref_final = run_reference(g, lower_bound=lower_bound)
    assert rel(out, ref_out) <= 5e-3 and rel(final, ref_final) <= 1e-5


@pytest.mark.parametrize("force", [dict(window_slots=3), dict(segments=4)], ids=["windows", "segments"])
def test_windows_and_segments(force):
    """The forward in windows or segments, and the backward in windows, against float64."""
    _, g = cuda_inputs(state_dtype=F32, B=1, T=700, H=2)
    g = given_gate(g, None, F32)
    with forced(**force):
        out, final = run(g, None)
    ref_out, ref_final = run_reference(g, lower_bound=None)
    assert rel(out, ref_out) <= 5e-3 and rel(final, ref_final) <= 1e-4
    if "window_slots" in force:
        grad_out = torch.randn(g["v"].shape, device=DEV).to(BF16)
        grad_final = torch.randn(g["initial_state"].shape, device=DEV)
        with forced(**force):
            got = torch.ops.kda.bwd(grad_out, grad_final, *positional(g), lower_bound=None,
                                    initial_state=g["initial_state"])
        check_grads(dict(zip(BWD_NAMES, got)), reference_grads(g, grad_out, grad_final, None))


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "any"])
def test_prefixes_are_bitwise_causal(lower_bound):
    """Tokens after P changed (to huge decays where the gate allows): out before P is bitwise the same."""
    _, g = cuda_inputs(state_dtype=F32, B=1, T=64, H=2)
    g = given_gate(g, lower_bound, F32, hard=False)
    P = 37
    later = {**g, "g": g["g"].clone(), "v": g["v"].clone()}
    later["g"][:, P:] = -1000.0 if lower_bound is None else lower_bound
    later["v"][:, P:] = torch.randn_like(later["v"][:, P:])
    out, _ = run(g, lower_bound)
    out2, _ = run(later, lower_bound)
    assert torch.equal(out[:, :P], out2[:, :P])
    assert not torch.equal(out[:, P:], out2[:, P:])


def test_values_checked_under_torch_kda_check(monkeypatch):
    monkeypatch.setenv("TORCH_KDA_CHECK", "1")
    _, g = cuda_inputs(state_dtype=F32, B=1, T=20, H=2)
    g = given_gate(g, -5.0, F32)
    bad = {**g, "g": g["g"].clone()}
    bad["g"][0, 7, 1, 3] = 0.5
    with pytest.raises(RuntimeError, match=r"g must be a log decay \(at most 0\) when A_log and dt_bias are None"):
        run(bad, None)
    bad["g"][0, 7, 1, 3] = -5.5
    with pytest.raises(RuntimeError, match=r"g must be at least lower_bound = -5"):
        run(bad, -5.0)
    out, _ = run(bad, None)  # no promise: any log decay
    assert torch.isfinite(out).all()


@G_DTYPES
def test_cuda_graph_replay_with_new_inputs(g_dtype):
    """A captured varlen call (an empty sequence among them), replayed with new q, k, v, g, beta and
    initial state copied in: bitwise the eager call on those inputs."""
    _, g = cuda_inputs(state_dtype=F32, seqlens=[40, 0, 100, 17], H=2)
    g = given_gate(g, None, g_dtype)
    out = torch.empty_like(g["v"])
    final = torch.empty_like(g["initial_state"])

    def step():
        torch_kda.fwd(*positional(g)[:5], None, out, None, None, None, initial_state=g["initial_state"],
                      final_state=final, cu_seqlens=g["cu_seqlens"])

    graph, _ = capture_graph(step)
    _, g2 = cuda_inputs(state_dtype=F32, seqlens=[40, 0, 100, 17], H=2)
    g2 = given_gate(g2, None, g_dtype)
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        g[name].copy_(g2[name])
    out.fill_(float("nan"))
    final.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager_out, eager_final = run(g2, None)
    assert torch.equal(out, eager_out) and torch.equal(final, eager_final)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "any"])
def test_compile_fullgraph_forward_and_backward(lower_bound):
    _, g = cuda_inputs(state_dtype=F32, B=2, T=64, H=2)
    g = given_gate(g, lower_bound, F32)

    def step(q, k, v, gate, beta, h0):
        o, s = torch_kda.kda(q, k, v, gate, beta, None, None, lower_bound=lower_bound, initial_state=h0,
                             output_final_state=True)
        return o.float().square().sum() + s.square().sum()

    names = ("q", "k", "v", "g", "beta", "initial_state")
    compiled = torch.compile(step, fullgraph=True)
    grads = []
    for fn in (compiled, step):
        leaves = [g[n].detach().clone().requires_grad_(True) for n in names]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for n, a, b in zip(names, *grads):
        assert torch.equal(a, b), n


def test_opcheck():
    _, g = cuda_inputs(state_dtype=F32, seqlens=[10, 0, 33], H=2)
    g = given_gate(g, None, F32)
    kw = {"lower_bound": None, "initial_state": g["initial_state"], "cu_seqlens": g["cu_seqlens"]}
    torch.library.opcheck(torch.ops.kda.fwd.default, positional(g), {**kw, "output_final_state": True})
    grad_out = torch.randn(g["v"].shape, device=DEV).to(BF16)
    grad_final = torch.randn(g["initial_state"].shape, device=DEV)
    torch.library.opcheck(torch.ops.kda.bwd.default, (grad_out, grad_final, *positional(g)), kw)
