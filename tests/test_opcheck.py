"""torch.library.opcheck on every kda operator (all default sub-tests: schema,
autograd registration, FakeTensor, AOT dispatch static and dynamic)."""
import pytest
import torch

import torch_kda  # noqa: F401  (registers torch.ops.kda.*)
from conftest import make_inputs, positional

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64

# (id, make_inputs kwargs, lower_bound, scale)
CASES = [
    ("fixed_fp32_bounded", dict(B=2, T=9, H=2, K=8, V=4), -5.0, None),
    ("fixed_fp32_softplus_state", dict(B=2, T=7, H=2, K=8, V=4, state_dtype=F32), None, 0.25),
    ("varlen_fp32_bounded_state", dict(H=2, K=8, V=4, seqlens=[3, 0, 6], state_dtype=F32), -1.0, None),
    ("varlen_int32_softplus", dict(H=1, K=4, V=8, seqlens=[5, 1, 0], cu_dtype=torch.int32), None, None),
    ("fixed_bf16_bf16state", dict(B=1, T=11, H=2, K=8, V=8, dtype=BF16, state_dtype=BF16), -0.1, None),
    ("varlen_bf16_fp32state", dict(H=2, K=8, V=4, seqlens=[4, 9], dtype=BF16, state_dtype=F32), -5.0, 0.5),
    ("fixed_fp16", dict(B=2, T=5, H=1, K=4, V=4, dtype=torch.float16), -1.0, None),
    ("fixed_fp64_state", dict(B=1, T=6, H=2, K=4, V=3, dtype=F64, state_dtype=F64), None, None),
    ("varlen_fp64_bounded", dict(H=2, K=4, V=3, seqlens=[0, 7], dtype=F64, state_dtype=F64), -2.0, 1.5),
    ("empty_T", dict(B=2, T=0, H=2, K=4, V=4, state_dtype=F32), -1.0, None),
    ("fixed_fp32_bounded_fp64_params", dict(B=1, T=8, H=2, K=4, V=4, param_dtype=F64), -1.0, None),
    ("varlen_fp32_softplus_many", dict(H=2, K=4, V=4, seqlens=[1, 2, 3, 0, 4], state_dtype=F32), None, None),
    ("fixed_fp32_long_bounded", dict(B=1, T=40, H=1, K=16, V=16, state_dtype=F32), -5.0, None),
    ("grouped_fixed_fp32_softplus", dict(B=2, T=6, H=1, HV=2, K=4, V=4, state_dtype=F32), None, None),
    ("grouped_varlen_bf16_bounded", dict(H=2, HV=8, K=8, V=4, seqlens=[3, 0, 5], dtype=BF16), -1.0, None),
]
IDS = [c[0] for c in CASES]


def _sample(case, requires_grad=False):
    _, kwargs, lower_bound, scale = case
    d = make_inputs(**kwargs, requires_grad=requires_grad)
    return d, lower_bound, scale


@pytest.mark.parametrize("output_final_state", [True, False], ids=["final", "no_final"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_opcheck_fwd(case, output_final_state):
    # requires_grad on every other case: exercises the autograd registration too.
    requires_grad = CASES.index(case) % 2 == 0 and output_final_state
    d, lower_bound, scale = _sample(case, requires_grad=requires_grad)
    args = positional(d) + (scale, lower_bound, d["initial_state"], output_final_state, d["cu_seqlens"])
    torch.library.opcheck(torch.ops.kda.fwd.default, args)


@pytest.mark.parametrize("with_final_state", [True, False], ids=["final", "no_final"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_opcheck_fwd_inplace(case, with_final_state):
    d, lower_bound, scale = _sample(case)
    q, v = d["q"], d["v"]
    out = torch.full(v.shape, float("nan"), dtype=q.dtype)
    final_state = None
    if with_final_state:
        state = d["initial_state"]
        N = q.shape[0] if d["cu_seqlens"] is None else d["cu_seqlens"].numel() - 1
        dtype = state.dtype if state is not None else F32
        final_state = torch.full((N, v.shape[2], v.shape[-1], q.shape[-1]), float("nan"), dtype=dtype)
    args = positional(d) + (out, final_state, scale, lower_bound, d["initial_state"], d["cu_seqlens"])
    torch.library.opcheck(torch.ops.kda.fwd_.default, args)


@pytest.mark.parametrize("with_grad_final_state", [True, False], ids=["grad_final", "no_grad_final"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_opcheck_bwd(case, with_grad_final_state):
    d, lower_bound, scale = _sample(case)
    out, final = torch.ops.kda.fwd(
        *positional(d), scale, lower_bound, d["initial_state"], True, d["cu_seqlens"]
    )
    grad_out = torch.randn_like(out)
    grad_final_state = torch.randn_like(final) if with_grad_final_state else None
    args = (grad_out, grad_final_state) + positional(d) + (scale, lower_bound, d["initial_state"], d["cu_seqlens"])
    torch.library.opcheck(torch.ops.kda.bwd.default, args)
