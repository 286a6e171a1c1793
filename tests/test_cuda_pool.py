"""kda::fwd_pool_ on CUDA (csrc/cuda/pool.cu): the decode kernel and the chunked
path between copies, against the float64 reference and the CPU kernel's slot
rules; padding rows, poisoned pools and outputs, bf16 pools, a strided pool,
speculative decoding, CUDA graphs with new indices, torch.compile, and the
checks that run only under TORCH_KDA_CHECK=1. Skipped where CUDA is absent."""
import pytest
import torch

import torch_kda
from conftest import capture_graph, make_inputs, positional, rel
from cuda_helpers import CUDA_MARKS, DEV, kernel_launches
from torch_kda.naive import kda_naive

pytestmark = CUDA_MARKS

D = 128
GATES = [pytest.param(-5.0, id="bounded"), pytest.param(None, id="softplus")]


def to_dev(d):
    return {n: (t.to(DEV) if t is not None else None) for n, t in d.items()}


def pool_call(g, pool, indices, lower_bound, **kw):
    return torch_kda.kda_pool(*positional(g), pool, indices, lower_bound=lower_bound, **kw)


@pytest.mark.parametrize("lower_bound", GATES)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4, 40])  # the decode kernel, and (40 > 8 a request) the chunked path
def test_pool_matches_the_reference(lower_bound, pool_dtype, T):
    """Requests in a random half of the pool, one of them padding: out and the
    written slots against float64 from the same start states; rows that no
    index names bitwise unchanged, the padding row's out zero."""
    N, H, slots = 6, 4, 12
    d = make_inputs(B=N, T=T, H=H, K=D, V=D, dtype=torch.bfloat16)
    g = to_dev(d)
    pool = torch.randn(slots, H, D, D, device=DEV).to(pool_dtype)
    before = pool.clone()
    indices = torch.randperm(slots, device=DEV)[:N]
    indices[2] = -1
    out = torch.full(g["v"].shape, float("nan"), device=DEV, dtype=torch.bfloat16)
    pool_call(g, pool, indices, lower_bound, out=out)
    torch.cuda.synchronize()
    live = [n for n in range(N) if n != 2]
    idx = indices[live]
    ref_out, ref_final = kda_naive(*(x[live] for x in positional(g)[:5]), g["A_log"], g["dt_bias"],
                                   lower_bound=lower_bound, initial_state=before[idx].double())
    tol_out, tol_state = (5e-3, 5e-3) if pool_dtype == torch.bfloat16 else (5e-3, 1e-4)
    e_out, e_state = rel(out[live], ref_out), rel(pool[idx], ref_final)
    print(f"\nT={T} {pool_dtype}: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= tol_out and e_state <= tol_state
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    others = torch.tensor([s for s in range(slots) if s not in idx.tolist()], device=DEV)
    assert torch.equal(pool[others], before[others])


@pytest.mark.parametrize("lower_bound", GATES)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 6])  # one token, a partial tile, two tiles (4 tokens a tile)
def test_decode_many_requests_hard_gates(lower_bound, pool_dtype, T):
    """Several waves of decode blocks (four a request and head), random padding
    rows among them, strong decay in a third of the requests and tiny beta in
    another: out and the written slots against float64, every padding row's out
    zero, the slots no index names bitwise unchanged."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    H = 8
    N = max(300, 3 * 8 * sms // H)  # at least three waves (four blocks a request and head, at most seven an SM)
    slots = N + N // 2
    d = make_inputs(B=N, T=T, H=H, K=D, V=D, dtype=torch.bfloat16)
    d["g"][: N // 3] *= 8  # strong decay in the first third (either gate), tiny beta in the second
    d["beta"][N // 3 : 2 * N // 3] = -12.0
    g = to_dev(d)
    pool = torch.randn(slots, H, D, D, device=DEV).to(pool_dtype)
    before = pool.clone()
    indices = torch.randperm(slots, device=DEV)[:N].to(torch.int32)
    padding = torch.rand(N, device=DEV) < 0.1
    indices[padding] = -1
    out = torch.full(g["v"].shape, float("nan"), device=DEV, dtype=torch.bfloat16)
    pool_call(g, pool, indices, lower_bound, out=out)
    torch.cuda.synchronize()
    live = (~padding).nonzero().squeeze(1)
    idx = indices[live].long()
    ref_out, ref_final = kda_naive(*(x[live] for x in positional(g)[:5]), g["A_log"], g["dt_bias"],
                                   lower_bound=lower_bound, initial_state=before[idx].double())
    tol_state = 5e-3 if pool_dtype == torch.bfloat16 else 1e-4
    e_out, e_state = rel(out[live], ref_out), rel(pool[idx], ref_final)
    print(f"\nN={N} T={T} {pool_dtype}: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert e_out <= 5e-3 and e_state <= tol_state
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))
    untouched = torch.ones(slots, dtype=torch.bool, device=DEV)
    untouched[idx] = False
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [4, 6])  # one tile of four tokens, and a second one
def test_speculative_many_requests(pool_dtype, T):
    """Speculative decoding over several waves of blocks (accepted counts random,
    some rows padding): the CPU kernel's outputs and slots, every padding row's out
    zero, the slots no index names bitwise unchanged."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    H = 4
    N = max(200, 3 * 8 * sms // H)  # at least three waves, as above
    slots = N * T + 7
    d = make_inputs(B=N, T=T, H=H, K=D, V=D, dtype=torch.bfloat16)
    pool = torch.randn(slots, H, D, D).to(pool_dtype)
    indices = torch.randperm(slots)[: N * T].view(N, T)
    accepted = torch.randint(1, T + 1, (N,))
    padding = torch.rand(N) < 0.1
    indices[padding] = -1
    cpu_pool = pool.clone()
    cpu_out = torch_kda.kda_pool(*positional(d), cpu_pool, indices, lower_bound=-5.0, num_accepted_tokens=accepted)
    gpu_pool = pool.to(DEV)
    gpu_out = torch.full(d["v"].shape, float("nan"), device=DEV, dtype=torch.bfloat16)
    torch_kda.kda_pool(*positional(to_dev(d)), gpu_pool, indices.to(DEV), lower_bound=-5.0,
                       num_accepted_tokens=accepted.to(DEV), out=gpu_out)
    tol = 5e-3 if pool_dtype == torch.bfloat16 else 1e-4
    e_out, e_pool = rel(gpu_out.cpu(), cpu_out), rel(gpu_pool.cpu().float(), cpu_pool.float())
    print(f"\nN={N} T={T} {pool_dtype}: out rel {e_out:.2e}, pool rel {e_pool:.2e}")
    assert e_out <= 5e-3 and e_pool <= tol
    assert torch.equal(gpu_out[padding.to(DEV)], torch.zeros_like(gpu_out[padding.to(DEV)]))
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[indices[indices >= 0]] = False
    assert torch.equal(gpu_pool[untouched.to(DEV)].cpu(), pool[untouched])


@pytest.mark.parametrize("lower_bound", GATES)
def test_decode_steps_equal_the_prefill(lower_bound):
    """Token by token through the pool (fp32) equals the prefill op over the
    whole sequences, within the fp32 state's precision."""
    N, T, H, slots = 5, 24, 8, 10
    d = make_inputs(B=N, T=T, H=H, K=D, V=D, dtype=torch.bfloat16, state_dtype=torch.float32)
    g = to_dev(d)
    pool = torch.zeros(slots, H, D, D, device=DEV)
    indices = torch.randperm(slots, device=DEV)[:N]
    pool[indices] = g["initial_state"]
    outs = [pool_call({**g, **{n: g[n][:, t : t + 1].contiguous() for n in ("q", "k", "v", "g", "beta")}},
                      pool, indices, lower_bound) for t in range(T)]
    want_out, want_final = torch_kda.kda(*positional(g), lower_bound=lower_bound, initial_state=g["initial_state"],
                                         output_final_state=True)
    ref_out, ref_final = kda_naive(*positional(g), lower_bound=lower_bound, initial_state=g["initial_state"].double())
    got = torch.cat(outs, 1)
    print(f"\nsteps vs float64: out {rel(got, ref_out):.2e}, state {rel(pool[indices], ref_final):.2e};"
          f" prefill op: out {rel(want_out, ref_out):.2e}")
    assert rel(got, ref_out) <= 5e-3 and rel(pool[indices], ref_final) <= 1e-4
    assert rel(got, want_out.float()) <= 5e-3


@pytest.mark.parametrize("lower_bound", GATES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_varlen_against_the_cpu_kernel(lower_bound, index_dtype):
    """A varlen batch (empty request, padding row, odd lengths; long enough in
    total for the chunked path and short for the decode) gives the CPU kernel's
    results from the same pool."""
    for seqlens in ([3, 0, 1, 2, 5], [40, 0, 77, 17, 33]):
        d = make_inputs(seqlens=seqlens, H=4, K=D, V=D, dtype=torch.bfloat16, cu_dtype=index_dtype)
        g = to_dev(d)
        slots = 8
        pool = torch.randn(slots, 4, D, D)
        indices = torch.tensor([6, 1, -1, 3, 0], dtype=index_dtype)
        cpu_pool = pool.clone()
        cpu_out = torch_kda.kda_pool(*positional(d), cpu_pool, indices, lower_bound=lower_bound,
                                     cu_seqlens=d["cu_seqlens"])
        gpu_pool = pool.to(DEV)
        gpu_out = torch_kda.kda_pool(*positional(g), gpu_pool, indices.to(DEV), lower_bound=lower_bound,
                                     cu_seqlens=g["cu_seqlens"])
        print(f"\n{seqlens}: out {rel(gpu_out.cpu(), cpu_out):.2e}, pool {rel(gpu_pool.cpu(), cpu_pool):.2e}")
        assert rel(gpu_out.cpu(), cpu_out) <= 5e-3 and rel(gpu_pool.cpu(), cpu_pool) <= 1e-4
        untouched = [2, 4, 5, 7]
        assert torch.equal(gpu_pool[untouched].cpu(), pool[untouched])


@pytest.mark.parametrize("lower_bound", GATES)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_speculative_decoding_against_the_cpu_kernel(lower_bound, pool_dtype):
    """state_indices [N, T_max] and num_accepted_tokens, with a padding row and
    negative later slots: the CPU kernel's slots and outputs."""
    N, T, H, slots = 4, 3, 4, 20
    d = make_inputs(B=N, T=T, H=H, K=D, V=D, dtype=torch.bfloat16)
    pool = torch.randn(slots, H, D, D).to(pool_dtype)
    indices = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1], [-1, -1, -1, -1], [8, 9, 10, 11]])
    accepted = torch.tensor([3, 1, 1, 2], dtype=torch.int32)
    cpu_pool = pool.clone()
    cpu_out = torch_kda.kda_pool(*positional(d), cpu_pool, indices, lower_bound=lower_bound,
                                 num_accepted_tokens=accepted)
    gpu_pool = pool.to(DEV)
    gpu_out = torch_kda.kda_pool(*positional(to_dev(d)), gpu_pool, indices.to(DEV), lower_bound=lower_bound,
                                 num_accepted_tokens=accepted.to(DEV))
    tol = 5e-3 if pool_dtype == torch.bfloat16 else 1e-4
    assert rel(gpu_out.cpu(), cpu_out) <= 5e-3 and rel(gpu_pool.cpu().float(), cpu_pool.float()) <= tol
    assert torch.equal(gpu_out[2].cpu(), torch.zeros_like(cpu_out[2]))
    untouched = [s for s in range(slots) if s not in {0, 1, 2, 4, 5, 8, 9, 10}]
    assert torch.equal(gpu_pool[untouched].cpu(), pool[untouched])


