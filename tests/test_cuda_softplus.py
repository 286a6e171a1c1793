"""The softplus gate (lower_bound=None) on the CUDA kernels, against
the float64 token recurrence of conftest (reference_kda), fla's chunk_kda and
the composition promises (CUDA graphs, opcheck; torch.compile of both gates
is in test_cuda_graphs_compile.py).

The softplus gate is unbounded below: one token's log decay can be -1000 or
less, so these inputs hold tokens whose decay underflows to zero (the state
resets there) and tokens that do not decay at all, next to the model's usual
gate (A_log = log U(1, 16), dt_bias ~ N(0, 1)).

Every test but the CPU check of A_log needs a GPU (marked cuda: skipped where
there is none). The references run on the GPU, in float64.
"""
import math

import pytest
import torch

import torch_kda
from torch_kda.testing import forced
from conftest import INPUT_NAMES, capture_graph, fla_chunk_kda, make_inputs, nan_like, positional, rel, run_reference

DEV = "cuda"
D = 128  # K = V: the only size the CUDA kernels take
H = 4
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
STATE_DTYPES = pytest.mark.parametrize("state_dtype", [F32, BF16], ids=["fp32_state", "bf16_state"])
STATE_DTYPES_OR_NONE = pytest.mark.parametrize("state_dtype", [None, F32, BF16], ids=["no_state", "fp32_state", "bf16_state"])
GRAD_NAMES = INPUT_NAMES + ("initial_state",)

# Targets (relative L2 error against float64, over the whole tensor).
RANDOM_OUT_TOL = 5e-3  # out on random inputs with an fp32 state (or none)
TOL = 2e-2  # out and final state in any case with any state dtype; every gradient
FLA_GRAD_SLACK = 1.1  # each gradient's error at most this times fla's


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


def random_tokens(B, T, fraction):
    """A [B, T] mask of round(fraction * B * T) tokens drawn at random."""
    n = B * T
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n)[: round(fraction * n)]] = True
    return mask.view(B, T)


WEAK_DECAY_FRACTIONS = {"weak_decay_10": 0.1, "weak_decay_50": 0.5, "weak_decay_90": 0.9}


def raw_gate(case, B, T, heads):
    """g [B, T, H, K] in float64 for one of the gate cases."""
    g = torch.randn(B, T, heads, D, dtype=F64)
    if case == "strong_decay":
        # softplus(1000 + dt_bias) * exp(A_log) >= 1000: the decay underflows
        # to zero and the state restarts from that token on.
        g *= 10
        g[random_tokens(B, T, 0.5)] = 1000.0
    elif case in WEAK_DECAY_FRACTIONS:
        # softplus(-1000) underflows: these tokens keep the state as it is.
        g[random_tokens(B, T, WEAK_DECAY_FRACTIONS[case])] = -1000.0
    elif case == "extreme":
        # Raw gates up to +-1e4 in a quarter of the entries, mixed within tokens:
        # channels of one token that reset next to channels that never decay.
        wild = torch.rand(B, T, heads, D) < 0.25
        g[wild] = torch.empty(int(wild.sum()), dtype=F64).uniform_(-1e4, 1e4)
    else:
        assert case in ("random", "weak_decay_everywhere"), case
    return g


