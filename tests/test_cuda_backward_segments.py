"""The CUDA backward's dS recurrence over segments (backward/schedule.cpp,
segmented_ds_recurrence): each window of a lone sequence, or every sequence of a
batch in one pass, cut into P segments; one launch that keeps only each
segment's dS at its start from a zero end and its map from the identity, the
scan, then the recurrence proper from every segment's end at once. Against
float64 autograd with poisoned scratch, both gates, with windows, hard decays,
odd lengths, empty sequences, more segments than a window's chunks;
deterministic and capturable. Skipped where CUDA is absent.
"""
import pytest
import torch

from conftest import capture_graph, nan_filled_empty, positional, rel
from cuda_helpers import CUDA_MARKS, DEV, GRAD_NAMES, check_grads, cuda_inputs, float64_grads, hard_case, launched_kernels
from torch_kda.testing import forced

pytestmark = CUDA_MARKS

GATES = pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])


def segmented_bwd(g, grad_out, grad_final, lower_bound, P, window=None):
    with forced(segments=P, window_slots=window), nan_filled_empty():
        return torch.ops.kda.bwd(grad_out, grad_final, *positional(g), lower_bound=lower_bound,
                                 initial_state=g["initial_state"], cu_seqlens=g["cu_seqlens"])


def ds_launches(fn):
    result, names = launched_kernels(fn)
    return result, sum("ds_recurrence_kernel" in n for n in names)