def test_padding_rows_read_nothing_and_a_strided_pool(monkeypatch):
    """The pool is a view of a larger cache; the rows that no request names hold
    NaN: the results equal a clean pool's, those rows stay NaN, the cache's
    other half is untouched; an index past the pool acts as padding unchecked."""
    N, T, H = 3, 2, 2
    d = make_inputs(B=N, T=T, H=H, K=D, V=D, dtype=torch.bfloat16)
    g = to_dev(d)
    cache = torch.randn(6, 2, H, D, D, device=DEV)
    clean = cache[:, 1].clone()
    poisoned_cache = cache.clone()
    for s in (0, 2, 3, 5):
        poisoned_cache[s, 1] = float("nan")
    pool = poisoned_cache[:, 1]
    indices = torch.tensor([1, -1, 4], device=DEV)
    want = pool_call(g, clean, indices, -5.0)
    got = pool_call(g, pool, indices, -5.0)
    assert torch.equal(got, want) and torch.isfinite(got).all()
    assert torch.equal(pool[[1, 4]], clean[[1, 4]]) and torch.isnan(pool[[0, 2, 3, 5]]).all()
    assert torch.equal(poisoned_cache[:, 0], cache[:, 0])
    monkeypatch.delenv("TORCH_KDA_CHECK", raising=False)
    past = pool_call(g, cache[:, 1].clone(), torch.tensor([1, 99, 4], device=DEV), -5.0)
    assert torch.equal(past[1], torch.zeros_like(past[1])) and torch.equal(past[[0, 2]], want[[0, 2]])


