"""torch_kda.nn.KimiDeltaAttention: the layer against a plain float64 composition of
the reference ops, sequence boundaries of the short convolutions, carried state
(chunked prefill, token-by-token generation), gradients, torch.compile, bad input."""
import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.nn.functional as F

from conftest import reference_kda, rel
from torch_kda.naive import sequence_bounds
from torch_kda.nn import KDAState, KimiDeltaAttention

F64 = torch.float64
F32 = torch.float32
GATES = pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
TOL = {F64: 1e-10, F32: 1e-5}


def make_layer(lower_bound, hidden=16, heads=2, head_dim=4, conv_size=4, dtype=F32, v_heads=None):
    """A layer whose every parameter is random and non-trivial (the default init has
    an all-ones norm weight and fast decays that would hide a missing carried state)."""
    m = KimiDeltaAttention(hidden, heads, head_dim, conv_size=conv_size, lower_bound=lower_bound,
                           num_v_heads=v_heads, dtype=dtype)
    with torch.no_grad():
        m.A_log.uniform_(-2.0, 0.0)  # A in [0.14, 1]: decays that keep some memory
        m.dt_bias.normal_()
        m.o_norm.weight.uniform_(0.5, 1.5)
    return m


def packed_offsets(seqlens):
    return torch.tensor([0] + list(seqlens), dtype=torch.int64).cumsum(0)


# --------------------------------------------------------------------------
# The layer written out in float64 from its parameters.
# --------------------------------------------------------------------------


