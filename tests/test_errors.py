"""Every rejected input (the bad-input rules in docs/ARCHITECTURE.md; and every argument check of
csrc/checks.cpp reachable on the CPU): it raises, and the message names the
argument. Messages are expecttest inline snapshots; refresh them with
EXPECTTEST_ACCEPT=1 python -m pytest tests/test_errors.py (and review them)."""
import math
import re

import expecttest
import torch

import torch_kda
from conftest import make_inputs

B, T, H, K, V = 2, 5, 3, 4, 6  # all different, so a message cannot name the wrong size by accident
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
META = torch.device("meta")


def _inputs(varlen=False):
    if varlen:
        return make_inputs(H=H, K=K, V=V, seqlens=[2, 0, 3], state_dtype=F32)
    return make_inputs(B=B, T=T, H=H, K=K, V=V, state_dtype=F32)


def fwd_args(varlen=False, **changes):
    """Valid keyword arguments of torch.ops.kda.fwd, with `changes` applied."""
    d = _inputs(varlen)
    args = dict(d, scale=None, lower_bound=-1.0, output_final_state=True)
    args.update(changes)
    return args


def fwd_inplace_args(varlen=False, **changes):
    d = _inputs(varlen)
    N = B if not varlen else 3
    Bq, Tq = d["q"].shape[:2]
    args = dict(
        d,
        out=torch.full((Bq, Tq, H, V), float("nan")),
        final_state=torch.full((N, H, V, K), float("nan")),
        scale=None,
        lower_bound=-1.0,
    )
    args.update(changes)
    return args


def bwd_args(**changes):
    d = _inputs()
    args = dict(
        d,
        grad_out=torch.randn(B, T, H, V),
        grad_final_state=torch.randn(B, H, V, K),
        scale=None,
        lower_bound=-1.0,
    )
    args.update(changes)
    return args