def test_indices_are_checked_under_torch_kda_check(monkeypatch):
    d = make_inputs(B=2, T=1, H=2, K=D, V=D, dtype=torch.bfloat16)
    g = to_dev(d)
    pool = torch.zeros(4, 2, D, D, device=DEV)
    monkeypatch.setenv("TORCH_KDA_CHECK", "1")
    with pytest.raises(RuntimeError, match="state_indices must name slots below the pool's 4"):
        pool_call(g, pool, torch.tensor([0, 4], device=DEV), -5.0)
    monkeypatch.delenv("TORCH_KDA_CHECK")


def test_cuda_graph_replays_with_new_indices():
    """One captured decode step replayed with new inputs, indices and accepted
    counts gives the eager call's bits."""
    N, T_max, H, slots = 8, 3, 4, 32
    d = make_inputs(B=N, T=T_max, H=H, K=D, V=D, dtype=torch.bfloat16)
    x = to_dev(d)
    pool = torch.randn(slots, H, D, D, device=DEV)
    indices = torch.zeros(N, T_max, dtype=torch.int64, device=DEV)
    accepted = torch.ones(N, dtype=torch.int64, device=DEV)
    out = torch.empty(x["v"].shape, dtype=torch.bfloat16, device=DEV)

    def step():
        torch_kda.kda_pool(*positional(x), pool, indices, lower_bound=None, num_accepted_tokens=accepted, out=out)

    indices.copy_(torch.randperm(slots, device=DEV)[: N * T_max].view(N, T_max))
    graph, _ = capture_graph(step)
    for _ in range(2):
        fresh = to_dev(make_inputs(B=N, T=T_max, H=H, K=D, V=D, dtype=torch.bfloat16))
        for n in ("q", "k", "v", "g", "beta"):
            x[n].copy_(fresh[n])
        indices.copy_(torch.randperm(slots, device=DEV)[: N * T_max].view(N, T_max))
        indices[3] = -1
        accepted.copy_(torch.randint(1, T_max + 1, (N,), device=DEV))
        eager_pool = pool.clone()
        eager_out = torch_kda.kda_pool(*positional(x), eager_pool, indices, lower_bound=None,
                                       num_accepted_tokens=accepted)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager_out) and torch.equal(pool, eager_pool)