def reference_layer(m, x, cu_seqlens=None):
    """KimiDeltaAttention.forward as a plain float64 composition. Differentiable in x
    and in the (float64 copies of the) parameters returned alongside."""
    p = {name: t.to(F64) for name, t in m.named_parameters()}
    x = x.to(F64)
    B, T, _ = x.shape
    H, HV, d, W = m.num_heads, m.num_v_heads, m.head_dim, m.conv_size
    bounds = sequence_bounds(B, T, cu_seqlens)

    def short_conv(z, weight):
        """Causal depthwise conv of width W and SiLU, restarted at every sequence start."""
        rows = [[None] * T for _ in range(B)]
        for b, start, end in bounds:
            for t in range(start, end):
                acc = torch.zeros(z.shape[-1], dtype=F64)
                for j in range(W):  # weight[:, W - 1] multiplies the current token
                    src = t - (W - 1) + j
                    if src >= start:
                        acc = acc + weight[:, j] * z[b, src]
                rows[b][t] = acc * torch.sigmoid(acc)
        out = [torch.stack(r) if T else z.new_zeros(0, z.shape[-1]) for r in rows]
        return torch.stack(out).reshape(B, T, z.shape[-1] // d, d)

    q = short_conv(x @ p["q_proj.weight"].T, p["q_conv1d.weight"][:, 0])
    k = short_conv(x @ p["k_proj.weight"].T, p["k_conv1d.weight"][:, 0])
    v = short_conv(x @ p["v_proj.weight"].T, p["v_conv1d.weight"][:, 0])
    g = (x @ p["f_a_proj.weight"].T @ p["f_b_proj.weight"].T).reshape(B, T, HV, d)
    beta = x @ p["b_proj.weight"].T
    o, _ = reference_kda(
        q, k, v, g, beta, p["A_log"].reshape(HV), p["dt_bias"].reshape(HV, d), lower_bound=m.lower_bound, cu_seqlens=cu_seqlens
    )
    gate = (x @ p["g_a_proj.weight"].T @ p["g_b_proj.weight"].T).reshape(B, T, HV, d)
    o = o / torch.sqrt(o.square().mean(-1, keepdim=True) + m.o_norm.eps) * p["o_norm.weight"] * torch.sigmoid(gate)
    return o.reshape(B, T, HV * d) @ p["o_proj.weight"].T


LAYOUTS = {
    # name: (B, T, seqlens, conv_size)
    "fixed": (2, 6, None, 4),
    # an empty sequence, and sequences shorter than the conv width
    "varlen": (1, None, [5, 0, 2, 1, 7, 3], 4),
    "varlen_conv2": (1, None, [4, 1, 0, 3], 2),
}


def _layout(name, hidden, dtype):
    B, T, seqlens, conv_size = LAYOUTS[name]
    cu = None
    if seqlens is not None:
        cu = packed_offsets(seqlens)
        T = sum(seqlens)
    return torch.randn(B, T, hidden, dtype=F64).to(dtype), cu, conv_size


@GATES
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_matches_reference_composition(lower_bound, layout):
    x, cu, conv_size = _layout(layout, 16, F64)
    m = make_layer(lower_bound, conv_size=conv_size).double()
    y, state = m(x, cu_seqlens=cu)
    assert state is None
    assert y.dtype == F64 and y.shape == x.shape
    ref = reference_layer(m, x, cu)
    assert rel(y, ref) <= 1e-10


@GATES
@pytest.mark.parametrize("layout", ["fixed", "varlen"])
def test_grouped_value_heads_match_reference_composition(lower_bound, layout):
    """num_v_heads = 2 num_heads: v, the gate, beta, the state and the output per value head."""
    x, cu, conv_size = _layout(layout, 16, F64)
    m = make_layer(lower_bound, conv_size=conv_size, v_heads=4).double()
    assert m.v_proj.weight.shape == (16, 16) and m.q_proj.weight.shape == (8, 16)
    assert m.A_log.shape == (1, 1, 4, 1) and m.dt_bias.shape == (16,) and m.b_proj.weight.shape == (4, 16)
    y, state = m(x, cu_seqlens=cu, output_state=True)
    assert state.recurrent.shape[1] == 4 and state.conv_v.shape[1] == 16 and state.conv_q.shape[1] == 8
    assert rel(y, reference_layer(m, x, cu)) <= 1e-10


def test_num_v_heads_not_a_multiple_rejected():
    with pytest.raises(ValueError, match="num_v_heads must be a multiple of num_heads = 2, got 3"):
        KimiDeltaAttention(16, 2, 4, num_v_heads=3)


@GATES
def test_parameter_gradients_match_reference_composition(lower_bound):
    x, cu, _ = _layout("varlen", 16, F64)
    m = make_layer(lower_bound).double()
    w = torch.randn(x.shape, dtype=F64)
    (m(x, cu_seqlens=cu)[0] * w).sum().backward()
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in m.parameters()]

    class Detached:  # the same attributes, with leaf float64 copies of the parameters
        num_heads, num_v_heads, head_dim = m.num_heads, m.num_v_heads, m.head_dim
        conv_size, lower_bound = m.conv_size, m.lower_bound
        o_norm = m.o_norm

        def named_parameters(self):
            return zip(names, params)

    ref_grads = torch.autograd.grad((reference_layer(Detached(), x, cu) * w).sum(), params)
    for name, p, ref in zip(names, m.parameters(), ref_grads):
        assert rel(p.grad, ref) <= 1e-9, name


# --------------------------------------------------------------------------
# Sequence boundaries.
# --------------------------------------------------------------------------


@GATES
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "carried_state"])
def test_packed_sequences_do_not_mix(lower_bound, with_state):
    seqlens = [6, 5, 3]
    cu = packed_offsets(seqlens)
    m = make_layer(lower_bound)
    x = torch.randn(1, sum(seqlens), 16)
    state = None
    if with_state:
        _, state = m(torch.randn(1, 6, 16), cu_seqlens=packed_offsets([2, 3, 1]), output_state=True)
    y, s = m(x, cu_seqlens=cu, state=state, output_state=True)

    x2 = x.clone()
    x2[:, : seqlens[0]] = torch.randn(1, seqlens[0], 16)
    y2, s2 = m(x2, cu_seqlens=cu, state=state, output_state=True)

    # Sequences 1 and 2 see nothing of sequence 0: bit-for-bit the same.
    assert torch.equal(y2[:, seqlens[0]:], y[:, seqlens[0]:])
    for name, a, b in zip(KDAState._fields, s2, s):
        assert torch.equal(a[1:], b[1:]), name
    # ... while sequence 0 itself did change, every one of its tokens and its state.
    assert (y2[0, : seqlens[0]] != y[0, : seqlens[0]]).any(-1).all()
    for name, a, b in zip(KDAState._fields, s2, s):
        assert not torch.equal(a[0], b[0]), name