def randn(*shape, dtype=F32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def names_argument(msg, name):
    """`name` appears as a word of msg (so "k" is not found inside "kda")."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", msg) is not None


class ErrorTestCase(expecttest.TestCase):
    def assertRejects(self, fn, name, expect, exc=RuntimeError):
        """fn() raises `exc` whose message names `name` and equals the snapshot `expect`."""
        with self.assertRaises(exc) as cm:
            fn()
        msg = str(cm.exception)
        self.assertTrue(names_argument(msg, name), f"{name!r} not named in: {msg}")
        self.assertExpectedInline(msg, expect, skip=1)

    def fwd(self, **changes):
        return lambda: torch.ops.kda.fwd(**fwd_args(**changes))

    def fwd_varlen(self, **changes):
        return lambda: torch.ops.kda.fwd(**fwd_args(varlen=True, **changes))

    def fwd_(self, varlen=False, **changes):
        return lambda: torch.ops.kda.fwd_(**fwd_inplace_args(varlen, **changes))

    def bwd(self, **changes):
        return lambda: torch.ops.kda.bwd(**bwd_args(**changes))


class TestValidBaseline(ErrorTestCase):
    # The base arguments are valid: every rejection below comes from the one change it makes.
    def test_valid_arguments_run(self):
        out, final = torch.ops.kda.fwd(**fwd_args())
        self.assertEqual(out.shape, (B, T, H, V))
        self.assertEqual(final.shape, (B, H, V, K))
        out, final = torch.ops.kda.fwd(**fwd_args(varlen=True))
        self.assertEqual(final.shape, (3, H, V, K))
        args = fwd_inplace_args()
        torch.ops.kda.fwd_(**args)
        self.assertFalse(args["out"].isnan().any() or args["final_state"].isnan().any())
        grads = torch.ops.kda.bwd(**bwd_args())
        self.assertEqual(len(grads), 8)


class TestDevice(ErrorTestCase):
    # A meta tensor among CPU tensors gives a device mismatch without a GPU.
    def test_k_on_other_device(self):
        self.assertRejects(self.fwd(k=randn(B, T, H, K, device=META)), "k", """kda.fwd: k must be on the same device as q (cpu), got k on meta""")

    def test_v_on_other_device(self):
        self.assertRejects(self.fwd(v=randn(B, T, H, V, device=META)), "v", """kda.fwd: v must be on the same device as q (cpu), got v on meta""")

    def test_g_on_other_device(self):
        self.assertRejects(self.fwd(g=randn(B, T, H, K, device=META)), "g", """kda.fwd: g must be on the same device as q (cpu), got g on meta""")

    def test_beta_on_other_device(self):
        self.assertRejects(self.fwd(beta=randn(B, T, H, device=META)), "beta", """kda.fwd: beta must be on the same device as q (cpu), got beta on meta""")

    def test_A_log_on_other_device(self):
        self.assertRejects(self.fwd(A_log=randn(H, device=META)), "A_log", """kda.fwd: A_log must be on the same device as q (cpu), got A_log on meta""")

    def test_dt_bias_on_other_device(self):
        self.assertRejects(self.fwd(dt_bias=randn(H, K, device=META)), "dt_bias", """kda.fwd: dt_bias must be on the same device as q (cpu), got dt_bias on meta""")

    def test_initial_state_on_other_device(self):
        self.assertRejects(self.fwd(initial_state=randn(B, H, V, K, device=META)), "initial_state", """kda.fwd: initial_state must be on the same device as q (cpu), got initial_state on meta""")

    def test_cu_seqlens_on_other_device(self):
        cu = torch.tensor([0, 2, 2, 5], device=META)
        self.assertRejects(self.fwd_varlen(cu_seqlens=cu), "cu_seqlens", """kda.fwd: cu_seqlens must be on the same device as q (cpu), got cu_seqlens on meta""")

    def test_q_on_other_device_than_the_rest(self):
        self.assertRejects(self.fwd(q=randn(B, T, H, K, device=META)), "k", """kda.fwd: k must be on the same device as q (meta), got k on cpu""")

    def test_out_on_other_device(self):
        self.assertRejects(self.fwd_(out=randn(B, T, H, V, device=META)), "out", """kda.fwd_: out must be on the same device as q (cpu), got out on meta""")

    def test_final_state_on_other_device(self):
        self.assertRejects(self.fwd_(final_state=randn(B, H, V, K, device=META)), "final_state", """kda.fwd_: final_state must be on the same device as q (cpu), got final_state on meta""")

    def test_grad_out_on_other_device(self):
        self.assertRejects(self.bwd(grad_out=randn(B, T, H, V, device=META)), "grad_out", """kda.bwd: grad_out must be on the same device as q (cpu), got grad_out on meta""")

    def test_grad_final_state_on_other_device(self):
        self.assertRejects(
            self.bwd(grad_final_state=randn(B, H, V, K, device=META)), "grad_final_state", """kda.bwd: grad_final_state must be on the same device as q (cpu), got grad_final_state on meta"""
        )


class TestDtype(ErrorTestCase):
    def test_q_integer(self):
        self.assertRejects(self.fwd(q=torch.ones(B, T, H, K, dtype=torch.int32)), "q", """kda.fwd: q must have dtype bfloat16, float16, float32 or float64, got int32""")

    def test_q_complex(self):
        self.assertRejects(self.fwd(q=randn(B, T, H, K, dtype=torch.complex64)), "q", """kda.fwd: q must have dtype bfloat16, float16, float32 or float64, got ComplexFloat""")

    def test_k_dtype_differs_from_q(self):
        self.assertRejects(self.fwd(k=randn(B, T, H, K, dtype=F64)), "k", """kda.fwd: k must have dtype float32 (the dtype of q), got float64""")

    def test_v_dtype_differs_from_q(self):
        self.assertRejects(self.fwd(v=randn(B, T, H, V, dtype=BF16)), "v", """kda.fwd: v must have dtype float32 (the dtype of q), got bfloat16""")

    def test_g_dtype_differs_from_q(self):
        self.assertRejects(self.fwd(g=randn(B, T, H, K, dtype=torch.float16)), "g", """kda.fwd: g must have dtype float32 (the dtype of q), got float16""")

    def test_beta_dtype_differs_from_q(self):
        self.assertRejects(self.fwd(beta=randn(B, T, H, dtype=BF16)), "beta", """kda.fwd: beta must have dtype float32 (the dtype of q), got bfloat16""")

    def test_A_log_bf16(self):
        self.assertRejects(self.fwd(A_log=randn(H, dtype=BF16)), "A_log", """kda.fwd: A_log must have dtype float32 (or float64), got bfloat16""")

    def test_dt_bias_fp16(self):
        self.assertRejects(self.fwd(dt_bias=randn(H, K, dtype=torch.float16)), "dt_bias", """kda.fwd: dt_bias must have dtype float32 (or float64), got float16""")

    def test_initial_state_fp16(self):
        self.assertRejects(
            self.fwd(initial_state=randn(B, H, V, K, dtype=torch.float16)), "initial_state", """kda.fwd: initial_state must have dtype bfloat16, float32 or float64, got float16"""
        )

    def test_initial_state_integer(self):
        self.assertRejects(
            self.fwd(initial_state=torch.zeros(B, H, V, K, dtype=torch.int64)), "initial_state", """kda.fwd: initial_state must have dtype bfloat16, float32 or float64, got int64"""
        )

    def test_cu_seqlens_float(self):
        cu = torch.tensor([0.0, 2.0, 2.0, 5.0])
        self.assertRejects(self.fwd_varlen(cu_seqlens=cu), "cu_seqlens", """kda.fwd: cu_seqlens must have dtype int64 or int32, got float32""")

    def test_cu_seqlens_uint8(self):
        cu = torch.tensor([0, 2, 2, 5], dtype=torch.uint8)
        self.assertRejects(self.fwd_varlen(cu_seqlens=cu), "cu_seqlens", """kda.fwd: cu_seqlens must have dtype int64 or int32, got uint8""")

    def test_out_dtype_differs_from_q(self):
        self.assertRejects(self.fwd_(out=randn(B, T, H, V, dtype=BF16)), "out", """kda.fwd_: out must have dtype float32 (the dtype of q), got bfloat16""")

    def test_final_state_fp16(self):
        self.assertRejects(
            self.fwd_(final_state=randn(B, H, V, K, dtype=torch.float16)), "final_state", """kda.fwd_: final_state must have dtype bfloat16, float32 or float64, got float16"""
        )

    def test_final_state_dtype_differs_from_initial_state(self):
        self.assertRejects(self.fwd_(final_state=randn(B, H, V, K, dtype=BF16)), "final_state", """kda.fwd_: final_state must have the dtype of initial_state (float32), got bfloat16""")

    def test_grad_out_integer(self):
        self.assertRejects(self.bwd(grad_out=torch.ones(B, T, H, V, dtype=torch.int32)), "grad_out", """kda.bwd: grad_out must have a floating dtype, got int32""")

    def test_grad_final_state_integer(self):
        self.assertRejects(
            self.bwd(grad_final_state=torch.ones(B, H, V, K, dtype=torch.int64)), "grad_final_state", """kda.bwd: grad_final_state must have a floating dtype, got int64"""
        )


class TestRank(ErrorTestCase):
    def test_q_rank(self):
        self.assertRejects(self.fwd(q=randn(T, H, K)), "q", """kda.fwd: q must be a 4-D tensor [B, T, H, K], got a 3-D tensor of shape [5, 3, 4]""")

    def test_k_rank(self):
        self.assertRejects(self.fwd(k=randn(B, T, H, K, 1)), "k", """kda.fwd: k must be a 4-D tensor [B, T, H, K], got a 5-D tensor of shape [2, 5, 3, 4, 1]""")

    def test_v_rank(self):
        self.assertRejects(self.fwd(v=randn(B, T, H * V)), "v", """kda.fwd: v must be a 4-D tensor [B, T, HV, V], got a 3-D tensor of shape [2, 5, 18]""")

    def test_g_rank(self):
        self.assertRejects(self.fwd(g=randn(B, T, H * K)), "g", """kda.fwd: g must be a 4-D tensor [B, T, HV, K], got a 3-D tensor of shape [2, 5, 12]""")

    def test_beta_rank(self):
        self.assertRejects(self.fwd(beta=randn(B, T, H, 1)), "beta", """kda.fwd: beta must be a 3-D tensor [B, T, HV], got a 4-D tensor of shape [2, 5, 3, 1]""")

    def test_A_log_rank(self):
        self.assertRejects(self.fwd(A_log=randn(1, H)), "A_log", """kda.fwd: A_log must be a 1-D tensor [HV], got a 2-D tensor of shape [1, 3]""")

    def test_dt_bias_rank(self):
        self.assertRejects(self.fwd(dt_bias=randn(H * K)), "dt_bias", """kda.fwd: dt_bias must be a 2-D tensor [HV, K], got a 1-D tensor of shape [12]""")

    def test_initial_state_rank(self):
        self.assertRejects(self.fwd(initial_state=randn(B * H, V, K)), "initial_state", """kda.fwd: initial_state must be a 4-D tensor [N, HV, V, K], got a 3-D tensor of shape [6, 6, 4]""")

    def test_cu_seqlens_rank(self):
        cu = torch.tensor([[0, 2, 2, 5]])
        self.assertRejects(self.fwd_varlen(cu_seqlens=cu), "cu_seqlens", """kda.fwd: cu_seqlens must be a 1-D tensor [N + 1], got a 2-D tensor of shape [1, 4]""")

    def test_cu_seqlens_scalar(self):
        self.assertRejects(self.fwd_varlen(cu_seqlens=torch.tensor(5)), "cu_seqlens", """kda.fwd: cu_seqlens must be a 1-D tensor [N + 1], got a 0-D tensor of shape []""")

    def test_out_rank(self):
        self.assertRejects(self.fwd_(out=randn(B, T, H * V)), "out", """kda.fwd_: out must be a 4-D tensor [B, T, HV, V], got a 3-D tensor of shape [2, 5, 18]""")

    def test_final_state_rank(self):
        self.assertRejects(self.fwd_(final_state=randn(B, H, V * K)), "final_state", """kda.fwd_: final_state must be a 4-D tensor [N, HV, V, K], got a 3-D tensor of shape [2, 3, 24]""")

    def test_grad_out_rank(self):
        self.assertRejects(self.bwd(grad_out=randn(B * T, H, V)), "grad_out", """kda.bwd: grad_out must be a 4-D tensor [B, T, HV, V], got a 3-D tensor of shape [10, 3, 6]""")

    def test_grad_final_state_rank(self):
        self.assertRejects(self.bwd(grad_final_state=randn(B, H, V, K, 1)), "grad_final_state", """kda.bwd: grad_final_state must be a 4-D tensor [N, HV, V, K], got a 5-D tensor of shape [2, 3, 6, 4, 1]""")


class TestShape(ErrorTestCase):
    def test_q_zero_head_size(self):
        d = dict(q=randn(B, T, H, 0), k=randn(B, T, H, 0), g=randn(B, T, H, 0), dt_bias=randn(H, 0))
        self.assertRejects(self.fwd(**d, initial_state=None), "q", """kda.fwd: q must have a positive head size K (dim 3), got shape [2, 5, 3, 0]""")

    def test_v_zero_head_size(self):
        self.assertRejects(self.fwd(v=randn(B, T, H, 0), initial_state=None), "v", """kda.fwd: v must have a positive head size V (dim 3), got shape [2, 5, 3, 0]""")

    def test_q_head_size_past_256(self):
        d = dict(q=randn(B, T, H, 257), k=randn(B, T, H, 257), g=randn(B, T, H, 257), dt_bias=randn(H, 257))
        self.assertRejects(self.fwd(**d, initial_state=None), "q", """kda.fwd: q must have a head size K (dim 3) of at most 256, got shape [2, 5, 3, 257]""")

    def test_v_head_size_past_256(self):
        self.assertRejects(self.fwd(v=randn(B, T, H, 300), initial_state=None), "v", """kda.fwd: v must have a head size V (dim 3) of at most 256, got shape [2, 5, 3, 300]""")

    def test_zero_heads(self):
        d = dict(
            q=randn(B, T, 0, K), k=randn(B, T, 0, K), v=randn(B, T, 0, V), g=randn(B, T, 0, K),
            beta=randn(B, T, 0), A_log=randn(0), dt_bias=randn(0, K), initial_state=None,
        )
        self.assertRejects(self.fwd(**d), "q", """kda.fwd: q must have at least one head (dim 2), got shape [2, 5, 0, 4]""")

    def test_k_shape(self):
        self.assertRejects(self.fwd(k=randn(B, T + 1, H, K)), "k", """kda.fwd: k must have the shape of q [2, 5, 3, 4], got [2, 6, 3, 4]""")

    def test_g_shape(self):
        self.assertRejects(self.fwd(g=randn(B, T, H, K + 1)), "g", """kda.fwd: g must have shape [B, T, HV, K] with K = 4 at dim 3, got shape [2, 5, 3, 5]""")

    def test_v_batch(self):
        self.assertRejects(self.fwd(v=randn(B + 1, T, H, V)), "v", """kda.fwd: v must have shape [B, T, HV, V] with B = 2 at dim 0, got shape [3, 5, 3, 6]""")

    def test_v_length(self):
        self.assertRejects(self.fwd(v=randn(B, T - 1, H, V)), "v", """kda.fwd: v must have shape [B, T, HV, V] with T = 5 at dim 1, got shape [2, 4, 3, 6]""")

    def test_v_heads(self):
        self.assertRejects(self.fwd(v=randn(B, T, H + 1, V)), "v", """kda.fwd: v must have a number of heads HV (dim 2) that is a multiple of q's H = 3 (value head j uses query/key head j // (HV / H)), got shape [2, 5, 4, 6]""")

    def test_beta_batch(self):
        self.assertRejects(self.fwd(beta=randn(1, T, H)), "beta", """kda.fwd: beta must have shape [B, T, HV] with B = 2 at dim 0, got shape [1, 5, 3]""")

    def test_beta_length(self):
        self.assertRejects(self.fwd(beta=randn(B, T + 2, H)), "beta", """kda.fwd: beta must have shape [B, T, HV] with T = 5 at dim 1, got shape [2, 7, 3]""")

    def test_beta_heads(self):
        self.assertRejects(self.fwd(beta=randn(B, T, 1)), "beta", """kda.fwd: beta must have shape [B, T, HV] with HV = 3 at dim 2, got shape [2, 5, 1]""")

    def test_A_log_heads(self):
        self.assertRejects(self.fwd(A_log=randn(H + 1)), "A_log", """kda.fwd: A_log must have shape [HV] with HV = 3 at dim 0, got shape [4]""")

    def test_dt_bias_heads(self):
        self.assertRejects(self.fwd(dt_bias=randn(H - 1, K)), "dt_bias", """kda.fwd: dt_bias must have shape [HV, K] with HV = 3 at dim 0, got shape [2, 4]""")

    def test_dt_bias_head_size(self):
        self.assertRejects(self.fwd(dt_bias=randn(H, V)), "dt_bias", """kda.fwd: dt_bias must have shape [HV, K] with K = 4 at dim 1, got shape [3, 6]""")

    def test_initial_state_sequences(self):
        self.assertRejects(self.fwd(initial_state=randn(B + 1, H, V, K)), "initial_state", """kda.fwd: initial_state must have shape [N, HV, V, K] with N = 2 at dim 0, got shape [3, 3, 6, 4]""")

    def test_initial_state_heads(self):
        self.assertRejects(self.fwd(initial_state=randn(B, 1, V, K)), "initial_state", """kda.fwd: initial_state must have shape [N, HV, V, K] with HV = 3 at dim 1, got shape [2, 1, 6, 4]""")

    def test_initial_state_k_first_layout(self):
        # The classic mistake: a K-first [N, H, K, V] state instead of V-first.
        self.assertRejects(self.fwd(initial_state=randn(B, H, K, V)), "initial_state", """kda.fwd: initial_state must have shape [N, HV, V, K] with V = 6 at dim 2, got shape [2, 3, 4, 6]""")

    def test_initial_state_head_size(self):
        self.assertRejects(self.fwd(initial_state=randn(B, H, V, K + 1)), "initial_state", """kda.fwd: initial_state must have shape [N, HV, V, K] with K = 4 at dim 3, got shape [2, 3, 6, 5]""")

    def test_initial_state_sequences_varlen(self):
        # With cu_seqlens, N is len(cu_seqlens) - 1, not B.
        self.assertRejects(self.fwd_varlen(initial_state=randn(1, H, V, K)), "initial_state", """kda.fwd: initial_state must have shape [N, HV, V, K] with N = 3 at dim 0, got shape [1, 3, 6, 4]""")

    def test_cu_seqlens_with_batch(self):
        cu = torch.tensor([0, 2, 5])
        self.assertRejects(self.fwd(cu_seqlens=cu, initial_state=None), "cu_seqlens", """kda.fwd: q must have batch size B = 1 when cu_seqlens is given (sequences are packed along T), got shape [2, 5, 3, 4]""")

    def test_cu_seqlens_empty(self):
        cu = torch.zeros(0, dtype=torch.int64)
        self.assertRejects(self.fwd_varlen(cu_seqlens=cu, initial_state=None), "cu_seqlens", """kda.fwd: cu_seqlens must hold at least one offset (N + 1 >= 1), got shape [0]""")

    def test_out_batch(self):
        self.assertRejects(self.fwd_(out=randn(B + 1, T, H, V)), "out", """kda.fwd_: out must have shape [B, T, HV, V] with B = 2 at dim 0, got shape [3, 5, 3, 6]""")

    def test_out_length(self):
        self.assertRejects(self.fwd_(out=randn(B, T + 1, H, V)), "out", """kda.fwd_: out must have shape [B, T, HV, V] with T = 5 at dim 1, got shape [2, 6, 3, 6]""")

    def test_out_heads(self):
        self.assertRejects(self.fwd_(out=randn(B, T, H - 1, V)), "out", """kda.fwd_: out must have shape [B, T, HV, V] with HV = 3 at dim 2, got shape [2, 5, 2, 6]""")

    def test_out_head_size(self):
        self.assertRejects(self.fwd_(out=randn(B, T, H, K)), "out", """kda.fwd_: out must have shape [B, T, HV, V] with V = 6 at dim 3, got shape [2, 5, 3, 4]""")

    def test_out_internal_overlap(self):
        # An expanded `out` would make several outputs share one element: it must be
        # rejected up front with a message naming `out` (no snapshot until it is).
        out = torch.zeros(1, 1, 1, V).expand(B, T, H, V)
        with self.assertRaises(RuntimeError) as cm:
            torch.ops.kda.fwd_(**fwd_inplace_args(out=out))
        msg = str(cm.exception)
        self.assertTrue(names_argument(msg, "out"), f"'out' not named in: {msg}")

    def test_final_state_internal_overlap(self):
        final_state = torch.zeros(1, 1, 1, 1).expand(B, H, V, K)
        with self.assertRaises(RuntimeError) as cm:
            torch.ops.kda.fwd_(**fwd_inplace_args(final_state=final_state))
        msg = str(cm.exception)
        self.assertTrue(names_argument(msg, "final_state"), f"'final_state' not named in: {msg}")

    def test_out_overlaps_final_state(self):
        # One element shared: each output element must be written once, by one of them.
        n_out = B * T * H * V
        buf = torch.full((n_out + B * H * V * K - 1,), float("nan"))
        out, final_state = buf[:n_out].view(B, T, H, V), buf[n_out - 1 :].view(B, H, V, K)
        self.assertRejects(self.fwd_(out=out, final_state=final_state), "final_state", """kda.fwd_: out and final_state must not share memory (each element is written once, by one of them)""")

    def test_final_state_sequences(self):
        self.assertRejects(self.fwd_(final_state=randn(B - 1, H, V, K)), "final_state", """kda.fwd_: final_state must have shape [N, HV, V, K] with N = 2 at dim 0, got shape [1, 3, 6, 4]""")

    def test_final_state_heads(self):
        self.assertRejects(self.fwd_(final_state=randn(B, H + 1, V, K)), "final_state", """kda.fwd_: final_state must have shape [N, HV, V, K] with HV = 3 at dim 1, got shape [2, 4, 6, 4]""")

    def test_final_state_k_first_layout(self):
        self.assertRejects(self.fwd_(final_state=randn(B, H, K, V)), "final_state", """kda.fwd_: final_state must have shape [N, HV, V, K] with V = 6 at dim 2, got shape [2, 3, 4, 6]""")

    def test_final_state_head_size(self):
        self.assertRejects(self.fwd_(final_state=randn(B, H, V, K - 1)), "final_state", """kda.fwd_: final_state must have shape [N, HV, V, K] with K = 4 at dim 3, got shape [2, 3, 6, 3]""")

    def test_final_state_sequences_varlen(self):
        self.assertRejects(self.fwd_(varlen=True, final_state=randn(B, H, V, K)), "final_state", """kda.fwd_: final_state must have shape [N, HV, V, K] with N = 3 at dim 0, got shape [2, 3, 6, 4]""")

    def test_grad_out_batch(self):
        self.assertRejects(self.bwd(grad_out=randn(B + 1, T, H, V)), "grad_out", """kda.bwd: grad_out must have shape [B, T, HV, V] with B = 2 at dim 0, got shape [3, 5, 3, 6]""")

    def test_grad_out_length(self):
        self.assertRejects(self.bwd(grad_out=randn(B, T - 1, H, V)), "grad_out", """kda.bwd: grad_out must have shape [B, T, HV, V] with T = 5 at dim 1, got shape [2, 4, 3, 6]""")

    def test_grad_out_heads(self):
        self.assertRejects(self.bwd(grad_out=randn(B, T, H + 1, V)), "grad_out", """kda.bwd: grad_out must have shape [B, T, HV, V] with HV = 3 at dim 2, got shape [2, 5, 4, 6]""")

    def test_grad_out_head_size(self):
        self.assertRejects(self.bwd(grad_out=randn(B, T, H, K)), "grad_out", """kda.bwd: grad_out must have shape [B, T, HV, V] with V = 6 at dim 3, got shape [2, 5, 3, 4]""")

    def test_grad_final_state_sequences(self):
        self.assertRejects(self.bwd(grad_final_state=randn(B + 1, H, V, K)), "grad_final_state", """kda.bwd: grad_final_state must have shape [N, HV, V, K] with N = 2 at dim 0, got shape [3, 3, 6, 4]""")

    def test_grad_final_state_heads(self):
        self.assertRejects(self.bwd(grad_final_state=randn(B, H - 1, V, K)), "grad_final_state", """kda.bwd: grad_final_state must have shape [N, HV, V, K] with HV = 3 at dim 1, got shape [2, 2, 6, 4]""")

    def test_grad_final_state_k_first_layout(self):
        self.assertRejects(self.bwd(grad_final_state=randn(B, H, K, V)), "grad_final_state", """kda.bwd: grad_final_state must have shape [N, HV, V, K] with V = 6 at dim 2, got shape [2, 3, 4, 6]""")

    def test_grad_final_state_head_size(self):
        self.assertRejects(self.bwd(grad_final_state=randn(B, H, V, V)), "grad_final_state", """kda.bwd: grad_final_state must have shape [N, HV, V, K] with K = 4 at dim 3, got shape [2, 3, 6, 6]""")


class TestCuSeqlensContents(ErrorTestCase):
    # The varlen base packs lengths [2, 0, 3]: T = 5.
    def test_not_starting_at_zero(self):
        self.assertRejects(self.fwd_varlen(cu_seqlens=torch.tensor([1, 2, 2, 5])), "cu_seqlens", """kda.fwd: cu_seqlens must start at 0, got cu_seqlens[0] = 1""")

    def test_decreasing(self):
        self.assertRejects(self.fwd_varlen(cu_seqlens=torch.tensor([0, 3, 2, 5])), "cu_seqlens", """kda.fwd: cu_seqlens must be non-decreasing, got cu_seqlens[2] = 2 < cu_seqlens[1] = 3""")

    def test_negative(self):
        self.assertRejects(self.fwd_varlen(cu_seqlens=torch.tensor([0, -1, 2, 5])), "cu_seqlens", """kda.fwd: cu_seqlens must be non-decreasing, got cu_seqlens[1] = -1 < cu_seqlens[0] = 0""")

    def test_ending_before_T(self):
        self.assertRejects(self.fwd_varlen(cu_seqlens=torch.tensor([0, 2, 2, 4])), "cu_seqlens", """kda.fwd: cu_seqlens must end at the number of tokens T = 5, got cu_seqlens[-1] = 4""")

    def test_ending_after_T(self):
        cu = torch.tensor([0, 2, 2, 6], dtype=torch.int32)
        self.assertRejects(self.fwd_varlen(cu_seqlens=cu), "cu_seqlens", """kda.fwd: cu_seqlens must end at the number of tokens T = 5, got cu_seqlens[-1] = 6""")

    def test_inplace_checks_contents(self):
        cu = torch.tensor([0, 2, 2, 7])
        self.assertRejects(self.fwd_(varlen=True, cu_seqlens=cu), "cu_seqlens", """kda.fwd_: cu_seqlens must end at the number of tokens T = 5, got cu_seqlens[-1] = 7""")

    def test_backward_checks_contents(self):
        d = make_inputs(H=H, K=K, V=V, seqlens=[2, 3])
        grad_out = torch.randn(1, 5, H, V)
        cu = torch.tensor([0, 3, 1])

        def call():
            torch.ops.kda.bwd(grad_out, None, *(d[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")),
                              cu_seqlens=cu)

        self.assertRejects(call, "cu_seqlens", """kda.bwd: cu_seqlens must be non-decreasing, got cu_seqlens[2] = 1 < cu_seqlens[1] = 3""")

    def test_inplace_rejects_before_writing(self):
        args = fwd_inplace_args(varlen=True, cu_seqlens=torch.tensor([0, 2, 2, 9]))
        with self.assertRaises(RuntimeError):
            torch.ops.kda.fwd_(**args)
        self.assertTrue(args["out"].isnan().all())
        self.assertTrue(args["final_state"].isnan().all())


class TestScalars(ErrorTestCase):
    def test_scale_nan_op(self):
        self.assertRejects(self.fwd(scale=math.nan), "scale", """kda.fwd: scale must be a finite number, got nan""")

    def test_scale_inf_op(self):
        self.assertRejects(self.fwd(scale=math.inf), "scale", """kda.fwd: scale must be a finite number, got inf""")

    def test_scale_minus_inf_inplace_op(self):
        self.assertRejects(self.fwd_(scale=-math.inf), "scale", """kda.fwd_: scale must be a finite number, got -inf""")

    def test_scale_nan_bwd_op(self):
        self.assertRejects(self.bwd(scale=math.nan), "scale", """kda.bwd: scale must be a finite number, got nan""")

    def test_lower_bound_zero_op(self):
        self.assertRejects(self.fwd(lower_bound=0.0), "lower_bound", """kda.fwd: lower_bound must be a finite negative number (or None for the softplus gate), got 0""")

    def test_lower_bound_positive_op(self):
        self.assertRejects(self.fwd(lower_bound=0.5), "lower_bound", """kda.fwd: lower_bound must be a finite negative number (or None for the softplus gate), got 0.5""")

    def test_lower_bound_nan_op(self):
        self.assertRejects(self.fwd(lower_bound=math.nan), "lower_bound", """kda.fwd: lower_bound must be a finite negative number (or None for the softplus gate), got nan""")

    def test_lower_bound_minus_inf_op(self):
        self.assertRejects(self.fwd(lower_bound=-math.inf), "lower_bound", """kda.fwd: lower_bound must be a finite negative number (or None for the softplus gate), got -inf""")

    def test_lower_bound_positive_inplace_op(self):
        self.assertRejects(self.fwd_(lower_bound=1.0), "lower_bound", """kda.fwd_: lower_bound must be a finite negative number (or None for the softplus gate), got 1""")

    def test_lower_bound_zero_bwd_op(self):
        self.assertRejects(self.bwd(lower_bound=0.0), "lower_bound", """kda.bwd: lower_bound must be a finite negative number (or None for the softplus gate), got 0""")


class TestPythonAPI(ErrorTestCase):
    @staticmethod
    def kda(**changes):
        args = fwd_args(**changes)
        pos = [args.pop(n) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
        return lambda: torch_kda.kda(*pos, **args)

    @staticmethod
    def drop_in(scale=None, lower_bound=-1.0):
        a = fwd_inplace_args()
        return lambda: torch_kda.fwd(
            a["q"], a["k"], a["v"], a["g"], a["beta"], scale, a["out"], a["A_log"], a["dt_bias"], lower_bound,
            initial_state=a["initial_state"], final_state=a["final_state"],
        )

    def test_scale_nan(self):
        self.assertRejects(self.kda(scale=math.nan), "scale", """torch_kda: scale must be finite, got nan""", exc=ValueError)

    def test_scale_inf(self):
        self.assertRejects(self.kda(scale=math.inf), "scale", """torch_kda: scale must be finite, got inf""", exc=ValueError)

    def test_scale_string(self):
        self.assertRejects(self.kda(scale="0.5"), "scale", """torch_kda: scale must be a real number or None, got str""", exc=TypeError)

    def test_scale_bool(self):
        self.assertRejects(self.kda(scale=True), "scale", """torch_kda: scale must be a real number or None, got bool""", exc=TypeError)

    def test_scale_tensor(self):
        self.assertRejects(self.kda(scale=torch.tensor(0.5)), "scale", """torch_kda: scale must be a real number or None, got Tensor""", exc=TypeError)

    def test_lower_bound_nan(self):
        self.assertRejects(self.kda(lower_bound=math.nan), "lower_bound", """torch_kda: lower_bound must be finite, got nan""", exc=ValueError)

    def test_lower_bound_minus_inf(self):
        self.assertRejects(self.kda(lower_bound=-math.inf), "lower_bound", """torch_kda: lower_bound must be finite, got -inf""", exc=ValueError)

    def test_lower_bound_zero(self):
        # Finite but out of range: rejected by the operator's own check.
        self.assertRejects(self.kda(lower_bound=0.0), "lower_bound", """kda.fwd: lower_bound must be a finite negative number (or None for the softplus gate), got 0""")

    def test_lower_bound_string(self):
        self.assertRejects(self.kda(lower_bound="-5"), "lower_bound", """torch_kda: lower_bound must be a real number or None, got str""", exc=TypeError)

    def test_output_final_state_not_bool(self):
        self.assertRejects(self.kda(output_final_state=1), "output_final_state", """torch_kda.kda: output_final_state must be a bool, got int""", exc=TypeError)

    def test_kda_reports_operator_errors(self):
        self.assertRejects(self.kda(k=randn(B, T, H, K + 1)), "k", """kda.fwd: k must have the shape of q [2, 5, 3, 4], got [2, 5, 3, 5]""")

    def test_drop_in_scale_nan(self):
        self.assertRejects(self.drop_in(scale=math.nan), "scale", """torch_kda: scale must be finite, got nan""", exc=ValueError)

    def test_drop_in_lower_bound_positive(self):
        self.assertRejects(self.drop_in(lower_bound=2.0), "lower_bound", """kda.fwd_: lower_bound must be a finite negative number (or None for the softplus gate), got 2""")

    def test_q_none(self):
        self.assertRejects(self.kda(q=None), "q", """kda.fwd: q must be a tensor, got None""")