def test_compile_fullgraph():
    d = make_inputs(B=4, T=1, H=2, K=D, V=D, dtype=torch.bfloat16)
    g = to_dev(d)
    pool = torch.randn(6, 2, D, D, device=DEV)
    indices = torch.tensor([5, 0, -1, 2], device=DEV)
    eager_pool = pool.clone()

    def step(p, idx, q, k, v, gg, beta):
        return torch_kda.kda_pool(q, k, v, gg, beta, g["A_log"], g["dt_bias"], p, idx, lower_bound=-5.0)

    x = [g[n] for n in ("q", "k", "v", "g", "beta")]
    want = step(eager_pool, indices, *x)
    got = torch.compile(step, fullgraph=True)(pool, indices, *x)
    assert torch.equal(got, want) and torch.equal(pool, eager_pool)


def test_opcheck():
    d = make_inputs(seqlens=[3, 0, 2], H=2, K=D, V=D, dtype=torch.bfloat16)
    g = to_dev(d)
    pool = torch.randn(6, 2, D, D, device=DEV)
    args = (*positional(g), pool, torch.tensor([1, -1, 4], device=DEV), torch.empty(g["v"].shape, device=DEV,
            dtype=torch.bfloat16), None, -5.0, g["cu_seqlens"])
    torch.library.opcheck(torch.ops.kda.fwd_pool_.default, args)