def test_fixed_length_rows_do_not_mix():
    m = make_layer(-5.0)
    x = torch.randn(3, 5, 16)
    y, _ = m(x)
    x2 = x.clone()
    x2[1] = torch.randn(5, 16)
    y2, _ = m(x2)
    assert torch.equal(y2[0], y[0]) and torch.equal(y2[2], y[2])
    assert (y2[1] != y[1]).any(-1).all()


# --------------------------------------------------------------------------
# Carried state: chunked prefill and generation equal one call.
# --------------------------------------------------------------------------


def _concat_states(states):
    return KDAState(*(torch.cat(parts) for parts in zip(*states)))


def _assert_states_close(got, want, tol):
    for name, a, b in zip(KDAState._fields, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel(a, b) <= tol, name


# Per sequence: its length and where it is cut (cuts include 0 and the full length,
# and leave chunks shorter than conv_size - 1 = 3).
SEQLENS = [7, 0, 5, 1, 9, 2, 6]
SPLITS = {
    "two_chunks": [[3], [0], [0], [1], [1], [2], [6]],
    "three_chunks": [[1, 2], [0, 0], [2, 4], [0, 1], [1, 2], [0, 2], [5, 6]],
}


@GATES
@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("splits", list(SPLITS))
def test_chunked_prefill_equals_one_call(lower_bound, dtype, splits):
    cuts = SPLITS[splits]
    m = make_layer(lower_bound).to(dtype)
    x = torch.randn(1, sum(SEQLENS), 16, dtype=F64).to(dtype)
    cu = packed_offsets(SEQLENS)
    y_full, s_full = m(x, cu_seqlens=cu, output_state=True)

    # chunk c of sequence n is tokens [edges[n][c], edges[n][c + 1]) of that sequence
    edges = [[0] + c + [n] for c, n in zip(cuts, SEQLENS)]
    pieces = [[None] * (len(cuts[0]) + 1) for _ in SEQLENS]
    state = None
    for c in range(len(cuts[0]) + 1):
        lens = [e[c + 1] - e[c] for e in edges]
        assert all(n >= 0 for n in lens)
        xc = torch.cat([x[0, cu[n] + e[c]: cu[n] + e[c + 1]] for n, e in enumerate(edges)])[None]
        yc, state = m(xc, cu_seqlens=packed_offsets(lens), state=state, output_state=True)
        assert yc.shape == xc.shape
        off = packed_offsets(lens)
        for n in range(len(SEQLENS)):
            pieces[n][c] = yc[0, off[n]: off[n + 1]]
    y = torch.cat([torch.cat(p) for p in pieces])[None]
    assert rel(y, y_full) <= TOL[dtype]
    _assert_states_close(state, s_full, TOL[dtype])


@GATES
@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
def test_token_by_token_generation_equals_one_call(lower_bound, dtype):
    B, T = 2, 7
    m = make_layer(lower_bound).to(dtype)
    x = torch.randn(B, T, 16, dtype=F64).to(dtype)
    y_full, s_full = m(x, output_state=True)
    state, ys = None, []
    for t in range(T):
        yt, state = m(x[:, t: t + 1], state=state, output_state=True)
        ys.append(yt)
    assert rel(torch.cat(ys, 1), y_full) <= TOL[dtype]
    _assert_states_close(state, s_full, TOL[dtype])


def test_state_shapes_and_empty_sequence_passes_state_through():
    m = make_layer(None, conv_size=4)
    _, s0 = m(torch.randn(1, 8, 16), cu_seqlens=packed_offsets([5, 3]), output_state=True)
    H, d, C = 2, 4, 8
    assert s0.recurrent.shape == (2, H, d, d)
    for conv in (s0.conv_q, s0.conv_k, s0.conv_v):
        assert conv.shape == (2, C, 3)
    # The last three projected inputs of each sequence, oldest first, before the conv.
    x = torch.randn(1, 4, 16)
    _, s1 = m(x, cu_seqlens=packed_offsets([0, 4]), state=s0, output_state=True)
    for a, b in zip(s1, s0):
        assert torch.equal(a[0], b[0])
    with torch.no_grad():
        assert rel(s1.conv_k[1], m.k_proj(x[0, 1:]).T) <= 1e-6


# --------------------------------------------------------------------------
# Gradients.
# --------------------------------------------------------------------------


@GATES
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "carried_state"])
def test_gradients_reach_every_parameter(lower_bound, with_state):
    m = make_layer(lower_bound)
    cu = packed_offsets([4, 0, 6, 2])
    state = None
    if with_state:
        with torch.no_grad():
            _, state = m(torch.randn(1, 5, 16), cu_seqlens=packed_offsets([1, 2, 0, 2]), output_state=True)
    x = torch.randn(1, 12, 16, requires_grad=True)
    y, s = m(x, cu_seqlens=cu, state=state, output_state=True)
    loss = (y * torch.randn_like(y)).sum() + sum((t * torch.randn_like(t)).sum() for t in s)
    loss.backward()
    names = [n for n, _ in m.named_parameters()]
    assert "A_log" in names and "dt_bias" in names
    for name, p in m.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert x.grad is not None and torch.isfinite(x.grad).all()


