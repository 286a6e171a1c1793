"""The CUDA forward over segments (csrc/segments.h, forward/schedule.h
run_segmented_forward): K1 once, three K2 passes over P segments a sequence and
the scan between them. Against the float64 reference on fixed-length and varlen
calls (empty and odd sequences), both gates and state dtypes, with poisoned
outputs; causal bitwise, deterministic, capturable; what it saves serves the
backward; and the heuristic takes it for few long (sequence, head) pairs.
Skipped where CUDA is absent.
"""
import pytest
import torch

import torch_kda
from conftest import capture_graph, nan_filled_empty, positional, rel, run_reference
from cuda_helpers import CUDA_MARKS, DEV, cuda_inputs, kernel_launches, run_cuda
from torch_kda.testing import forced

pytestmark = CUDA_MARKS

STATE_TOL = {torch.bfloat16: 5e-3, torch.float32: 1e-4}
STATE_DTYPES = pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
GATES = pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])


def segmented(g, P, lower_bound, **kw):
    with forced(segments=P):
        return run_cuda(g, lower_bound=lower_bound, **kw)


def check(g, P, lower_bound, state_dtype):
    with nan_filled_empty():
        out, final = segmented(g, P, lower_bound)
    torch.cuda.synchronize()
    ref_out, ref_final = run_reference(g, lower_bound=lower_bound)
    e_out, e_state = rel(out, ref_out), rel(final, ref_final)
    print(f"\nP={P} lb={lower_bound} state={state_dtype}: out rel {e_out:.2e}, state rel {e_state:.2e}")
    assert final.dtype == state_dtype
    assert e_out <= 5e-3
    assert e_state <= STATE_TOL[state_dtype]
    return out, final


@GATES
@STATE_DTYPES
@pytest.mark.parametrize("P", [2, 3, 5])
def test_fixed_length(P, lower_bound, state_dtype):
    _, g = cuda_inputs(B=2, T=1500, H=2, state_dtype=state_dtype)
    check(g, P, lower_bound, state_dtype)


@GATES
@STATE_DTYPES
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_varlen_with_empty_and_odd_sequences(cu_dtype, lower_bound, state_dtype):
    _, g = cuda_inputs(seqlens=[0, 15, 100, 0, 1200, 1, 700], H=2, cu_dtype=cu_dtype, state_dtype=state_dtype)
    check(g, 4, lower_bound, state_dtype)


def test_more_segments_than_chunks():
    _, g = cuda_inputs(B=1, T=40, H=2)
    check(g, 8, -5.0, torch.float32)


def test_strong_decay_resets_and_no_decay():
    _, g = cuda_inputs(B=1, T=2000, H=2)
    gen = torch.Generator(device=DEV).manual_seed(3)
    u = torch.rand(g["g"].shape[:-1], device=DEV, generator=gen)
    gg = g["g"].float() * 10
    gg[u < 0.5] = 1000.0
    gg[(u >= 0.5) & (u < 0.6)] = -1000.0
    g["g"] = gg.to(torch.bfloat16)
    g["A_log"] = torch.empty_like(g["A_log"]).uniform_(0.0, 2.77)
    check(g, 4, None, torch.float32)


@pytest.mark.parametrize("cut", [700, 704])  # inside a chunk, on a chunk edge
def test_causal_bitwise(cut):
    _, g = cuda_inputs(B=1, T=1500, H=2)
    out, _ = segmented(g, 3, None)
    for name in ("q", "k", "v", "g", "beta"):
        changed = g[name].clone()
        changed[:, cut:] = torch.randn_like(changed[:, cut:].float()).to(changed.dtype) * 3
        out2, _ = segmented({**g, name: changed}, 3, None)
        assert torch.equal(out2[:, :cut], out[:, :cut]), name
        assert not torch.equal(out2[:, cut:], out[:, cut:]), name