def softplus_inputs(case="random", *, B=1, T=0, seqlens=None, heads=H, state_dtype=F32, cu_dtype=torch.int64):
    """bf16 inputs of the CUDA kernels' shape on DEV, with fp32 A_log and dt_bias of
    the softplus gate: A_log = log U(1, 16) (so exp(A_log) in [1, 16]) and dt_bias
    ~ N(0, 1), except where the case sets them. seqlens packs sequences (B = 1,
    cu_seqlens of cu_dtype). The initial state is N(0, 1) / sqrt(K): the size that
    a few of the updates k^ u^T build up."""
    if DEV == "cuda" and not torch_kda.cuda_built():
        pytest.skip("torch_kda was built without its CUDA kernels")
    d = make_inputs(B=B, T=T, H=heads, K=D, V=D, dtype=BF16, seqlens=seqlens, cu_dtype=cu_dtype)
    B, T = d["q"].shape[:2]
    d["g"] = raw_gate(case, B, T, heads).to(BF16)
    d["A_log"] = torch.empty(heads, dtype=F64).uniform_(1.0, 16.0).log().float()
    d["dt_bias"] = torch.randn(heads, D, dtype=F64).float()
    if case == "weak_decay_everywhere":
        # The specified weak decay for this gate: exp(-8) * softplus(~-8) ~ 1e-7, so
        # alpha ~ 1 at every token and the state sums the whole sequence.
        d["A_log"].fill_(-8.0)
        d["dt_bias"].fill_(-8.0)
    elif case == "extreme":
        d["A_log"] = torch.linspace(-10.0, 4.0, heads)
        d["dt_bias"].uniform_(-20.0, 20.0)
    if state_dtype is not None:
        N = B if seqlens is None else len(seqlens)
        d["initial_state"] = (torch.randn(N, heads, D, D, dtype=F64) * D**-0.5).to(state_dtype)
    return {name: (t.to(DEV) if t is not None else None) for name, t in d.items()}


def run(x, lower_bound=None, **kw):
    """torch_kda.kda on the inputs x, with the final state."""
    return torch_kda.kda(
        *positional(x), lower_bound=lower_bound, initial_state=x["initial_state"], output_final_state=True,
        cu_seqlens=x["cu_seqlens"], **kw,
    )


def errors(x, lower_bound=None):
    """out and final-state errors of torch_kda.kda against the float64 reference."""
    out, final = run(x, lower_bound)
    assert torch.isfinite(out.float()).all() and torch.isfinite(final.float()).all()
    ref_out, ref_final = run_reference(x, lower_bound=lower_bound)
    return rel(out, ref_out), rel(final, ref_final), out, final


def seqlens_of(cu):
    return [b - a for a, b in zip(cu, cu[1:])]


def cotangents(x):
    """Random weights of out and of the final state in a loss, exactly representable in
    bf16 so that no test blames the kernels for the rounding of its own cotangent."""
    N = x["initial_state"].shape[0]
    w_out = torch.randn(x["v"].shape, device=DEV).to(BF16).to(F64)
    w_final = torch.randn(N, x["q"].shape[2], D, D, device=DEV).to(BF16).to(F64)
    return w_out, w_final


def grads_of(forward, x, w_out, w_final, dtype=None):
    """Gradients of sum(out * w_out) + sum(final * w_final) with respect to the eight
    inputs of forward(inputs) -> (out, final), the inputs x cast to dtype if given."""
    leaves = {n: x[n].detach().to(dtype or x[n].dtype).clone().requires_grad_() for n in GRAD_NAMES}
    out, final = forward({**x, **leaves})
    assert torch.isfinite(out.float()).all() and torch.isfinite(final.float()).all()
    loss = (out.to(F64) * w_out).sum() + (final.to(F64) * w_final).sum()
    return dict(zip(GRAD_NAMES, torch.autograd.grad(loss, [leaves[n] for n in GRAD_NAMES])))


def reference_grads(x, w_out, w_final, lower_bound=None):
    return grads_of(lambda y: run_reference(y, lower_bound=lower_bound), x, w_out, w_final, dtype=F64)


# --------------------------------------------------------------------------
# Forward accuracy
# --------------------------------------------------------------------------

RANDOM_T = [63, 160, 500, 1000, 1024, 1500, 2048]
HARD_CASES = ["strong_decay", "weak_decay_10", "weak_decay_50", "weak_decay_90", "weak_decay_everywhere"]
VARLEN_CU = [
    [0, 15],
    [0, 256, 500, 1000],
    [0, 15, 100, 300, 1200, 2000],
    pytest.param([0, 100, 300, 1200, 3000, 4096], marks=pytest.mark.slow),
    pytest.param([0, 8192], marks=pytest.mark.slow),
]