@GATES
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_gradcheck_wrt_input(lower_bound, varlen):
    m = make_layer(lower_bound, hidden=8, heads=2, head_dim=4, conv_size=3).double()
    if varlen:
        cu = packed_offsets([3, 0, 1, 2])
        x = torch.randn(1, 6, 8, dtype=F64, requires_grad=True)
    else:
        cu = None
        x = torch.randn(2, 3, 8, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda inp: m(inp, cu_seqlens=cu)[0], (x,))


# --------------------------------------------------------------------------
# torch.compile.
# --------------------------------------------------------------------------


def _run(module, layer, x, cu, state, output_state):
    """Forward and backward of a weighted loss on everything `module` (the layer or its
    compiled wrapper) returns; gradients of x, the state and the layer's parameters."""
    for p in layer.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    leaves = None
    if state is not None:
        leaves = KDAState(*(t.detach().clone().requires_grad_(True) for t in state))
    y, s = module(x, cu, leaves, output_state)
    gen = torch.Generator().manual_seed(1234)
    loss = (y * torch.randn(y.shape, generator=gen)).sum()
    if s is not None:
        loss = loss + sum((t * torch.randn(t.shape, generator=gen)).sum() for t in s)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    grads["x"] = x.grad
    if leaves is not None:
        grads.update({f"state.{n}": t.grad for n, t in zip(KDAState._fields, leaves)})
    return y.detach(), (None if s is None else KDAState(*(t.detach() for t in s))), grads


def _compile_case(case):
    if case == "fixed":
        return torch.randn(2, 7, 16), None, None, False
    cu = packed_offsets([5, 0, 2, 9])
    state = KDAState(
        torch.randn(4, 2, 4, 4), torch.randn(4, 8, 3), torch.randn(4, 8, 3), torch.randn(4, 8, 3)
    )
    return torch.randn(1, 16, 16), cu, state, True