def test_deterministic_and_one_buffer_for_both_states():
    _, g = cuda_inputs(B=1, T=1000, H=2)
    a, b = segmented(g, 3, -5.0), segmented(g, 3, -5.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    state = g["initial_state"].clone()
    out = torch.full_like(g["v"], float("nan"))
    with forced(segments=3):
        torch.ops.kda.fwd_(*positional(g), out, state, lower_bound=-5.0, initial_state=state)
    assert torch.equal(out, a[0]) and torch.equal(state, a[1])


def replayed_and_eager(g, lower_bound, fresh):
    """A CUDA graph of run_cuda captured on copies of g's tensors, replayed after
    every one of them took fresh's values, and the eager call on fresh."""
    static = {name: (t.clone() if isinstance(t, torch.Tensor) else t) for name, t in g.items()}
    graph, (out, final) = capture_graph(lambda: run_cuda(static, lower_bound=lower_bound))
    for name, t in static.items():
        if isinstance(t, torch.Tensor):
            t.copy_(fresh[name])
    out.fill_(float("nan"))
    final.fill_(float("nan"))
    graph.replay()
    want = run_cuda(fresh, lower_bound=lower_bound)
    return (out, final), want


@GATES
def test_graph_replay_with_new_inputs(lower_bound):
    _, g = cuda_inputs(B=1, T=1000, H=2)
    _, fresh = cuda_inputs(B=1, T=1000, H=2)
    with forced(segments=3):
        got, want = replayed_and_eager(g, lower_bound, fresh)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@GATES
@STATE_DTYPES
def test_graph_replay_where_the_heuristic_cuts(lower_bound, state_dtype):
    """A shape that the heuristic itself sends to segments, captured and replayed
    with all-new inputs (the gate parameters too): bitwise the eager call."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    T, H = 65536, 2
    plan = torch.ops.kda_testing.forward_plan(1, T, False, H, sms, state_dtype == torch.bfloat16, False)
    if plan[3] < 2:
        pytest.skip(f"{sms} SMs: the heuristic keeps 1 x {T} x {H} heads whole")
    _, g = cuda_inputs(B=1, T=T, H=H, state_dtype=state_dtype)
    _, fresh = cuda_inputs(B=1, T=T, H=H, state_dtype=state_dtype)
    got, want = replayed_and_eager(g, lower_bound, fresh)
    assert torch.equal(got[0], want[0]), "out"
    assert torch.equal(got[1], want[1]), "final state"
    _, k1, k2 = kernel_launches(lambda: run_cuda(fresh, lower_bound=lower_bound))
    assert (k1, k2) == (1, 3), "the eager call did not run over segments (K1 once, K2 three times)"


@GATES
@pytest.mark.parametrize("save", ["states_and_records", "states"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_saved_states_serve_the_backward(varlen, save, lower_bound):
    """torch_kda.kda's autograd: the segmented forward keeps the chunk-start states
    (and records) that kda.bwd reads, in the call's own chunk slots; its gradients
    match the unsegmented forward's."""
    shape = dict(seqlens=[300, 0, 17, 483]) if varlen else dict(B=1, T=800)
    _, g = cuda_inputs(H=2, **shape)

    def grads(P):
        x = {n: (t.detach().clone().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t)
             for n, t in g.items()}
        with forced(segments=P):
            out, final = torch_kda.kda(*positional(x), lower_bound=lower_bound, initial_state=x["initial_state"],
                                       output_final_state=True, cu_seqlens=x["cu_seqlens"], save_for_backward=save)
        torch.manual_seed(5)
        (out.float() * torch.randn_like(out.float())).sum().add_((final * torch.randn_like(final)).sum()).backward()
        return [x[n].grad for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")]

    for a, b in zip(grads(4), grads(1)):
        assert rel(a, b) <= 1e-2


def test_heuristic_cuts_few_long_pairs():
    """One sequence of 4,096 chunks on two heads: the heuristic (csrc/cuda/heuristics.cpp)
    takes its most segments, 32 (64 chunks each, 32 for each of its two pairs). A long
    sequence on many heads stays whole."""
    _, g = cuda_inputs(B=1, T=65536, H=2)
    g["g"].fill_(-1000.0)  # no decay: every segment's start state reaches the outputs
    automatic = run_cuda(g, lower_bound=-1.0)
    with forced(segments=32):
        cut = run_cuda(g, lower_bound=-1.0)
    with forced(segments=1):
        whole = run_cuda(g, lower_bound=-1.0)
    assert torch.equal(automatic[0], cut[0]) and torch.equal(automatic[1], cut[1])
    assert not torch.equal(automatic[1], whole[1])
    _, many = cuda_inputs(B=1, T=65536, H=16)
    with forced(segments=1):
        whole = run_cuda(many)
    assert torch.equal(run_cuda(many)[0], whole[0])
