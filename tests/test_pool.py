"""kda::fwd_pool_ (torch_kda.kda_pool), the state-pool call for serving, where no
GPU is needed: against the float64 reference over whole sequences and against a
plain Python reference of the slot rules (decode, varlen prefill, speculative
decoding, padding rows), pool rows that no index names left bit for bit, poisoned
buffers, every error message, opcheck and torch.compile."""
import expecttest
import pytest
import torch

import torch_kda
from conftest import make_inputs, positional, rel
from torch_kda.naive import kda_naive

F64 = torch.float64
GATES = [pytest.param(-5.0, id="bounded"), pytest.param(None, id="softplus")]


def pool_of(slots, H, V, K, dtype=F64):
    return torch.randn(slots, H, V, K, dtype=F64).to(dtype)


def naive_request(d, n, tokens, start_state, lower_bound):
    """One request's tokens [tokens] of d (B = requests or B = 1 packed) through the reference."""
    def part(x):
        return x[n : n + 1] if d["cu_seqlens"] is None else x[:, tokens]
    xs = [part(d[name]) for name in ("q", "k", "v", "g", "beta")]
    return kda_naive(*xs, d["A_log"], d["dt_bias"], lower_bound=lower_bound, initial_state=start_state[None])


def spec_reference(d, pool, indices, accepted, lower_bound):
    """The slot rule of speculative decoding, token by token: start from slot
    indices[n, accepted[n] - 1]; after token t, write slot indices[n, t] (when >= 0)."""
    pool = pool.clone().to(F64)
    B, T = d["q"].shape[:2]
    out = torch.zeros(d["v"].shape, dtype=F64)
    starts = [int(indices[n, int(accepted[n]) - 1]) for n in range(B)]
    start_states = [pool[s].clone() if s >= 0 else None for s in starts]
    for n in range(B):
        if starts[n] < 0:
            continue
        state = start_states[n]
        for t in range(T):
            o, state = naive_request({**{k: v[:, t : t + 1] for k, v in d.items() if k in ("q", "k", "v", "g", "beta")},
                                      "A_log": d["A_log"], "dt_bias": d["dt_bias"], "cu_seqlens": None},
                                     n, None, state, lower_bound)
            state = state[0]
            out[n, t] = o[0, 0]
            slot = int(indices[n, t])
            if slot >= 0:
                pool[slot] = state
    return out, pool


@pytest.mark.parametrize("lower_bound", GATES)
def test_decode_token_by_token_equals_the_prefill(lower_bound):
    """Requests decoded one token a step through slots of a pool (a random
    permutation of half of it, fp64) give the outputs and final states of the
    reference over their whole sequences; the other rows stay as they were."""
    N, T, H, K, V, slots = 3, 6, 2, 8, 5, 8
    d = make_inputs(B=N, T=T, H=H, K=K, V=V, dtype=F64, state_dtype=F64)
    slots_used = torch.randperm(slots)[:N]
    pool = pool_of(slots, H, V, K)
    pool[slots_used] = d["initial_state"]
    before = pool.clone()
    outs = []
    for t in range(T):
        x = {name: d[name][:, t : t + 1].contiguous() for name in ("q", "k", "v", "g", "beta")}
        outs.append(torch_kda.kda_pool(*(x[n] for n in ("q", "k", "v", "g", "beta")), d["A_log"], d["dt_bias"],
                                       pool, slots_used, lower_bound=lower_bound))
    ref_out, ref_final = kda_naive(*positional(d), lower_bound=lower_bound, initial_state=d["initial_state"])
    assert rel(torch.cat(outs, 1), ref_out) < 1e-12
    assert rel(pool[slots_used], ref_final) < 1e-12
    others = [s for s in range(slots) if s not in slots_used.tolist()]
    assert torch.equal(pool[others], before[others])