def test_decode_runs_no_chunked_kernel():
    d = make_inputs(B=64, T=1, H=4, K=D, V=D, dtype=torch.bfloat16)
    g = to_dev(d)
    pool = torch.randn(128, 4, D, D, device=DEV)
    indices = torch.randperm(128, device=DEV)[:64]
    _, k1, k2 = kernel_launches(lambda: pool_call(g, pool, indices, -5.0))
    assert (k1, k2) == (0, 0)  # no chunk records
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        pool_call(g, pool, indices, -5.0)
        torch.cuda.synchronize()
    assert any("pool_decode_kernel" in e.name for e in prof.events())


@pytest.mark.parametrize("T", [1, 40])
def test_strided_inputs_pool_and_out_give_the_contiguous_bits(T):
    """q, k, v sliced from one fused projection, out a strided view, a bf16 pool
    that is a view of a larger cache: the bits of the contiguous call, the
    cache's other half untouched (the decode kernel and the chunked path)."""
    N, H = 3, 2
    d = to_dev(make_inputs(B=N, T=T, H=H, K=D, V=D, dtype=torch.bfloat16))
    fused = torch.randn(N, T, H, 3 * D, device=DEV).to(torch.bfloat16)
    q, k, v = fused[..., :D], fused[..., D : 2 * D], fused[..., 2 * D :]
    cache = torch.randn(5, 2, H, D, D, device=DEV).to(torch.bfloat16)
    before = cache.clone()
    indices = torch.tensor([4, -1, 1], device=DEV)
    contiguous_pool = cache[:, 1].clone()
    want = torch_kda.kda_pool(q.contiguous(), k.contiguous(), v.contiguous(), d["g"], d["beta"], d["A_log"],
                              d["dt_bias"], contiguous_pool, indices, lower_bound=None)
    out_buf = torch.full((N, T, 2 * H, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    out = out_buf[:, :, ::2]
    torch_kda.kda_pool(q, k, v, d["g"], d["beta"], d["A_log"], d["dt_bias"], cache[:, 1], indices,
                       lower_bound=None, out=out)
    assert torch.equal(out, want) and torch.equal(cache[:, 1], contiguous_pool)
    assert torch.equal(cache[:, 0], before[:, 0]) and torch.isnan(out_buf[:, :, 1::2]).all()


def test_forward_cached_matches_the_full_forward():
    """KimiDeltaAttention.forward_cached on a KDACache (bf16 layer, fp32 pool):
    prefill then decoding steps against the full forward (the chunked kernels)."""
    from torch_kda.nn import KDACache, KimiDeltaAttention

    torch.manual_seed(0)
    layer = KimiDeltaAttention(256, 2, D, device=DEV, dtype=torch.bfloat16)
    lens, steps = [7, 30, 1], 4
    seqs = [torch.randn(n + steps, 256, device=DEV).to(torch.bfloat16) for n in lens]
    full_cu = torch.tensor([0] + [n + steps for n in lens], device=DEV).cumsum(0)
    with torch.no_grad():
        want, _ = layer(torch.cat(seqs)[None], cu_seqlens=full_cu)
        cache = KDACache(layer, 6)
        slots = torch.tensor([5, 0, 2], device=DEV)
        prompt_cu = torch.tensor([0] + lens, device=DEV).cumsum(0)
        layer.forward_cached(torch.cat([s[:n] for s, n in zip(seqs, lens)])[None], cache, slots, cu_seqlens=prompt_cu)
        got = [layer.forward_cached(torch.stack([s[n + t] for s, n in zip(seqs, lens)])[:, None], cache, slots)
               for t in range(steps)]
    got = torch.cat(got, 1).float()
    ref = torch.stack([want[0, int(full_cu[i]) + n : int(full_cu[i + 1])] for i, n in enumerate(lens)]).float()
    err = rel(got, ref)
    print(f"\nforward_cached steps against the full forward: {err:.2e}")
    assert err <= 2e-2


# kda::fwd_ (torch_kda.fwd, the flash_kda drop-in) with decode shapes runs the decode kernel.

@pytest.mark.parametrize("lower_bound", GATES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, None], ids=["fp32", "bf16", "no_initial"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_fwd_inplace_decode_shapes(lower_bound, state_dtype, varlen):
    """One to a few tokens a sequence (empty and 11-token ones, three tiles of 4, among
    them when varlen): the decode kernel alone, out and the final state against
    float64 into NaN-poisoned buffers, the inputs unchanged."""
    shape = dict(seqlens=[1, 0, 11, 2, 1, 3]) if varlen else dict(B=5, T=2)
    d = make_inputs(H=3, K=D, V=D, dtype=torch.bfloat16, state_dtype=state_dtype or torch.float32, **shape)
    g = to_dev(d)
    if state_dtype is None:
        g["initial_state"] = None
    N = 6 if varlen else 5
    out = torch.full(g["v"].shape, float("nan"), device=DEV, dtype=torch.bfloat16)
    final = torch.full((N, 3, D, D), float("nan"), device=DEV, dtype=state_dtype or torch.float32)
    before = {n: t.clone() for n, t in g.items() if isinstance(t, torch.Tensor)}
    _, k1, k2 = kernel_launches(lambda: torch_kda.fwd(
        *positional(g)[:5], None, out, g["A_log"], g["dt_bias"], lower_bound, initial_state=g["initial_state"],
        final_state=final, cu_seqlens=g["cu_seqlens"]))
    assert (k1, k2) == (0, 0), "decode shapes ran the chunked kernels"
    init = g["initial_state"].double() if g["initial_state"] is not None else None
    cu = g["cu_seqlens"]
    outs, finals = [], []
    for n in range(N):
        s, e = (cu[n].item(), cu[n + 1].item()) if varlen else (0, 2)
        b = 0 if varlen else n
        x = [t[b:b + 1, s:e] for t in positional(g)[:5]]
        o, f = kda_naive(*x, g["A_log"], g["dt_bias"], lower_bound=lower_bound,
                         initial_state=init[n:n + 1] if init is not None else None)
        outs.append(o)
        finals.append(f)
    ref_out = torch.cat(outs, 1) if varlen else torch.cat(outs, 0)
    ref_final = torch.cat(finals, 0)
    tol_state = 5e-3 if state_dtype == torch.bfloat16 else 1e-4
    assert rel(out, ref_out) <= 5e-3 and rel(final, ref_final) <= tol_state
    for n, t in before.items():
        assert torch.equal(t, g[n]), f"{n} was modified"


def test_fwd_inplace_decode_one_buffer_for_both_states():
    """The same buffer as initial and final state (serving's in-place update); a
    shifted view of it is read from a copy."""
    d = make_inputs(B=4, T=1, H=2, K=D, V=D, dtype=torch.bfloat16, state_dtype=torch.float32)
    g = to_dev(d)
    out = torch.empty_like(g["v"])
    ref_out, ref_final = kda_naive(*positional(g)[:5], g["A_log"], g["dt_bias"], lower_bound=-5.0,
                                   initial_state=g["initial_state"].double())
    same = g["initial_state"].clone()
    torch_kda.fwd(*positional(g)[:5], None, out, g["A_log"], g["dt_bias"], -5.0, initial_state=same,
                  final_state=same)
    assert rel(same, ref_final) <= 1e-4 and rel(out, ref_out) <= 5e-3
    buf = torch.empty(5, 2, D, D, device=DEV)
    buf[:4] = g["initial_state"]
    torch_kda.fwd(*positional(g)[:5], None, out, g["A_log"], g["dt_bias"], -5.0, initial_state=buf[:4],
                  final_state=buf[1:])
    assert rel(buf[1:], ref_final) <= 1e-4


def test_fwd_inplace_decode_graph_replay():
    """torch_kda.fwd with decode shapes captured in a CUDA graph (serving's decode
    step), replayed after every input took new values: bitwise the eager call."""
    def fresh():
        return to_dev(make_inputs(seqlens=[1, 2, 0, 1], H=2, K=D, V=D, dtype=torch.bfloat16,
                                  state_dtype=torch.float32))

    static, new = fresh(), fresh()
    out = torch.empty_like(static["v"])
    final = torch.empty_like(static["initial_state"])

    def step(x=static, out=out, final=final):
        torch_kda.fwd(*positional(x)[:5], None, out, x["A_log"], x["dt_bias"], -5.0,
                      initial_state=x["initial_state"], final_state=final, cu_seqlens=x["cu_seqlens"])

    graph, _ = capture_graph(step)
    for name, t in static.items():
        if isinstance(t, torch.Tensor):
            t.copy_(new[name])
    out.fill_(float("nan"))
    final.fill_(float("nan"))
    graph.replay()
    want_out, want_final = torch.empty_like(out), torch.empty_like(final)
    step(new, want_out, want_final)
    assert torch.equal(out, want_out) and torch.equal(final, want_final)