@pytest.mark.cuda
@STATE_DTYPES
@pytest.mark.parametrize("T", RANDOM_T)
def test_random_accuracy(T, state_dtype):
    # Two batch rows where the token-by-token reference is cheap.
    x = softplus_inputs(B=2 if T < 1024 else 1, T=T, state_dtype=state_dtype)
    e_out, e_state, out, final = errors(x)
    print(f"\nrandom T={T} {state_dtype}: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert out.dtype == BF16 and final.dtype == state_dtype
    assert e_out <= (RANDOM_OUT_TOL if state_dtype == F32 else TOL)
    assert e_state <= TOL


@pytest.mark.cuda
@STATE_DTYPES
@pytest.mark.parametrize("case", HARD_CASES)
def test_hard_case_accuracy(case, state_dtype):
    # 1500 tokens: a partial last chunk, for chunks of 16, 32 or 64.
    x = softplus_inputs(case, T=1500, state_dtype=state_dtype)
    e_out, e_state, _, _ = errors(x)
    print(f"\n{case} T=1500 {state_dtype}: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= TOL
    assert e_state <= TOL


@pytest.mark.cuda
@STATE_DTYPES
@pytest.mark.parametrize("cu_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("cu", VARLEN_CU, ids=lambda cu: "cu" + "-".join(map(str, cu)))
def test_varlen_accuracy(cu, cu_dtype, state_dtype):
    x = softplus_inputs(seqlens=seqlens_of(cu), cu_dtype=cu_dtype, state_dtype=state_dtype)
    assert x["cu_seqlens"].tolist() == cu and x["cu_seqlens"].dtype == cu_dtype
    e_out, e_state, _, _ = errors(x)
    print(f"\ncu_seqlens {cu} {cu_dtype} {state_dtype}: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= (RANDOM_OUT_TOL if state_dtype == F32 else TOL)
    assert e_state <= TOL


@pytest.mark.cuda
@STATE_DTYPES
def test_empty_sequences_pass_state_through(state_dtype):
    seqlens = [0, 15, 0, 85, 0, 257, 0]
    x = softplus_inputs("strong_decay", seqlens=seqlens, state_dtype=state_dtype)
    e_out, e_state, _, final = errors(x)
    assert e_out <= TOL and e_state <= TOL
    for n, length in enumerate(seqlens):
        assert torch.equal(final[n], x["initial_state"][n]) == (length == 0), n


@pytest.mark.cuda
@STATE_DTYPES_OR_NONE
@pytest.mark.parametrize("T", [1, 15, 17, 100])
def test_fixed_length_odd_T(T, state_dtype):
    x = softplus_inputs(B=3, T=T, heads=2, state_dtype=state_dtype)
    out, final = run(x)
    ref_out, ref_final = run_reference(x)
    assert rel(out, ref_out) <= (TOL if state_dtype == BF16 else RANDOM_OUT_TOL)
    assert rel(final, ref_final) <= TOL


@pytest.mark.cuda
@STATE_DTYPES_OR_NONE
def test_T_zero_passes_state_through(state_dtype):
    x = softplus_inputs(B=2, T=0, heads=2, state_dtype=state_dtype)
    out, final = run(x)
    assert out.shape == (2, 0, 2, D)
    if state_dtype is None:
        assert final.dtype == F32 and torch.equal(final, torch.zeros(2, 2, D, D, device=DEV))
    else:
        assert torch.equal(final, x["initial_state"])


@pytest.mark.cuda
def test_without_final_state_and_given_scale():
    x = softplus_inputs(B=1, T=70, heads=2, state_dtype=None)
    out, final = torch_kda.kda(*positional(x))
    assert final is None
    assert rel(out, run_reference(x)[0]) <= RANDOM_OUT_TOL
    out, _ = torch_kda.kda(*positional(x), scale=0.3)
    assert rel(out, run_reference(x, scale=0.3)[0]) <= RANDOM_OUT_TOL


@pytest.mark.cuda
@STATE_DTYPES_OR_NONE
def test_inplace_fwd_writes_every_element(state_dtype):
    """torch_kda.fwd (kda::fwd_) into NaN-poisoned buffers; a guard slice after
    final_state shows any write past its end; the inputs stay as they were."""
    x = softplus_inputs("strong_decay", seqlens=[3, 16, 0, 45], heads=2, state_dtype=state_dtype)
    out = torch.full((1, 64, 2, D), float("nan"), dtype=BF16, device=DEV)
    guard = torch.full((5, 2, D, D), float("nan"), dtype=state_dtype or F32, device=DEV)
    final = guard[:4]
    before = {n: x[n].clone() for n in GRAD_NAMES if x[n] is not None}
    ret = torch_kda.fwd(*positional(x)[:5], None, out, x["A_log"], x["dt_bias"], None,
                        initial_state=x["initial_state"], final_state=final, cu_seqlens=x["cu_seqlens"])
    assert ret is None
    assert torch.isnan(guard[4]).all(), "written past the end of final_state"
    assert torch.isfinite(out.float()).all() and torch.isfinite(final.float()).all()
    ref_out, ref_final = run_reference(x)
    assert rel(out, ref_out) <= TOL and rel(final, ref_final) <= TOL
    for n, t in before.items():
        assert torch.equal(t, x[n]), f"{n} was modified"


@pytest.mark.cuda
def test_varlen_equals_separate_calls_bitwise():
    """Each sequence alone gives bitwise the varlen batch's result: the padding rows
    of a partial chunk (their gates can reset or freeze the state as well as any)
    never reach the next sequence. One block shape, forced, for both calls: across
    shapes the low bits may differ."""
    x = softplus_inputs("strong_decay", seqlens=[5, 16, 0, 31, 1, 47], heads=2)
    with forced(recurrence_block="4x4"):
        out, final = run(x)
        cu = x["cu_seqlens"].tolist()
        for n in range(len(cu) - 1):
            s, e = cu[n], cu[n + 1]
            part = {**x, **{name: x[name][:, s:e] for name in ("q", "k", "v", "g", "beta")},
                    "initial_state": x["initial_state"][n : n + 1], "cu_seqlens": None}
            o, f = run(part)
            assert torch.equal(o, out[:, s:e]), n
            assert torch.equal(f[0], final[n]), n


# --------------------------------------------------------------------------
# Causality: out[:, :P] never depends on tokens t >= P, also through a gate
# that later resets the state (exp of a huge cumulative decay) or freezes it.
# --------------------------------------------------------------------------


def perturbation(name, shape):
    if name == "g":
        return (1000 * torch.randn(shape, device=DEV)).to(BF16)  # +-1000s: resets and frozen tokens
    return (4 * torch.randn(shape, device=DEV)).to(BF16)


@pytest.mark.cuda
@STATE_DTYPES
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
@pytest.mark.parametrize("P", [37, 48], ids=["inside_chunk", "chunk_edge"])
def test_causality_bitwise(P, lower_bound, state_dtype):
    x = softplus_inputs(B=2, T=100, heads=2, state_dtype=state_dtype)
    out, _ = run(x, lower_bound)
    assert torch.isfinite(out.float()).all()
    for name in ("q", "k", "v", "g", "beta"):
        changed = x[name].clone()
        changed[:, P:] = perturbation(name, changed[:, P:].shape)
        out2, _ = run({**x, name: changed}, lower_bound)
        assert torch.equal(out2[:, :P], out[:, :P]), name
        assert not torch.equal(out2[:, P:], out[:, P:]), f"perturbing {name} changed nothing"


@pytest.mark.cuda
@STATE_DTYPES
@pytest.mark.parametrize("P", [37, 40, 47], ids=["row_5", "row_8", "row_15"])
def test_causality_across_the_factoring_switch(P, state_dtype):
    """K1 forms a row's products by exp(G_i) exp(-G_j) while the chunk has decayed
    little up to that row and level by level after (a choice per row, by tokens
    <= i): a huge decay after P switches the rows after it, never those before."""
    x = softplus_inputs(B=2, T=64, heads=2, state_dtype=state_dtype)
    # A_log, dt_bias ~ U(0, 1): a chunk decays by far less than 2^-100.
    x["A_log"] = torch.rand_like(x["A_log"])
    x["dt_bias"] = torch.rand_like(x["dt_bias"])
    out, _ = run(x)
    g = x["g"].clone()
    g[:, P:] = 1000.0  # lambda <= -1000 from P on: the rows after P take the levels
    out2, _ = run({**x, "g": g})
    assert torch.equal(out2[:, :P], out[:, :P])
    assert not torch.equal(out2[:, P:], out[:, P:])
    want, _ = run_reference({**x, "g": g}, lower_bound=None)
    assert rel(out2, want) <= TOL


# --------------------------------------------------------------------------
# Gradients (torch_kda.kda's autograd: kda::_fwd_checkpointed, then kda::bwd)
# --------------------------------------------------------------------------

GRAD_CASES = {
    "random_T63": dict(B=2, T=63),
    "random_T500": dict(B=2, T=500),
    "random_T500_bf16_state": dict(B=2, T=500, state_dtype=BF16),
    "random_T1024": dict(T=1024),
    "strong_decay": dict(case="strong_decay", T=1000),
    "weak_decay_50": dict(case="weak_decay_50", T=1000),
    "varlen": dict(seqlens=seqlens_of([0, 15, 100, 300, 1200, 2000])),
}
SLOW_GRAD_CASES = ("random_T1024", "varlen")  # the reference's autograd over 1024 tokens and more


@pytest.mark.cuda
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_GRAD_CASES else n for n in GRAD_CASES]
)
def test_gradients_match_reference(name):
    x = softplus_inputs(**GRAD_CASES[name])
    w_out, w_final = cotangents(x)
    got = grads_of(run, x, w_out, w_final)
    want = reference_grads(x, w_out, w_final)
    for n in GRAD_NAMES:
        assert got[n].shape == x[n].shape and got[n].dtype == x[n].dtype, n
        assert torch.isfinite(got[n]).all(), n
        e = rel(got[n], want[n])
        print(f"\n{name} d{n}: rel {e:.2e}", end="")
        assert e <= TOL, f"d{n}: rel {e:.2e}"


@pytest.mark.cuda
@STATE_DTYPES
def test_backward_without_forward_checkpoints_is_bitwise(state_dtype):
    """kda::bwd called directly, recomputing the chunk states and records that the
    autograd keeps from the forward, gives the same gradients bit for bit."""
    x = softplus_inputs("weak_decay_50", seqlens=[37, 0, 100, 16], heads=3, state_dtype=state_dtype)
    w_out, w_final = cotangents(x)
    got = grads_of(run, x, w_out, w_final)
    # The cotangents as the autograd hands them over: in out's and the state's dtype.
    direct = torch.ops.kda.bwd(w_out.to(BF16), w_final.to(state_dtype), *positional(x), lower_bound=None,
                               initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    for n, t in zip(GRAD_NAMES, direct):
        assert torch.equal(t, got[n]), n


# --------------------------------------------------------------------------
# Extreme finite inputs: finite outputs and gradients, and still the reference's
# --------------------------------------------------------------------------


@pytest.mark.cuda
@STATE_DTYPES
def test_extreme_inputs_stay_finite(state_dtype):
    # Raw gates in [-1e4, 1e4], dt_bias in [-20, 20], A_log from -10 to 4.
    x = softplus_inputs("extreme", T=300, state_dtype=state_dtype)
    w_out, w_final = cotangents(x)
    out, final = run(x)
    ref_out, ref_final = run_reference(x)
    got = grads_of(run, x, w_out, w_final)
    want = reference_grads(x, w_out, w_final)
    results = [("out", out, ref_out), ("final_state", final, ref_final)]
    results += [("d" + n, got[n], want[n]) for n in GRAD_NAMES]
    for name, t, ref in results:
        assert torch.isfinite(t.float()).all(), name
        if torch.linalg.vector_norm(ref).item() > 0:
            e = rel(t, ref)
            print(f"\nextreme {state_dtype} {name}: rel {e:.2e}", end="")
            assert e <= TOL, f"{name}: rel {e:.2e}"


# --------------------------------------------------------------------------
# Against fla's chunk_kda with the same gate
# --------------------------------------------------------------------------

FLA_CASES = {
    "random_T1024": dict(B=2, T=1024),
    "random_T2048": dict(T=2048),
    "strong_decay": dict(case="strong_decay", T=1500),
    "weak_decay_50": dict(case="weak_decay_50", T=1500),
    "varlen": dict(seqlens=seqlens_of([0, 15, 100, 300, 1200, 2000])),
}


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("name", list(FLA_CASES))
def test_bf16_state_no_worse_than_fla(name):
    """With a bf16 state (bf16 products, as fla's), out and the final state are as
    close to float64 as fla's chunk_kda's on the same inputs. fla needs its state in
    fp32 and returns it in fp32; the bf16 state is compared with fla's rounded to
    bf16, since no bf16 tensor is closer than its own rounding (~1.6e-3 of the
    2.7e-3 both reach). The same inputs with an fp32 state must beat fla's fp32
    state as it is."""
    x = softplus_inputs(state_dtype=BF16, **FLA_CASES[name])
    fla_out, fla_final = fla_chunk_kda(x, None)
    out, final = run(x)
    ref_out, ref_final = run_reference(x)
    e_out, e_state = rel(out, ref_out), rel(final, ref_final)
    f_out, f_state = rel(fla_out, ref_out), rel(fla_final, ref_final)
    f_state_bf16 = rel(fla_final.to(BF16), ref_final)
    _, final32 = run({**x, "initial_state": x["initial_state"].float()})
    e_state32 = rel(final32, ref_final)
    print(f"\n{name}: torch_kda out {e_out:.2e} state {e_state:.2e} (fp32 state {e_state32:.2e}); "
          f"chunk_kda out {f_out:.2e} state {f_state:.2e} (rounded to bf16 {f_state_bf16:.2e})")
    if not (math.isfinite(f_out) and math.isfinite(f_state)):
        pytest.skip("fla's chunk_kda is not finite on these inputs: nothing to compare with")
    assert e_out <= f_out
    assert e_state <= f_state_bf16
    assert e_state32 <= f_state


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("case", ["random", "weak_decay_50"])
def test_gradients_no_worse_than_fla(case):
    """Each of the eight gradients (fp32 state, fla's dt_bias flat, its initial
    state fp32) within FLA_GRAD_SLACK of fla's own error against float64, with
    the same cotangents on out and the final state."""
    x = softplus_inputs(case, B=2, T=1024)
    w_out, w_final = cotangents(x)
    fla = grads_of(lambda y: fla_chunk_kda(y, None), x, w_out, w_final)
    ours = grads_of(run, x, w_out, w_final)
    want = reference_grads(x, w_out, w_final)
    for n in GRAD_NAMES:
        e, f = rel(ours[n], want[n]), rel(fla[n], want[n])
        print(f"\n{case} d{n}: torch_kda {e:.2e}, chunk_kda {f:.2e}", end="")
        assert e <= FLA_GRAD_SLACK * f, f"d{n}: rel {e:.2e} against fla's {f:.2e}"


# --------------------------------------------------------------------------
# Composition: CUDA graphs, opcheck
# --------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("window", [0, 3])
def test_cuda_graph_capture_and_replay(window):
    """window 3: the call runs in windows of 3 chunk slots, so the graph holds
    several launches of each kernel and the carry between them."""
    x = softplus_inputs(seqlens=[40, 0, 100, 17], heads=2)
    with forced(window_slots=window):
        out = torch.empty(1, 157, 2, D, dtype=BF16, device=DEV)
        final = torch.empty(4, 2, D, D, dtype=F32, device=DEV)

        def step():
            torch_kda.fwd(*positional(x)[:5], None, out, x["A_log"], x["dt_bias"], None,
                          initial_state=x["initial_state"], final_state=final, cu_seqlens=x["cu_seqlens"])

        graph, _ = capture_graph(step)
        for case, lengths in (("random", [40, 0, 100, 17]), ("strong_decay", [1, 60, 60, 36])):
            fresh = softplus_inputs(case, seqlens=lengths, heads=2)
            for name in GRAD_NAMES + ("cu_seqlens",):
                x[name].copy_(fresh[name])
            out.fill_(float("nan"))
            final.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            eager_out, eager_final = run(fresh)
            assert torch.equal(out, eager_out), case
            assert torch.equal(final, eager_final), case


@pytest.mark.cuda
def test_opcheck():
    """kda::fwd (also with inputs that want gradients: the autograd registration),
    kda::fwd_ into NaN-poisoned buffers and kda::bwd, all with lower_bound=None."""
    for kw, state in ((dict(seqlens=[10, 0, 33]), F32), (dict(B=2, T=21), BF16), (dict(B=2, T=21), None)):
        x = softplus_inputs(heads=2, state_dtype=state, **kw)
        init, cu = x["initial_state"], x["cu_seqlens"]
        fwd_kw = {"lower_bound": None, "initial_state": init, "output_final_state": True, "cu_seqlens": cu}
        torch.library.opcheck(torch.ops.kda.fwd.default, positional(x), fwd_kw)
        wanting = tuple(t.detach().clone().requires_grad_() for t in positional(x))
        init_wanting = init.detach().clone().requires_grad_() if init is not None else None
        torch.library.opcheck(torch.ops.kda.fwd.default, wanting, {**fwd_kw, "initial_state": init_wanting})

        out, final = torch.ops.kda.fwd(*positional(x), **fwd_kw)
        out_buf = torch.full_like(out, float("nan"))
        final_buf = torch.full_like(final, float("nan"))
        torch.library.opcheck(
            torch.ops.kda.fwd_.default, (*positional(x), out_buf, final_buf),
            {"lower_bound": None, "initial_state": init, "cu_seqlens": cu},
        )
        grad_final = torch.randn_like(final) if state is not None else None
        torch.library.opcheck(
            torch.ops.kda.bwd.default, (torch.randn_like(out), grad_final, *positional(x)),
            {"lower_bound": None, "initial_state": init, "cu_seqlens": cu},
        )


# --------------------------------------------------------------------------
# A_log whose exp overflows float32: the gate would be inf * 0 = NaN
# --------------------------------------------------------------------------


def call_op(op, x, out):
    """One of the three operators that take A_log, on the inputs x with the softplus
    gate; fwd_ writes out."""
    kw = dict(lower_bound=None, initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    if op == "fwd":
        torch.ops.kda.fwd(*positional(x), output_final_state=True, **kw)
    elif op == "fwd_":
        torch.ops.kda.fwd_(*positional(x), out, None, **kw)
    else:
        torch.ops.kda.bwd(torch.randn_like(out), None, *positional(x), **kw)


@pytest.mark.parametrize("op", ["fwd", "fwd_", "bwd"])
def test_A_log_overflowing_exp_is_rejected_on_cpu(op):
    """On the CPU always: reading A_log costs no device sync there."""
    x = make_inputs(B=1, T=20, H=2, K=8, V=8, dtype=F32, state_dtype=F32)
    x["A_log"][1] = 100.0  # exp(100) > 3.4e38, float32's largest
    out = nan_like(x["v"])
    with pytest.raises(RuntimeError, match="A_log"):
        call_op(op, x, out)
    assert torch.isnan(out).all(), "written before the check"


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["fwd", "fwd_", "bwd"])
def test_A_log_overflowing_exp_is_rejected_on_cuda_when_checked(op, monkeypatch):
    """On CUDA reading A_log is a device sync: checked under TORCH_KDA_CHECK=1."""
    x = softplus_inputs(B=1, T=40, heads=2)
    x["A_log"][1] = 100.0
    monkeypatch.setenv("TORCH_KDA_CHECK", "1")
    out = nan_like(x["v"])
    with pytest.raises(RuntimeError, match="A_log"):
        call_op(op, x, out)
    assert torch.isnan(out.float()).all(), "written before the check"
