"""The forward over segments (csrc/segments.h) on the CPU: a sequence cut into P
segments whose start states come from a scan of their transition maps gives the
float64 recurrence's results, stays causal and deterministic, and the CPU's
heuristic takes it where threads outnumber the (sequence, head) pairs."""
import pytest
import torch

import torch_kda
from conftest import make_inputs, nan_filled_empty, positional, rel, run_reference
from torch_kda.testing import forced


def run(d, segments, **kwargs):
    with forced(segments=segments):
        return torch_kda.kda(*positional(d), initial_state=d["initial_state"], cu_seqlens=d["cu_seqlens"],
                             output_final_state=True, **kwargs)


def check(d, segments, out_tol, state_tol, **kwargs):
    with nan_filled_empty():
        out, final = run(d, segments, **kwargs)
    ref_out, ref_final = run_reference(d, **kwargs)
    assert rel(out, ref_out) <= out_tol
    assert rel(final, ref_final) <= state_tol
    return out, final


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
@pytest.mark.parametrize("segments", [2, 3, 7])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
def test_fixed_length_float64(lower_bound, segments, with_state):
    # T = 101: segments of 48 + 48 + 5 (P = 2: 64 + 37; P = 7: 16 each, then empty ones).
    d = make_inputs(B=2, T=101, H=3, K=8, V=6, dtype=torch.float64,
                    state_dtype=torch.float64 if with_state else None)
    check(d, segments, 1e-11, 1e-11, lower_bound=lower_bound)


@pytest.mark.parametrize("cu_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("lower_bound", [-1.0, None], ids=["bounded", "softplus"])
def test_varlen_with_empty_and_odd_sequences_float64(cu_dtype, lower_bound):
    d = make_inputs(H=2, K=8, V=8, seqlens=[0, 1, 17, 0, 95, 33, 0], cu_dtype=cu_dtype, dtype=torch.float64,
                    state_dtype=torch.float64)
    check(d, 4, 1e-11, 1e-11, lower_bound=lower_bound)


def test_empty_call_passes_the_state_through():
    d = make_inputs(B=1, T=0, H=2, K=8, V=4, state_dtype=torch.float32)
    out, final = run(d, 3)
    assert out.shape == (1, 0, 2, 4)
    assert torch.equal(final, d["initial_state"])


def strong_and_weak(d, seed_tokens):
    """Half the tokens of every head decay to exactly zero (softplus of g = +1000 times
    exp(A_log) >= 1), a tenth not at all (g = -1000), the rest at ~10 N(0, 1)."""
    g = d["g"] * 10
    gen = torch.Generator().manual_seed(seed_tokens)
    u = torch.rand(g.shape[:-1], generator=gen, dtype=torch.float64)
    g[u < 0.5] = 1000.0
    g[(u >= 0.5) & (u < 0.6)] = -1000.0
    d["g"] = g.to(d["g"].dtype)
    d["A_log"] = torch.empty_like(d["A_log"]).uniform_(0.0, 2.77)
    return d


def test_state_resets_and_no_decay_inside_segments():
    d = strong_and_weak(make_inputs(B=1, T=300, H=2, K=16, V=16, state_dtype=torch.float32), 7)
    check(d, 5, 1e-5, 1e-5, lower_bound=None)


def test_tiny_beta():
    d = make_inputs(B=1, T=250, H=2, K=16, V=8, state_dtype=torch.float32)
    d["beta"] = torch.full_like(d["beta"], -20.0)  # sigmoid ~ 2e-9
    check(d, 4, 1e-5, 1e-5, lower_bound=-0.1)


@pytest.mark.parametrize("cut", [40, 48, 49])  # inside a chunk, on a chunk edge, just after
def test_causal_bitwise(cut):
    d = make_inputs(B=1, T=130, H=2, K=16, V=8, state_dtype=torch.float32)
    out, _ = run(d, 3, lower_bound=None)
    e = {name: (x.clone() if isinstance(x, torch.Tensor) else x) for name, x in d.items()}
    for name in ("q", "k", "v", "g", "beta"):
        e[name][:, cut:] = torch.randn_like(e[name][:, cut:]) * 5
    out2, _ = run(e, 3, lower_bound=None)
    assert torch.equal(out[:, :cut], out2[:, :cut])
    assert not torch.equal(out[:, cut:], out2[:, cut:])


def test_deterministic():
    d = make_inputs(B=1, T=200, H=2, K=16, V=8, state_dtype=torch.float32)
    a = run(d, 4, lower_bound=-5.0)
    b = run(d, 4, lower_bound=-5.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_in_place_with_one_buffer_for_both_states():
    d = make_inputs(B=1, T=120, H=2, K=8, V=8, state_dtype=torch.float32)
    ref_out, ref_final = run_reference(d, lower_bound=-5.0)
    state = d["initial_state"].clone()
    out = torch.full_like(d["v"], float("nan"))
    with forced(segments=3):
        torch.ops.kda.fwd_(*positional(d), out, state, lower_bound=-5.0, initial_state=state)
    assert rel(out, ref_out) <= 1e-5
    assert rel(state, ref_final) <= 1e-5


def test_heuristic_takes_segments_where_threads_are_idle():
    # One (sequence, head) pair, 4096 tokens, 12 threads: four segments of 1024.
    # No decay (g = -1000), so that every segment's start state reaches its outputs.
    d = make_inputs(B=1, T=4096, H=1, K=8, V=8, state_dtype=torch.float32)
    d["g"].fill_(-1000.0)
    kw = dict(initial_state=d["initial_state"], output_final_state=True, lower_bound=-1.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(12)
    try:
        automatic = torch_kda.kda(*positional(d), **kw)
    finally:
        torch.set_num_threads(threads)
    with forced(segments=4):
        four = torch_kda.kda(*positional(d), **kw)
    with forced(segments=1):
        one = torch_kda.kda(*positional(d), **kw)
    assert all(torch.equal(x, y) for x, y in zip(automatic, four))
    assert not torch.equal(automatic[0], one[0])  # the scan's sums round differently


def test_hook_nests_and_refuses_bad_values():
    now = torch.ops.kda_testing.forced_segments
    assert now() == -1
    with forced(segments=3):
        assert now() == 3
        with forced(segments=None):
            assert now() == -1
        for bad, error in ((0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)):
            with pytest.raises(error):
                with forced(segments=bad):
                    pass
            assert now() == 3
    assert now() == -1
    with pytest.raises(RuntimeError, match="segments must be"):
        torch.ops.kda_testing.force_segments(0)
