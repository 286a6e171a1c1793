"""The configuration grid of the peer library fla's KDA tests, rebuilt here in
our own code, checked on our operator against the float64 token recurrence
(conftest's reference_kda).

fla tests its KDA at these shapes, head sizes, scales, gate strengths, masked
gates, packed sequences and dtypes; a user moving from fla can expect each of
them to work here too. Three families of rows:
  chunk      fixed-length batches, fp16 q/k/v/beta; a precomputed log decay
             (A_log = dt_bias = None) or the softplus gate computed in the op;
  varlen     sequences packed along T (B = 1, cu_seqlens), fp16, precomputed gate;
  recurrent  fixed-length batches in fp32, precomputed gate, forward only.
Every row carries an fp32 initial state ~ N(0, 1).

On the CPU every row runs, forward and (chunk, varlen) every gradient.
On CUDA the forward serves K and V up to 256 (on 64-, 128- and 256-wide
kernels, other sizes zero-padded), bf16 q/k/v/beta (and g, but for a
precomputed gate's fp32 one), fp32 A_log and dt_bias, lower_bound in [-5, 0) or
None. fla's rows are fp16 (or fp32), so none is served as given: each is also
run in bf16, and those are served. The rows it does not serve must be refused
by the host checks (csrc/cuda/staging.cpp, before any launch) with an error
naming the argument at fault. The chunk and varlen rows' gradients on CUDA in
bf16 against float64.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import torch_kda
from conftest import reference_kda, rel, requires_cuda, run_reference
from torch_kda.naive import sequence_bounds

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
TOKEN_NAMES = ("q", "k", "v", "g", "beta")
PARAM_NAMES = ("A_log", "dt_bias")


@dataclasses.dataclass(frozen=True)
class Row:
    family: str  # "chunk", "varlen" or "recurrent"
    H: int
    D: int  # K = V
    dtype: torch.dtype
    B: int = 1
    T: int = 0
    cu_seqlens: tuple = None  # varlen rows: B = 1, T = cu_seqlens[-1]
    scale: float = None  # None: the op's default D ** -0.5
    normalizer: float = 1.0  # the precomputed log decay is divided by it
    mask_p: float = 0.0  # each entry of the precomputed log decay zeroed with this probability
    gate_in_op: bool = False  # A_log and dt_bias given: the softplus gate computed in the op

    @property
    def tokens(self):
        return self.cu_seqlens[-1] if self.cu_seqlens else self.T

    @property
    def id(self):
        name = {F16: "fp16", BF16: "bf16", F32: "fp32"}[self.dtype]
        shape = f"cu{'-'.join(map(str, self.cu_seqlens))}" if self.cu_seqlens else f"B{self.B}-T{self.T}"
        gate = "gate_in_op" if self.gate_in_op else f"g_norm{self.normalizer:g}_mask{self.mask_p:g}"
        scale = "" if self.scale is None else f"-scale{self.scale:g}"
        return f"{self.family}-{shape}-H{self.H}-D{self.D}{scale}-{gate}-{name}"


def chunk(B, T, H, D, scale, normalizer, mask_p, gate_in_op):
    return Row("chunk", H, D, F16, B=B, T=T, scale=scale, normalizer=normalizer, mask_p=mask_p, gate_in_op=gate_in_op)


def varlen(H, D, mask_p, cu):
    return Row("varlen", H, D, F16, cu_seqlens=tuple(cu), mask_p=mask_p)


def recurrent(B, T, H, D, scale, normalizer):
    return Row("recurrent", H, D, F32, B=B, T=T, scale=scale, normalizer=normalizer)


# fla runs (4, 1024, 4, 128) twice, q and k L2-normalised once outside its kernel
# and once inside: our op always normalises them, so both are this one row.
CHUNK_ROWS = [
    chunk(1, 63, 1, 64, 1.0, 1.0, 0.0, False),
    chunk(2, 500, 3, 60, 1.0, 1.0, 0.0, False),
    chunk(2, 1000, 3, 64, 0.1, 1.0, 0.5, False),
    chunk(3, 1024, 4, 100, 1.0, 0.1, 0.0, False),
    chunk(4, 1024, 4, 128, 0.1, 1.0, 0.0, False),
    chunk(2, 1500, 4, 128, 0.1, 10.0, 0.0, True),
    chunk(4, 2048, 8, 64, 0.1, 1.0, 0.0, True),
]
VARLEN_ROWS = [
    varlen(4, 60, 0.0, [0, 15]),
    varlen(4, 64, 0.0, [0, 256, 500, 1000]),
    varlen(4, 128, 0.5, [0, 256, 500, 1000]),
    varlen(4, 100, 0.0, [0, 15, 100, 300, 1200, 2000]),
    varlen(4, 256, 0.0, [0, 100, 300, 1200, 3000, 4096]),
]
RECURRENT_ROWS = [
    recurrent(1, 64, 1, 64, 1.0, 1.0),
    recurrent(2, 512, 3, 60, 1.0, 1.0),
    recurrent(3, 1000, 4, 100, 0.1, 1.0),
    recurrent(4, 1024, 4, 128, 0.1, 1.0),
]
ALL_ROWS = CHUNK_ROWS + VARLEN_ROWS + RECURRENT_ROWS


def rows(rs):
    return pytest.mark.parametrize("row", rs, ids=[r.id for r in rs])


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


def precomputed_gate(row, shape):
    """logsigmoid(N(0, 1)) / normalizer, entries zeroed with probability mask_p.
    Kept in fp32, which the op takes for a precomputed gate whatever q's dtype, so
    that the decay, summed over the whole sequence, is not first rounded to fp16."""
    g = F.logsigmoid(torch.randn(shape)) / row.normalizer
    return g * (torch.rand(shape) >= row.mask_p)


def make_row_inputs(row, dtype=None):
    """Fresh random inputs of a row (q, k, v, g, beta, A_log, dt_bias, initial_state,
    cu_seqlens), q/k/v/beta (and g with the gate in the op) in dtype, else the row's."""
    dtype = row.dtype if dtype is None else dtype
    B, T, H, D = (1 if row.cu_seqlens else row.B), row.tokens, row.H, row.D
    N = len(row.cu_seqlens) - 1 if row.cu_seqlens else B
    tok = (B, T, H, D)
    x = {"cu_seqlens": torch.tensor(row.cu_seqlens, dtype=torch.int64) if row.cu_seqlens else None}
    if row.family == "varlen":
        x["q"] = torch.randn(tok).to(dtype)
        x["k"] = F.normalize(torch.randn(tok), dim=-1).to(dtype)
        x["v"] = torch.randn(tok).to(dtype)
        # Logits from U(0, 1): beta = sigmoid(logit) lies in (0.5, 0.73).
        x["beta"] = torch.rand(B, T, H).to(dtype)
    else:
        x["q"], x["k"], x["v"] = (torch.rand(tok).to(dtype) for _ in range(3))
        x["beta"] = torch.randn(B, T, H).to(dtype)  # logits: the op applies the sigmoid
    if row.gate_in_op:
        x["g"] = torch.randn(tok).to(dtype)
        x["A_log"] = torch.randn(H)
        x["dt_bias"] = torch.randn(H, D)
    else:
        x["g"] = precomputed_gate(row, tok)
        x["A_log"] = x["dt_bias"] = None
    x["initial_state"] = torch.randn(N, H, D, D)
    return x