@pytest.mark.parametrize("lower_bound", GATES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_varlen_prefill_continues_from_the_slots(lower_bound, index_dtype):
    """A varlen batch (an empty request, odd lengths, a padding row) continues
    each request from its slot and leaves its final state there; the padding
    row's out is zero and the slot it would name is left alone."""
    seqlens = [5, 0, 17, 3]
    H, K, V, slots = 2, 8, 5, 9
    d = make_inputs(seqlens=seqlens, H=H, K=K, V=V, dtype=F64)
    pool = pool_of(slots, H, V, K)
    before = pool.clone()
    indices = torch.tensor([4, 0, 7, -1], dtype=index_dtype)
    out = torch.full(d["v"].shape, float("nan"), dtype=F64)
    torch_kda.kda_pool(*positional(d), pool, indices, lower_bound=lower_bound, cu_seqlens=d["cu_seqlens"], out=out)
    cu = d["cu_seqlens"].tolist()
    for n, slot in enumerate(indices.tolist()):
        tokens = slice(cu[n], cu[n + 1])
        if slot < 0:
            assert torch.equal(out[:, tokens], torch.zeros_like(out[:, tokens]))
            continue
        o, f = naive_request(d, n, tokens, before[slot], lower_bound)
        assert rel(out[:, tokens], o) < 1e-12 if o.numel() else True
        assert rel(pool[slot], f[0]) < 1e-12
    untouched = [s for s in range(slots) if s not in (4, 0, 7)]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("lower_bound", GATES)
def test_speculative_decoding_follows_the_slot_rule(lower_bound):
    """state_indices [N, T_max] and num_accepted_tokens: against a plain Python
    reference of the rule, with a padding row, a request whose later slots are
    negative (not written) and T_max above the tokens of a step."""
    N, T, H, K, V, slots = 4, 3, 2, 8, 5, 20
    d = make_inputs(B=N, T=T, H=H, K=K, V=V, dtype=F64)
    pool = pool_of(slots, H, V, K)
    before = pool.clone()
    indices = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1], [-1, -1, -1, -1], [8, 9, 10, 11]])
    accepted = torch.tensor([3, 1, 1, 2])
    want_out, want_pool = spec_reference(d, pool, indices, accepted, lower_bound)
    out = torch.full(d["v"].shape, float("nan"), dtype=F64)
    torch_kda.kda_pool(*positional(d), pool, indices, lower_bound=lower_bound, num_accepted_tokens=accepted, out=out)
    assert rel(out, want_out) < 1e-12 and torch.equal(out[2], torch.zeros_like(out[2]))
    assert rel(pool, want_pool) < 1e-12
    written = {0, 1, 2, 4, 5, 8, 9, 10}  # T = 3 tokens: column 3 is never reached
    untouched = [s for s in range(slots) if s not in written]
    assert torch.equal(pool[untouched], before[untouched])


def test_padding_rows_read_nothing():
    """Slots that no request names hold NaN: the results stay finite and equal to
    a pool without the poison, and the poisoned rows stay NaN."""
    N, T, H, K, V, slots = 3, 2, 2, 8, 5, 6
    d = make_inputs(B=N, T=T, H=H, K=K, V=V, dtype=F64)
    indices = torch.tensor([1, -1, 4])
    clean = pool_of(slots, H, V, K)
    poisoned = clean.clone()
    for s in (0, 2, 3, 5):
        poisoned[s] = float("nan")
    out_clean = torch_kda.kda_pool(*positional(d), clean, indices, lower_bound=-5.0)
    out = torch_kda.kda_pool(*positional(d), poisoned, indices, lower_bound=-5.0)
    assert torch.equal(out, out_clean) and torch.isfinite(out).all()
    assert torch.equal(poisoned[[1, 4]], clean[[1, 4]])
    assert torch.isnan(poisoned[[0, 2, 3, 5]]).all()


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_pool_dtype_and_a_view_of_a_larger_cache(pool_dtype):
    """A pool that is a strided view (each slot one row of a larger cache) in
    fp32 or bf16: the states leave rounded once to the pool's dtype, and the
    cache's other memory is untouched."""
    N, T, H, K, V = 2, 3, 2, 8, 5
    d = make_inputs(B=N, T=T, H=H, K=K, V=V, dtype=torch.float32)
    cache = torch.randn(6, 2, H, V, K).to(pool_dtype)  # [slots, 2 (say, conv and KDA state), H, V, K]
    before = cache.clone()
    pool = cache[:, 1]
    indices = torch.tensor([5, 2])
    start = pool[indices].clone()
    out = torch_kda.kda_pool(*positional(d), pool, indices, lower_bound=-5.0)
    ref_out, ref_final = kda_naive(*positional(d), lower_bound=-5.0, initial_state=start.to(F64))
    tol = 5e-3 if pool_dtype == torch.bfloat16 else 1e-5
    assert rel(out, ref_out) < tol and rel(pool[indices], ref_final) < tol
    assert torch.equal(cache[:, 0], before[:, 0])
    assert torch.equal(cache[[0, 1, 3, 4], 1], before[[0, 1, 3, 4], 1])


