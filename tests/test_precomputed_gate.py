"""A precomputed gate (A_log=None, dt_bias=None): g is the per-channel log decay
itself, gradients flow to g, and lower_bound (if given) is the caller's promise
that g >= lower_bound. On the CPU, against the float64 reference: forward and
gradients, fixed length and varlen with empty sequences, state resets, almost no
decay, tiny beta, grouped value heads, bf16 inputs with an fp32 g, the in-place op
and the pool; and the inputs it rejects. On CUDA: tests/test_cuda_precomputed_gate.py."""
import pytest
import torch

import torch_kda
from conftest import make_inputs, positional, rel, run_reference
from torch_kda.naive import kda_naive

F64 = torch.float64
BOUNDS = pytest.mark.parametrize("lower_bound", [None, -6.0], ids=["any", "promised"])


def precomputed(d, scale=1.0):
    """d with A_log and dt_bias None and g a log decay in [-6, 0): -6 sigmoid(scale g)."""
    return {**d, "g": -6.0 * torch.sigmoid(scale * d["g"].double()).to(d["g"].dtype), "A_log": None, "dt_bias": None}


def call(d, lower_bound, **kw):
    return torch_kda.kda(*positional(d), lower_bound=lower_bound, initial_state=d["initial_state"],
                         output_final_state=True, cu_seqlens=d["cu_seqlens"], **kw)


@BOUNDS
@pytest.mark.parametrize("shape", [dict(B=2, T=11, H=2), dict(seqlens=[4, 0, 1, 9], H=2),
                                   dict(B=1, T=8, H=1, HV=3)], ids=["fixed", "varlen", "grouped"])
def test_forward_and_gradients_against_the_reference(shape, lower_bound):
    d = precomputed(make_inputs(K=6, V=5, dtype=F64, state_dtype=F64, **shape))
    names = ("q", "k", "v", "g", "beta", "initial_state")
    for n in names:
        d[n].requires_grad_(True)
    out, final = call(d, lower_bound)
    ref_out, ref_final = run_reference(d, lower_bound=lower_bound)
    assert rel(out, ref_out) <= 1e-12 and rel(final, ref_final) <= 1e-12
    w_out, w_final = torch.randn_like(out), torch.randn_like(final)
    got = torch.autograd.grad((out * w_out).sum() + (final * w_final).sum(), [d[n] for n in names])
    want = torch.autograd.grad((ref_out * w_out).sum() + (ref_final * w_final).sum(), [d[n] for n in names])
    for n, x, r in zip(names, got, want):
        assert rel(x, r) <= 1e-10, n


def test_resets_no_decay_and_tiny_beta():
    """Half the tokens decay by e^-1000 (the state resets there), the rest by e^-1e-8;
    beta ~ sigmoid(-6)."""
    d = make_inputs(B=1, T=40, H=2, K=8, V=8, dtype=F64, state_dtype=F64)
    resets = torch.rand(1, 40, 2, 1) < 0.5
    d = {**d, "A_log": None, "dt_bias": None,
         "g": torch.where(resets, torch.full_like(d["g"], -1000.0), torch.full_like(d["g"], -1e-8))}
    d["beta"] = d["beta"] - 6.0
    out, final = call(d, None)
    ref_out, ref_final = run_reference(d, lower_bound=None)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert rel(out, ref_out) <= 1e-10 and rel(final, ref_final) <= 1e-10


def test_bf16_inputs_with_an_fp32_gate():
    d = make_inputs(B=1, T=48, H=2, K=16, V=16, dtype=torch.bfloat16, state_dtype=torch.float32)
    d = {**precomputed(d), "g": -6.0 * torch.sigmoid(torch.randn(1, 48, 2, 16))}
    out, final = call(d, -6.0)
    ref_out, ref_final = run_reference(d, lower_bound=-6.0)
    assert rel(out, ref_out) <= 5e-3 and rel(final, ref_final) <= 1e-4
    g = d["g"].clone().requires_grad_(True)
    out, _ = torch_kda.kda(*positional({**d, "g": g}))
    out.float().sum().backward()
    assert g.grad.dtype == torch.float32 and torch.isfinite(g.grad).all()