@GATES
@pytest.mark.parametrize("P, window", [(2, None), (5, None), (16, None), (4, 24), (3, 40)])
def test_matches_float64(P, window, lower_bound):
    """One sequence of 1,003 tokens (63 chunks, the last partial), fixed length; the
    gradient of the final state given; with and without windows."""
    _, g = cuda_inputs(B=1, T=1003, H=2, state_dtype=torch.float32)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    gf = torch.randn(*g["initial_state"].shape, device=DEV)
    got, launches = ds_launches(lambda: segmented_bwd(g, grad_out, gf, lower_bound, P, window))
    windows = 1 if window is None else -(-63 // window)
    assert launches == 2 * windows  # the passes and the recurrence proper, a window each
    check_grads(f"P={P} window={window}", got, float64_grads(g, grad_out, gf, lower_bound))


@GATES
@pytest.mark.parametrize("case", ["weak_decay", "strong_decay", "small_beta"])
def test_hard_cases(case, lower_bound):
    """Weak decay carries dS across every segment edge; strong decay and tiny beta
    leave the maps near zero or near diag(gl)."""
    d, g = cuda_inputs(seqlens=[777], H=2, state_dtype=torch.float32)
    hard_case(case, d, g)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    got = segmented_bwd(g, grad_out, None, lower_bound, 8)
    check_grads(case, got, float64_grads(g, grad_out, None, lower_bound))


def test_fp32_grad_out_and_no_initial_state():
    """An fp32 grad_out reaches the passes as it reaches one pass: the same bits as
    its bf16 values; no initial state (no d_initial written)."""
    _, g = cuda_inputs(B=1, T=500, H=2, state_dtype=None)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    want = segmented_bwd(g, grad_out, None, -5.0, 4)
    got = segmented_bwd(g, grad_out.float(), None, -5.0, 4)
    for name, x, y in zip(GRAD_NAMES, got, want):
        assert torch.equal(x, y), name
    check_grads("no state", got, float64_grads(g, grad_out, None, -5.0))


def test_more_segments_than_chunks():
    """Windows of 3 chunks cut 16 ways take 3 segments each (none empty); a sequence
    of one partial chunk takes one."""
    for T, window in ((100, 3), (9, None)):
        _, g = cuda_inputs(B=1, T=T, H=2, state_dtype=torch.float32)
        grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
        gf = torch.randn(*g["initial_state"].shape, device=DEV)
        got = segmented_bwd(g, grad_out, gf, -5.0, 16, window)
        check_grads(f"T={T}", got, float64_grads(g, grad_out, gf, -5.0))


def test_agrees_with_one_pass_and_is_deterministic():
    """The segments change only the low bits of what the dS recurrence sums; run
    twice, the same bits."""
    _, g = cuda_inputs(B=1, T=2000, H=2, state_dtype=torch.float32)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    gf = torch.randn(*g["initial_state"].shape, device=DEV)
    a = segmented_bwd(g, grad_out, gf, None, 6, 50)
    b = segmented_bwd(g, grad_out, gf, None, 6, 50)
    whole = segmented_bwd(g, grad_out, gf, None, 1)
    for name, x, y, z in zip(GRAD_NAMES, a, b, whole):
        assert torch.equal(x, y), name
        assert rel(x, z) <= 2e-3, name


@pytest.mark.parametrize("shape, window, lower_bound", [
    (dict(B=1, T=700), 20, -5.0),                 # a lone sequence, with windows
    (dict(seqlens=[300, 0, 450, 17]), 0, None),   # a varlen batch in one pass, an empty sequence among them
], ids=["lone", "batch"])
def test_graph_replay_with_new_inputs(shape, window, lower_bound):
    """Captured with segments, replayed on new inputs: bitwise the eager call."""
    _, g = cuda_inputs(H=2, state_dtype=torch.float32, **shape)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    gf = torch.randn(*g["initial_state"].shape, device=DEV)

    def step():
        with forced(segments=4, window_slots=window):
            return torch.ops.kda.bwd(grad_out, gf, *positional(g), lower_bound=lower_bound,
                                     initial_state=g["initial_state"], cu_seqlens=g["cu_seqlens"])

    graph, outs = capture_graph(step)
    _, fresh = cuda_inputs(H=2, state_dtype=torch.float32, **shape)
    for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"):
        g[name].copy_(fresh[name])
    grad_out.copy_(torch.randn_like(grad_out.float()).to(torch.bfloat16))
    gf.copy_(torch.randn_like(gf))
    graph.replay()
    torch.cuda.synchronize()
    for name, x, y in zip(GRAD_NAMES, outs, step()):
        assert torch.equal(x, y), name


@GATES
@pytest.mark.parametrize("P", [3, 16])
def test_several_sequences_in_one_pass(P, lower_bound):
    """A varlen batch in one pass: every sequence cut as the forward cuts it (empty
    and single-token sequences, short ones with empty trailing segments), the grid
    of every segment of every sequence at once; the gradient of each final state given."""
    _, g = cuda_inputs(seqlens=[0, 15, 300, 0, 777, 1, 64], H=2, state_dtype=torch.float32)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    gf = torch.randn(*g["initial_state"].shape, device=DEV)
    got, launches = ds_launches(lambda: segmented_bwd(g, grad_out, gf, lower_bound, P, 0))
    assert launches == 2
    check_grads(f"varlen P={P}", got, float64_grads(g, grad_out, gf, lower_bound))


def test_automatic_cut_of_a_batch_of_few_long_sequences():
    """Two sequences of ~16k tokens on two heads (four chains, 1,024 chunks each):
    the rule cuts every sequence in one pass without being forced; the gradients
    within the segments' rounding of one pass's, which the tests above hold to float64."""
    _, g = cuda_inputs(seqlens=[16384, 16390], H=2, state_dtype=torch.float32)
    props = torch.cuda.get_device_properties(0)
    plan = torch.ops.kda_testing.backward_plan(2, 32774, True, 2, props.multi_processor_count, False, 128,
                                               props.total_memory, saved_states=False, saved_records=False)
    assert plan[3] > 1
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    gf = torch.randn(*g["initial_state"].shape, device=DEV)

    def bwd():
        with nan_filled_empty():
            return torch.ops.kda.bwd(grad_out, gf, *positional(g), lower_bound=-5.0,
                                     initial_state=g["initial_state"], cu_seqlens=g["cu_seqlens"])

    got, launches = ds_launches(bwd)
    assert launches == 2
    with forced(segments=1):
        whole = bwd()
    for name, x, y in zip(GRAD_NAMES, got, whole):
        assert torch.isfinite(x).all() and rel(x, y) <= 1e-3, name


def test_several_sequences_in_windows_stay_whole():
    """Windows cut from a batch's slots hold parts of several sequences: their dS
    recurrence runs whole, one launch a window."""
    _, g = cuda_inputs(seqlens=[300, 500], H=2, state_dtype=torch.float32)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    got, launches = ds_launches(lambda: segmented_bwd(g, grad_out, None, -5.0, 4, 20))
    assert launches == -(-51 // 20)
    check_grads("two sequences in windows", got, float64_grads(g, grad_out, None, -5.0))


@pytest.mark.parametrize("layout", ["fixed", "varlen"])
def test_lone_empty_sequence(layout):
    """A lone sequence of no tokens under forced segments: no chunk to cut, dS passes
    through to the initial state's gradient exactly, and the parameters' gradients are
    zeros, not the scratch's poison."""
    kw = dict(B=1, T=0) if layout == "fixed" else dict(seqlens=[0])
    _, g = cuda_inputs(H=2, state_dtype=torch.float32, **kw)
    grad_out = torch.randn(*g["v"].shape, device=DEV).to(torch.bfloat16)
    gf = torch.randn(*g["initial_state"].shape, device=DEV)
    got = segmented_bwd(g, grad_out, gf, -5.0, 8)
    grads = dict(zip(GRAD_NAMES, got))
    assert torch.equal(grads["dinitial_state"], gf)
    for name in ("dA_log", "ddt_bias"):
        assert torch.count_nonzero(grads[name]) == 0, name
    for name in ("dq", "dk", "dv", "dg", "dbeta"):
        assert grads[name].numel() == 0, name


def test_compiled_training_step_with_segments():
    """torch.compile(fullgraph=True) of the layer on one sequence whose forward and
    backward both run in segments: the same gradients as eager under the same
    schedule, and within the segments' rounding of the schedule without them."""
    from torch._inductor import config as inductor_config
    from torch_kda.nn import KimiDeltaAttention

    torch.manual_seed(0)
    layer = KimiDeltaAttention(hidden_size=256, num_heads=2, head_dim=128, lower_bound=-5.0).to(DEV)
    x = torch.randn(1, 900, 256, device=DEV)

    def step(module, P):
        module.zero_grad(set_to_none=True)
        with forced(segments=P), torch.autocast("cuda", dtype=torch.bfloat16):
            y, _ = module(x)
            y.float().square().mean().backward()
        return y.detach().float(), [p.grad.detach().float().clone() for p in module.parameters()]

    y_whole, g_whole = step(layer, 1)
    y_eager, g_eager = step(layer, 4)
    with inductor_config.patch(emulate_precision_casts=True):
        compiled = torch.compile(layer, fullgraph=True)
        y_comp, g_comp = step(compiled, 4)
    assert rel(y_comp, y_eager) <= 1e-3 and rel(y_eager, y_whole) <= 1e-3
    for gw, ge, gc in zip(g_whole, g_eager, g_comp):
        assert rel(gc, ge) <= 5e-3
        assert rel(ge, gw) <= 5e-3