@pytest.mark.parametrize("case", ["fixed", "varlen_carried_state"])
def test_compile_matches_eager_without_graph_breaks(case):
    torch._dynamo.reset()
    m = make_layer(-5.0 if case == "fixed" else None)
    x, cu, state, output_state = _compile_case(case)

    explained = torch._dynamo.explain(m)(x, cu, state, output_state)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    torch._dynamo.reset()

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(m, backend=counter, fullgraph=True)
    y_c, s_c, g_c = _run(compiled, m, x, cu, state, output_state)
    assert counter.frame_count == 1
    y_e, s_e, g_e = _run(m, m, x, cu, state, output_state)

    assert rel(y_c, y_e) <= 1e-5
    if output_state:
        _assert_states_close(s_c, s_e, 1e-5)
    assert g_c.keys() == g_e.keys()
    for name in g_e:
        assert g_c[name] is not None, name
        assert rel(g_c[name], g_e[name]) <= 1e-5, name


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_compile_dynamic_two_lengths(varlen):
    torch._dynamo.reset()
    m = make_layer(None)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(m, backend=counter, fullgraph=True, dynamic=True)
    shapes = [[3, 0, 6], [2, 7, 4, 1]] if varlen else [5, 11]
    for shape in shapes:
        if varlen:
            cu = packed_offsets(shape)
            x = torch.randn(1, sum(shape), 16)
        else:
            cu = None
            x = torch.randn(2, shape, 16)
        y_c, s_c = compiled(x, cu, None, True)
        y_e, s_e = m(x, cu, None, True)
        assert rel(y_c, y_e) <= 1e-5
        _assert_states_close(s_c, s_e, 1e-5)
    assert counter.frame_count == 1  # one symbolic graph served both lengths


# --------------------------------------------------------------------------
# Bad input.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("lower_bound", [0, 0.0, 1.0, float("nan")])
def test_nonnegative_lower_bound_rejected(lower_bound):
    with pytest.raises(ValueError, match="lower_bound"):
        KimiDeltaAttention(16, 2, 4, lower_bound=lower_bound)


def test_cu_seqlens_with_batch_above_one_rejected():
    m = make_layer(None)
    with pytest.raises(ValueError, match=r"batch size.*\b2\b"):
        m(torch.randn(2, 4, 16), cu_seqlens=packed_offsets([2, 2]))


# --------------------------------------------------------------------------
# Edge cases found in review
# --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 0), (0, 5)])
def test_empty_input(shape):
    layer = make_layer(-5.0)
    x = torch.randn(*shape, 16)
    y, state = layer(x, output_state=True)
    assert y.shape == x.shape
    assert state.recurrent.shape == (shape[0], 2, 4, 4)
    assert state.conv_q.shape == (shape[0], 8, 3)


def test_non_finite_token_stays_in_its_sequence():
    layer = make_layer(-5.0)
    x = torch.randn(1, 11, 16)
    cu = torch.tensor([0, 5, 11])
    x[0, 4, 0] = float("inf")  # last token of sequence 0
    y, _ = layer(x, cu_seqlens=cu)
    alone, _ = layer(x[:, 5:])
    assert torch.isfinite(y[0, 5:]).all()
    assert rel(y[:, 5:], alone) <= 1e-6  # projections of other shapes may round differently


def test_malformed_cu_seqlens_is_the_operator_error():
    layer = make_layer(-5.0)
    with pytest.raises(RuntimeError, match="cu_seqlens must end at the number of tokens"):
        layer(torch.randn(1, 10, 16), cu_seqlens=torch.tensor([0, 3, 12]), output_state=True)


def test_short_convolution_rounds_once():
    """bf16 inputs, fp32 weights: the taps and SiLU in fp32, then one rounding to
    bf16, so the output is the float64 result rounded to bf16 (bit for bit but for
    rare ties between fp32's and float64's rounding), with sequence starts, an empty
    and a one-token sequence, and carried inputs. Summed in bf16 it is not."""
    from torch_kda.nn import ShortConvolution

    C, W, lens = 64, 4, [9, 0, 3, 20, 1]
    conv = ShortConvolution(C, W)
    with torch.no_grad():
        conv.weight.uniform_(-1.0, 1.0)
    off = packed_offsets(lens)
    x = torch.randn(1, sum(lens), C).to(torch.bfloat16)
    state = torch.randn(len(lens), C, W - 1).to(torch.bfloat16)
    y, _ = conv(x, off, state)
    want = torch.empty(sum(lens), C, dtype=F64)
    w = conv.weight[:, 0].detach().to(F64)
    for n, (s, e) in enumerate(zip(off[:-1].tolist(), off[1:].tolist())):
        history = torch.cat([state[n].to(F64).T, x[0, s:e].to(F64)])  # carried inputs, oldest first
        for t in range(e - s):
            acc = (history[t:t + W] * w.T).sum(0)
            want[s + t] = acc * torch.sigmoid(acc)
    want = want.to(torch.bfloat16)
    assert y.dtype == torch.bfloat16
    ulp = want.float().abs().clamp_min(2.0 ** -126) * 2.0 ** -7
    assert ((y[0].float() - want.float()).abs() <= ulp).all()
    assert (y[0] == want).float().mean() >= 0.99