class TestPoolErrors(expecttest.TestCase):
    def setUp(self):
        self.d = make_inputs(B=2, T=1, H=2, K=4, V=3)
        self.pool = torch.zeros(5, 2, 3, 4)
        self.indices = torch.tensor([0, 3])

    def _error(self, pool=None, indices=None, **kw):
        with self.assertRaises((RuntimeError, ValueError, TypeError)) as e:
            torch_kda.kda_pool(*positional(self.d), self.pool if pool is None else pool,
                               self.indices if indices is None else indices, lower_bound=-5.0, **kw)
        return str(e.exception).splitlines()[0]

    def test_pool_dtype(self):
        self.assertExpectedInline(self._error(pool=self.pool.half()), """kda.fwd_pool_: state_pool must have dtype bfloat16, float32 or float64, got float16""")

    def test_pool_shape(self):
        self.assertExpectedInline(self._error(pool=torch.zeros(5, 2, 4, 3)), """kda.fwd_pool_: state_pool must have shape [slots, HV, V, K] with V = 3 at dim 2, got shape [5, 2, 4, 3]""")

    def test_pool_slot_not_contiguous(self):
        self.assertExpectedInline(self._error(pool=torch.zeros(5, 2, 4, 3).transpose(2, 3)), """kda.fwd_pool_: state_pool's slots must each be contiguous [H, V, K] (strides [>= H*V*K, V*K, K, 1]), got strides [24, 12, 1, 3]""")

    def test_indices_dtype(self):
        self.assertExpectedInline(self._error(indices=self.indices.float()), """kda.fwd_pool_: state_indices must have dtype int64 or int32, got float32""")

    def test_indices_count(self):
        self.assertExpectedInline(self._error(indices=torch.tensor([0, 1, 2])), """kda.fwd_pool_: state_indices must have shape [N] with N = 2 at dim 0, got shape [3]""")

    def test_index_past_the_pool(self):
        self.assertExpectedInline(self._error(indices=torch.tensor([0, 5])), """kda.fwd_pool_: state_indices must name slots below the pool's 5 (or be negative: padding), got 5 at flat position 1""")

    def test_speculative_indices_one_dimensional(self):
        self.assertExpectedInline(self._error(num_accepted_tokens=torch.tensor([1, 1])), """kda.fwd_pool_: state_indices must be a 2-D tensor [N, T_max] with num_accepted_tokens, got a 1-D tensor of shape [2]""")

    def test_accepted_out_of_range(self):
        self.assertExpectedInline(self._error(indices=torch.tensor([[0, 1], [2, 3]]), num_accepted_tokens=torch.tensor([1, 3])), """kda.fwd_pool_: num_accepted_tokens must be in [1, T_max = 2], got 3 for request 1""")

    def test_out_overlapping_the_pool(self):
        out = self.pool.view(-1)[: 2 * 1 * 2 * 3].view(2, 1, 2, 3)
        self.assertExpectedInline(self._error(out=out), """kda.fwd_pool_: out and state_pool must not share memory (each element is written once, by one of them)""")


def test_opcheck():
    d = make_inputs(seqlens=[3, 0, 2], H=2, K=4, V=3)
    pool = torch.randn(6, 2, 3, 4)
    args = (*positional(d), pool, torch.tensor([1, -1, 4]), torch.empty(d["v"].shape), None, -5.0, d["cu_seqlens"])
    torch.library.opcheck(torch.ops.kda.fwd_pool_.default, args)
    d = make_inputs(B=2, T=2, H=2, K=4, V=3)
    spec = (*positional(d), pool, torch.tensor([[0, 2], [3, 5]]), torch.empty(d["v"].shape), None, None, None,
            torch.tensor([2, 1]))
    torch.library.opcheck(torch.ops.kda.fwd_pool_.default, spec)


def test_compile_fullgraph():
    d = make_inputs(B=2, T=1, H=2, K=4, V=3)
    indices = torch.tensor([3, 0])
    eager_pool, compiled_pool = torch.randn(5, 2, 3, 4), None
    compiled_pool = eager_pool.clone()

    def step(pool, idx, q, k, v, g, beta):
        return torch_kda.kda_pool(q, k, v, g, beta, d["A_log"], d["dt_bias"], pool, idx, lower_bound=-5.0)

    x = [d[n] for n in ("q", "k", "v", "g", "beta")]
    want = step(eager_pool, indices, *x)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(compiled_pool, indices, *x)
    assert torch.equal(got, want) and torch.equal(compiled_pool, eager_pool)