def test_inplace_op_and_pool():
    d = precomputed(make_inputs(B=3, T=2, H=2, K=4, V=4, dtype=F64, state_dtype=F64))
    out = torch.full(d["v"].shape, float("nan"), dtype=F64)
    final = torch.full(d["initial_state"].shape, float("nan"), dtype=F64)
    torch_kda.fwd(*positional(d)[:5], None, out, None, None, None, initial_state=d["initial_state"],
                  final_state=final)
    ref_out, ref_final = run_reference(d)
    assert rel(out, ref_out) <= 1e-12 and rel(final, ref_final) <= 1e-12
    pool = torch.randn(5, 2, 4, 4, dtype=F64)
    before = pool.clone()
    idx = torch.tensor([2, 4, 0])
    got = torch_kda.kda_pool(*positional(d), pool, idx)
    want, want_final = kda_naive(*positional(d), initial_state=before[idx])
    assert rel(got, want) <= 1e-12 and rel(pool[idx], want_final) <= 1e-12


def test_bwd_returns_empty_parameter_gradients():
    d = precomputed(make_inputs(B=1, T=5, H=2, K=4, V=3, dtype=F64))
    out, _ = torch.ops.kda.fwd(*positional(d))
    grads = torch.ops.kda.bwd(torch.randn_like(out), None, *positional(d))
    assert grads[5].numel() == 0 and grads[6].numel() == 0


def test_rejected_inputs_name_the_argument():
    d = precomputed(make_inputs(B=1, T=5, H=2, K=4, V=3))
    with pytest.raises(RuntimeError, match="A_log and dt_bias must both be tensors, or both None .* got dt_bias None"):
        torch_kda.kda(*positional({**d, "A_log": torch.rand(2)}))
    with pytest.raises(RuntimeError, match=r"g must be a log decay \(at most 0\) when A_log and dt_bias are None, "
                                           r"got a largest value of 0.5"):
        torch_kda.kda(*positional({**d, "g": d["g"].index_fill(1, torch.tensor([3]), 0.5)}))
    within = d["g"].clamp(min=-0.9)
    torch_kda.kda(*positional({**d, "g": within}), lower_bound=-1.0)  # the promise kept
    with pytest.raises(RuntimeError, match=r"g must be at least lower_bound = -1 \(its promise for a precomputed "
                                           r"gate\), got a smallest value of -3"):
        torch_kda.kda(*positional({**d, "g": within.index_fill(1, torch.tensor([2]), -3.0)}), lower_bound=-1.0)
    with pytest.raises(RuntimeError, match="g must be a log decay"):
        torch_kda.kda(*positional({**d, "g": d["g"].index_fill(1, torch.tensor([0]), float("nan"))}))
    bf = {**make_inputs(B=1, T=5, H=2, K=4, V=3, dtype=torch.bfloat16), "A_log": None, "dt_bias": None}
    with pytest.raises(RuntimeError, match=r"g must have the dtype of q \(bfloat16\) or float32 when A_log and "
                                           r"dt_bias are None, got float16"):
        torch_kda.kda(*positional({**bf, "g": -bf["g"].abs().half()}))


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_opcheck(varlen):
    shape = dict(seqlens=[3, 0, 5]) if varlen else dict(B=2, T=6)
    d = precomputed(make_inputs(H=2, HV=4, K=4, V=4, state_dtype=torch.float32, requires_grad=True, **shape))
    d["g"] = d["g"].detach().requires_grad_(True)
    args = positional(d) + (None, -6.0, d["initial_state"], True, d["cu_seqlens"])
    torch.library.opcheck(torch.ops.kda.fwd.default, args)
    out, final = torch.ops.kda.fwd(*args)
    x = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in d.items()}
    bwd_args = (torch.randn_like(out).detach(), torch.randn_like(final).detach()) + positional(x) + (
        None, -6.0, x["initial_state"], x["cu_seqlens"])
    torch.library.opcheck(torch.ops.kda.bwd.default, bwd_args)