def test_carried_conv_state_of_wrong_shape():
    layer = make_layer(-5.0)
    cu = torch.tensor([0, 3, 6])
    _, state = layer(torch.randn(1, 6, 16), cu_seqlens=cu, output_state=True)
    wide = state._replace(conv_k=torch.randn(2, 8, 5))
    with pytest.raises(ValueError, match=r"state.conv_k must have shape \[N, C, W - 1\] = \[2, 8, 3\], got \[2, 8, 5\]"):
        layer(torch.randn(1, 6, 16), cu_seqlens=cu, state=wide)


@pytest.mark.parametrize("v_heads", [None, 4], ids=["heads", "grouped"])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_forward_cached_prefill_then_steps_equal_the_full_forward(lower_bound, v_heads):
    """KDACache and forward_cached: a varlen prefill into slots in a random order,
    then decoding steps (one with a padding row) give the full forward's outputs
    over prompt plus steps; the padding row's cache slot is left as it was."""
    from torch_kda.nn import KDACache

    torch.manual_seed(0)
    layer = KimiDeltaAttention(32, 2, 8, lower_bound=lower_bound, num_v_heads=v_heads).double()
    lens, steps = [5, 9, 1], 3
    seqs = [torch.randn(n + steps, 32, dtype=torch.float64) for n in lens]
    full_cu = torch.tensor([0] + [n + steps for n in lens]).cumsum(0)
    want, _ = layer(torch.cat(seqs)[None], cu_seqlens=full_cu)
    cache = KDACache(layer, 5, dtype=torch.float64)
    slots = torch.tensor([3, 0, 4])
    with torch.no_grad():
        prompt_cu = torch.tensor([0] + lens).cumsum(0)
        got_prompt = layer.forward_cached(torch.cat([s[:n] for s, n in zip(seqs, lens)])[None], cache, slots,
                                          cu_seqlens=prompt_cu)
        got_steps = []
        for t in range(steps):
            step_slots = torch.tensor([3, -1, 4]) if t == 1 else slots
            held = cache.recurrent[0].clone(), cache.conv[0].clone()
            got_steps.append(layer.forward_cached(torch.stack([s[n + t] for s, n in zip(seqs, lens)])[:, None],
                                                  cache, step_slots))
            if t == 1:
                assert torch.equal(cache.recurrent[0], held[0]) and torch.equal(cache.conv[0], held[1])
    for i, n in enumerate(lens):
        start = int(full_cu[i])
        assert torch.allclose(got_prompt[0, int(prompt_cu[i]) : int(prompt_cu[i + 1])], want[0, start : start + n],
                              rtol=1e-10, atol=1e-12)
        for t in range(steps):
            if t >= 1 and i == 1:
                continue  # the request sat out step 1, so its later steps no longer follow the full sequence
            assert torch.allclose(got_steps[t][i, 0], want[0, start + n + t], rtol=1e-10, atol=1e-12), (i, t)


def test_kda_cache_reset_zeroes_its_slots():
    from torch_kda.nn import KDACache

    layer = KimiDeltaAttention(32, 2, 8)
    cache = KDACache(layer, 3)
    cache.recurrent.fill_(1.0)
    cache.conv.fill_(1.0)
    cache.reset([2])
    assert (cache.recurrent[2] == 0).all() and (cache.conv[2] == 0).all()
    assert (cache.recurrent[:2] == 1).all() and (cache.conv[:2] == 1).all() and (cache.conv[3] == 1).all()