def grad_names(x):
    return [n for n in TOKEN_NAMES + PARAM_NAMES + ("initial_state",) if x[n] is not None]


def run_ours(x, scale):
    return torch_kda.kda(*(x[n] for n in TOKEN_NAMES + PARAM_NAMES), scale=scale, lower_bound=None,
                         initial_state=x["initial_state"], output_final_state=True, cu_seqlens=x["cu_seqlens"])


def ours_with_grads(x, scale, do, dht):
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in grad_names(x)}
    y = {**x, **leaves}
    out, final = run_ours(y, scale)
    grads = torch.autograd.grad([out, final], list(leaves.values()), [do, dht])
    return out.detach(), final.detach(), dict(zip(leaves, grads))


# The reference's autograd keeps about three float64 [H, D, D] states per token:
# over a whole row that is up to ~25 GB (4,096 tokens at H = 4, D = 256), more than
# the test machines hold. So each sequence runs in segments of tokens, the state
# entering each found first without a graph, and the gradient is taken segment
# by segment from the last, each segment's state gradient handed to the one
# before: the same chain rule through the same reference, in bounded memory.
SEGMENT_BYTES = 1 << 28


def reference_with_grads(x, scale, do, dht, step=None):
    """out, final state and every input's gradient for the cotangents do, dht, all
    in float64 from reference_kda run on float64 copies of x, in segments of step
    tokens (by default as many as SEGMENT_BYTES holds)."""
    f = {n: (x[n].detach().to(F64) if isinstance(x[n], torch.Tensor) and x[n].is_floating_point() else x[n])
         for n in x}
    B, T, H, D = f["v"].shape
    if step is None:
        step = max(16, SEGMENT_BYTES // (3 * 8 * H * D * D))
    out = torch.zeros(B, T, H, D, dtype=F64)
    final = torch.zeros_like(f["initial_state"])
    grads = {n: torch.zeros_like(f[n]) for n in grad_names(f)}
    params = [n for n in PARAM_NAMES if f[n] is not None]
    for n, (b, start, end) in enumerate(sequence_bounds(B, T, f["cu_seqlens"])):
        cuts = list(range(start, end, step)) + [end]

        def segment(s, e, state, leaf=False):
            take = (lambda t: t.clone().requires_grad_(True)) if leaf else (lambda t: t)
            tokens = {m: take(f[m][b:b + 1, s:e]) for m in TOKEN_NAMES}
            shared = {m: take(f[m]) for m in params}
            state = take(state)
            o, S = reference_kda(*(tokens[m] for m in TOKEN_NAMES), shared.get("A_log"), shared.get("dt_bias"),
                                 scale=scale, lower_bound=None, initial_state=state)
            return o, S, {**tokens, **shared, "initial_state": state}

        states = [f["initial_state"][n:n + 1]]
        with torch.no_grad():
            for s, e in zip(cuts, cuts[1:]):
                states.append(segment(s, e, states[-1])[1])
        final[n] = states[-1][0]
        dS = dht[n:n + 1].to(F64)
        for i in reversed(range(len(cuts) - 1)):
            s, e = cuts[i], cuts[i + 1]
            o, S, leaves = segment(s, e, states[i], leaf=True)
            out[b, s:e] = o[0].detach()
            got = dict(zip(leaves, torch.autograd.grad([o, S], list(leaves.values()), [do[b:b + 1, s:e].to(F64), dS])))
            for m in TOKEN_NAMES:
                grads[m][b, s:e] = got[m][0]
            for m in params:
                grads[m] += got[m]
            dS = got["initial_state"]
        grads["initial_state"][n] = dS[0]
    return out, final, grads


# --------------------------------------------------------------------------
# The CPU: every row
# --------------------------------------------------------------------------

# Relative L2 error against float64 over the whole tensor, by the dtype the result
# is held in. The reference runs on the very inputs ours got (already rounded to
# fp16), and our CPU kernel accumulates in fp32: what is left is the rounding of
# the result itself. Rounding to fp16 alone costs ~2e-4 (2^-11 relative, spread
# over a binade), which is what out and the fp16 gradients measure on every row;
# fp32 results measure 1e-7 to 1.3e-6 (dA_log, a sum over every token and channel).
# Each bound is a few times that, still far below a wrong token or head: one
# (token, head) wrong by its own size among the 65,536 of the largest row moves
# the error by ~4e-3.
TOL = {F16: 1e-3, F32: 1e-5}


def check_row_with_grads(row, final_cotangent):
    x = make_row_inputs(row)
    do = torch.randn(x["v"].shape).to(row.dtype)
    dht = final_cotangent(x["initial_state"].shape)
    out, final, got = ours_with_grads(x, row.scale, do, dht)
    ref_out, ref_final, want = reference_with_grads(x, row.scale, do, dht)
    assert out.dtype == row.dtype and final.dtype == F32
    errors = {"out": rel(out, ref_out), "final_state": rel(final, ref_final)}
    for n in grad_names(x):
        assert got[n].shape == x[n].shape and got[n].dtype == x[n].dtype, n
        errors["d" + n] = rel(got[n], want[n])
    print(f"\n{row.id}: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()), end="")
    held = {"out": out.dtype, "final_state": final.dtype, **{"d" + n: got[n].dtype for n in got}}
    for n, e in errors.items():
        assert e <= TOL[held[n]], f"{n}: rel {e:.2e}"


@pytest.mark.slow
@rows(CHUNK_ROWS)
def test_chunk_row(row):
    check_row_with_grads(row, torch.randn)


@pytest.mark.slow
@rows(VARLEN_ROWS)
def test_varlen_row(row):
    check_row_with_grads(row, torch.rand)


@pytest.mark.slow
@rows(RECURRENT_ROWS)
def test_recurrent_row(row):
    x = make_row_inputs(row)
    out, final = run_ours(x, row.scale)
    with torch.no_grad():
        ref_out, ref_final = run_reference(x, scale=row.scale, lower_bound=None)
    assert out.dtype == F32 and final.dtype == F32
    e_out, e_state = rel(out, ref_out), rel(final, ref_final)
    print(f"\n{row.id}: out {e_out:.2e}, final_state {e_state:.2e}", end="")
    assert e_out <= TOL[F32]
    assert e_state <= TOL[F32]


@pytest.mark.parametrize("shape", [dict(B=2, T=37), dict(cu_seqlens=(0, 5, 40, 41))], ids=["fixed", "varlen"])
@pytest.mark.parametrize("gate_in_op", [False, True], ids=["precomputed", "gate_in_op"])
def test_segmented_reference_is_the_reference(shape, gate_in_op):
    """The segmented gradients above are those of one autograd pass through the
    reference over whole sequences (small enough here to hold its graph)."""
    row = Row("chunk", H=2, D=8, dtype=F64, scale=0.3, gate_in_op=gate_in_op, **shape)
    x = {n: (t.to(F64) if t is not None and t.is_floating_point() else t) for n, t in make_row_inputs(row).items()}
    do, dht = torch.randn(x["v"].shape, dtype=F64), torch.randn(x["initial_state"].shape, dtype=F64)
    out, final, got = reference_with_grads(x, row.scale, do, dht, step=16)
    leaves = {n: x[n].clone().requires_grad_(True) for n in grad_names(x)}
    ref_out, ref_final = run_reference({**x, **leaves}, scale=row.scale, lower_bound=None)
    want = torch.autograd.grad([ref_out, ref_final], list(leaves.values()), [do, dht])
    assert torch.allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    assert torch.allclose(final, ref_final, rtol=1e-12, atol=1e-12)
    for n, w in zip(leaves, want):
        assert torch.allclose(got[n], w, rtol=1e-10, atol=1e-12), n


# --------------------------------------------------------------------------
# CUDA: the rows it serves against the reference, the others refused
# --------------------------------------------------------------------------


def cuda_refusal(row, dtype):
    """None where the CUDA path serves the row with q/k/v/beta in dtype; else what the
    first of its refusals says, in the order csrc/cuda/staging.cpp checks. Served:
    bf16 inputs, K = V <= 256, the gate computed in the op (A_log and dt_bias fp32
    here) or precomputed (g fp32); every row's gate is the softplus one or
    unbounded (lower_bound None) and its state fp32, both served."""
    if dtype != BF16:
        return (r"on CUDA, q, k, v, g and beta must have dtype bfloat16 \(a precomputed gate's g also float32\), got "
                + str(dtype).removeprefix("torch."))
    return None


@pytest.mark.cuda
@requires_cuda
@pytest.mark.skipif(not torch_kda.cuda_built(), reason="needs a CUDA build of torch_kda")
@pytest.mark.parametrize("as_bf16", [False, True], ids=["as_fla", "bf16"])
@rows(ALL_ROWS)
def test_rows_on_cuda(row, as_bf16):
    """Each row as fla runs it (fp16 or fp32, which CUDA does not serve) and in bf16."""
    dtype = BF16 if as_bf16 else row.dtype
    x = {n: (t.cuda() if t is not None else None) for n, t in make_row_inputs(row, dtype).items()}
    refusal = cuda_refusal(row, dtype)
    if refusal is not None:
        with pytest.raises(RuntimeError, match=refusal):
            run_ours(x, row.scale)
        torch.cuda.synchronize()  # nothing was left running, or failing, behind the error
        return
    out, final = run_ours(x, row.scale)
    with torch.no_grad():
        ref_out, ref_final = run_reference(x, scale=row.scale, lower_bound=None)  # float64, on the GPU
    e_out, e_state = rel(out, ref_out), rel(final, ref_final)
    print(f"\n{row.id} in bf16 on CUDA: out {e_out:.2e}, final_state {e_state:.2e}", end="")
    assert out.dtype == BF16 and final.dtype == F32
    assert e_out <= 5e-3
    assert e_state <= 1e-4


# The CUDA backward's gradient names, in kda.bwd's order, by the inputs' names.
BWD_NAMES = TOKEN_NAMES + PARAM_NAMES + ("initial_state",)


def float64_cpu_grads(x, scale, do, dht):
    """kda.bwd on the CPU in float64 from the values of x (on any device)."""
    f = {n: (t.detach().cpu().double() if t.is_floating_point() else t.cpu()) if isinstance(t, torch.Tensor) else t
         for n, t in x.items()}
    grads = torch.ops.kda.bwd(do.cpu().double(), dht.cpu().double(), *(f[n] for n in TOKEN_NAMES + PARAM_NAMES),
                              scale=scale, lower_bound=None, initial_state=f["initial_state"],
                              cu_seqlens=f["cu_seqlens"])
    return dict(zip(BWD_NAMES, grads))


@pytest.mark.cuda
@requires_cuda
@pytest.mark.skipif(not torch_kda.cuda_built(), reason="needs a CUDA build of torch_kda")
@rows(CHUNK_ROWS + VARLEN_ROWS)
def test_row_gradients_on_cuda(row):
    """Each chunk and varlen row in bf16 through torch_kda.kda's autograd on CUDA
    (every input's gradient, the final state's cotangent too) against kda.bwd in
    float64 on the CPU, at the CUDA backward's tolerances (cuda_helpers.GRAD_TOL)."""
    from cuda_helpers import check_grads

    x = {n: (t.cuda() if t is not None else None) for n, t in make_row_inputs(row, BF16).items()}
    do = torch.randn(x["v"].shape, device="cuda").to(BF16)
    dht = torch.randn(x["initial_state"].shape, device="cuda")
    _, _, got = ours_with_grads(x, row.scale, do, dht)
    want = float64_cpu_grads(x, row.scale, do, dht)
    for n in got:
        assert got[n].shape == x[n].shape and got[n].dtype == x[n].dtype, n
    none = torch.empty(0)
    check_grads(row.id, [got.get(n, none) for n in BWD_NAMES], [want[n] for n in BWD_NAMES])
