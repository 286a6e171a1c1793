"""torch_kda.nn.KimiDeltaAttention against Kimi-Linear's released KDA layer.

A random checkpoint with the released key names, shapes and dtypes loads strictly,
and the layer's outputs and states equal a float64 reference written here from the
checkpoint's tensors alone (it uses no torch_kda code, so a shared mistake cannot
hide): prefill of fixed and packed batches, generation through `state` and through
KDACache, both gates. Also the migration of the layer's earlier layout and
from_config's errors; on CUDA, a bf16 layer of the released head size.
"""
import math
import types

import pytest
import torch
from torch import nn

import torch_kda
from conftest import rel, requires_cuda
from torch_kda.nn import KDACache, KDAState, KimiDeltaAttention, convert_legacy_state_dict

F64 = torch.float64
BF16 = torch.bfloat16
GATES = pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
LAYER = 2  # 0-based: the third layer, a KDA layer of make_config's kda_layers (1-based)
TOL = 1e-10  # float64 layer against the float64 reference


def make_config(lower_bound=None, hidden=24, heads=2, head_dim=8, conv=4, eps=1e-6):
    """A Kimi-Linear style config (as config.json holds it). hidden != heads * head_dim
    and head_dim != heads, so that a transposed or misassigned weight fails to load or
    to match; eps differs from the layer's default, so that it must be read."""
    linear = {
        "num_heads": heads,
        "head_dim": head_dim,
        "short_conv_kernel_size": conv,
        "kda_layers": [1, 3, 4],
        "full_attn_layers": [2],
    }
    if lower_bound is not None:
        linear["gate_lower_bound"] = lower_bound
    return {"hidden_size": hidden, "rms_norm_eps": eps, "linear_attn_config": linear}


def _sizes(config):
    lin = config["linear_attn_config"]
    return config["hidden_size"], lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]


def layer_prefix(layer_idx):
    return f"model.layers.{layer_idx}.self_attn."


def random_checkpoint(config, layer_idx, dtype):
    """One KDA layer's tensors as Kimi-Linear's checkpoint stores them: its key names
    (under model.layers.{layer_idx}.self_attn.), shapes, and dtypes (A_log, dt_bias and
    the convolutions fp32, the rest `dtype`), with random values that exercise
    every parameter: per-head decay rates exp(A_log) spread over [0.05, 2] (weak decays
    that carry state across many tokens, and strong ones), dt_bias ~ N(0, 1), norm
    weights away from 1, projections ~ N(0, 1 / fan_in)."""
    hidden, H, d, W = _sizes(config)

    def proj(rows, fan_in):
        return (torch.randn(rows, fan_in, dtype=F64) / math.sqrt(fan_in)).to(dtype)

    def conv(channels):
        return (torch.randn(channels, 1, W, dtype=F64) / math.sqrt(W)).float()

    # Log-uniform on [0.05, 2], one draw per stratum, so that every checkpoint has
    # both weak and strong decays, in a random head order.
    strata = (torch.arange(H, dtype=F64) + torch.rand(H, dtype=F64)) / H
    rates = 0.05 * 40.0 ** strata[torch.randperm(H)]
    tensors = {
        "q_proj.weight": proj(H * d, hidden),
        "k_proj.weight": proj(H * d, hidden),
        "v_proj.weight": proj(H * d, hidden),
        "q_conv1d.weight": conv(H * d),
        "k_conv1d.weight": conv(H * d),
        "v_conv1d.weight": conv(H * d),
        "f_a_proj.weight": proj(d, hidden),
        "f_b_proj.weight": proj(H * d, d),
        "A_log": rates.log().reshape(1, 1, H, 1).float(),
        "dt_bias": torch.randn(H * d, dtype=F64).float(),
        "b_proj.weight": proj(H, hidden),
        "g_a_proj.weight": proj(d, hidden),
        "g_b_proj.weight": proj(H * d, d),
        "o_norm.weight": torch.empty(d, dtype=F64).uniform_(0.5, 1.5).to(dtype),
        "o_proj.weight": proj(hidden, H * d),
    }
    return {layer_prefix(layer_idx) + name: t for name, t in tensors.items()}


def layer_tensors(checkpoint, layer_idx):
    """The tensors of one layer, keyed as the layer's own state dict keys them."""
    prefix = layer_prefix(layer_idx)
    return {k[len(prefix):]: v for k, v in checkpoint.items() if k.startswith(prefix)}


def loaded_layer(config, dtype, device=None):
    """A random checkpoint's layer-LAYER tensors, and the layer built from config and
    loaded from them strictly."""
    params = layer_tensors(random_checkpoint(config, LAYER, dtype), LAYER)
    layer = KimiDeltaAttention.from_config(config, LAYER, device=device, dtype=dtype)
    layer.load_state_dict(params, strict=True)
    return params, layer


def offsets(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0)


# --------------------------------------------------------------------------
# The released layer in float64, from the checkpoint's tensors alone.
# --------------------------------------------------------------------------


def _reference_sequence(p, config, x, start):
    """One sequence x [L, hidden]; start: a state that _reference_sequence returned
    (the sequence continues), or None (it begins here). Returns (y [L, hidden], its
    final state: S [H, d_k, d_v] and conv_q/k/v [W - 1, C], the last projected
    inputs of each convolution, oldest first)."""
    hidden, H, d, W = _sizes(config)
    lower_bound = config["linear_attn_config"].get("gate_lower_bound")
    eps = config["rms_norm_eps"]
    L = x.shape[0]
    if start is None:
        start = {"S": torch.zeros(H, d, d, dtype=F64)}
        start.update({f"conv_{c}": torch.zeros(W - 1, H * d, dtype=F64) for c in "qkv"})
    final = {}

    def short_conv(c):
        # The W - 1 inputs before the sequence's own (zeros before its first token);
        # weight[:, 0, W - 1] multiplies the current token, weight[:, 0, j] the one
        # W - 1 - j steps back.
        z = torch.cat([start[f"conv_{c}"], x @ p[f"{c}_proj.weight"].T])
        w = p[f"{c}_conv1d.weight"][:, 0]
        acc = sum(z[j:j + L] * w[:, j] for j in range(W))
        final[f"conv_{c}"] = z[L:]
        return (acc * torch.sigmoid(acc)).reshape(L, H, d)

    def l2norm(t):
        return t / torch.sqrt(t.square().sum(-1, keepdim=True) + 1e-6)

    q, k, v = l2norm(short_conv("q")), l2norm(short_conv("k")), short_conv("v")
    g = (x @ p["f_a_proj.weight"].T @ p["f_b_proj.weight"].T + p["dt_bias"]).reshape(L, H, d)
    rate = p["A_log"].reshape(H, 1).exp()
    if lower_bound is None:
        lam = -rate * torch.logaddexp(g, torch.zeros_like(g))  # softplus, without a linear cut-off
    else:
        lam = lower_bound * torch.sigmoid(rate * g)
    beta = torch.sigmoid(x @ p["b_proj.weight"].T)  # [L, H]

    S = start["S"].clone()  # [H, d_k, d_v]
    o = torch.zeros(L, H, d, dtype=F64)
    for t in range(L):
        S = lam[t].exp()[:, :, None] * S
        u = v[t] - torch.einsum("hkv,hk->hv", S, k[t])
        S = S + beta[t][:, None, None] * k[t][:, :, None] * u[:, None, :]
        o[t] = d ** -0.5 * torch.einsum("hkv,hk->hv", S, q[t])
    final["S"] = S

    z = x @ p["g_a_proj.weight"].T @ p["g_b_proj.weight"].T
    if "g_b_proj.bias" in p:
        z = z + p["g_b_proj.bias"]
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + eps) * p["o_norm.weight"] * torch.sigmoid(z.reshape(L, H, d))
    return o.reshape(L, H * d) @ p["o_proj.weight"].T, final


def reference_layer(params, config, x, cu_seqlens=None, initial=None):
    """The released layer on x [B, T, hidden] (with cu_seqlens [N + 1]: B = 1 and N
    packed sequences), in float64 from the layer's tensors `params`. initial: a list
    of per-sequence states that an earlier call returned, to continue from.
    Returns (y [B, T, hidden], the list of per-sequence final states)."""
    p = {name: t.detach().to("cpu", F64) for name, t in params.items()}
    x = x.detach().to("cpu", F64)
    B, T, _ = x.shape
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        assert B == 1
        cu = cu_seqlens.tolist()
        spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    y = torch.zeros(B, T, config["hidden_size"], dtype=F64)
    finals = []
    for n, (b, lo, hi) in enumerate(spans):
        y[b, lo:hi], final = _reference_sequence(p, config, x[b, lo:hi], None if initial is None else initial[n])
        finals.append(final)
    return y, finals


def expected_state(finals):
    """The reference's per-sequence states laid out as KDAState: recurrent V-first
    [N, H, d_v, d_k], convolutions [N, C, W - 1]."""
    return KDAState(
        torch.stack([f["S"].transpose(-1, -2) for f in finals]),
        *(torch.stack([f[f"conv_{c}"].T for f in finals]) for c in "qkv"),
    )


def assert_state_matches(state, finals, tol):
    for name, got, want in zip(KDAState._fields, state, expected_state(finals)):
        assert got.shape == want.shape, name
        assert rel(got, want) <= tol, name


# --------------------------------------------------------------------------
# Loading the checkpoint.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, torch.float32, F64], ids=["bf16", "fp32", "f64"])
def test_checkpoint_loads_strictly_with_its_names_shapes_and_dtypes(dtype):
    """The layer's state dict is the checkpoint's layout exactly (names, shapes and
    dtypes, the fp32 parameters fp32 whatever the layer's dtype), so a strict load
    neither misses nor rounds anything."""
    config = make_config()
    params = layer_tensors(random_checkpoint(config, LAYER, dtype), LAYER)
    layer = KimiDeltaAttention.from_config(config, LAYER, dtype=dtype)

    def layout(sd):
        return {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}

    assert layout(layer.state_dict()) == layout(params)
    fp32 = {"A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"}
    for name, t in layer.state_dict().items():
        assert t.dtype == (torch.float32 if name in fp32 else dtype), name

    result = layer.load_state_dict(params, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for name, t in layer.state_dict().items():
        assert torch.equal(t, params[name]), name


# --------------------------------------------------------------------------
# Prefill against the reference.
# --------------------------------------------------------------------------

LAYOUTS = {
    # name: (B, T, seqlens, conv size)
    "fixed": (2, 7, None, 4),
    # an empty sequence, and sequences shorter than the convolution
    "varlen": (1, None, [6, 0, 2, 1, 9, 3], 4),
    "varlen_conv3": (1, None, [4, 1, 0, 5], 3),
}


def _layout_inputs(layout, hidden):
    B, T, seqlens, _ = LAYOUTS[layout]
    cu = None
    if seqlens is not None:
        cu, T = offsets(seqlens), sum(seqlens)
    return torch.randn(B, T, hidden, dtype=F64), cu


@GATES
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_matches_the_released_layer(lower_bound, layout):
    """Outputs and final states of a float64 layer loaded from a checkpoint equal the
    reference: projections, convolutions restarted at every sequence start, gate,
    beta, the recurrence, the gated RMSNorm and the output projection as released."""
    config = make_config(lower_bound, conv=LAYOUTS[layout][3])
    params, layer = loaded_layer(config, F64)
    x, cu = _layout_inputs(layout, config["hidden_size"])
    y, state = layer(x, cu_seqlens=cu, output_state=True)
    want, finals = reference_layer(params, config, x, cu)
    assert y.dtype == F64 and y.shape == x.shape
    assert rel(y, want) <= TOL
    assert_state_matches(state, finals, TOL)


# --------------------------------------------------------------------------
# Generation against the reference over the whole sequences.
# --------------------------------------------------------------------------

PROMPTS, STEPS = [5, 0, 2, 7], 3  # an empty prompt and one shorter than the convolution


def _requests(hidden, dtype=F64, prompts=PROMPTS, steps=STEPS):
    """Each request's tokens [prompt + steps, hidden]: its prompt, then the tokens fed
    back one per decoding step."""
    return [torch.randn(n + steps, hidden, dtype=F64).to(dtype) for n in prompts]


def _reference_requests(params, config, seqs):
    """The reference over each whole request: its outputs and its final state."""
    outs, finals = [], []
    for s in seqs:
        y, f = reference_layer(params, config, s[None])
        outs.append(y[0])
        finals += f
    return outs, finals


def _split(want, prompts=PROMPTS, steps=STEPS):
    """The reference outputs as the prefill returns them (packed prompts) and as the
    steps do ([N, steps])."""
    prompt = torch.cat([w[:n] for w, n in zip(want, prompts)])[None]
    decoded = torch.stack([w[n:n + steps] for w, n in zip(want, prompts)])
    return prompt, decoded


@GATES
def test_generation_through_state_matches_the_released_layer(lower_bound):
    """A packed prefill that returns its state, then one token per request at a time
    with the state passed back: every output, and the final state, as the reference
    gives them over the whole sequences."""
    config = make_config(lower_bound)
    params, layer = loaded_layer(config, F64)
    seqs = _requests(config["hidden_size"])
    want, finals = _reference_requests(params, config, seqs)

    y, state = layer(torch.cat([s[:n] for s, n in zip(seqs, PROMPTS)])[None], cu_seqlens=offsets(PROMPTS),
                     output_state=True)
    steps = []
    for t in range(STEPS):
        yt, state = layer(torch.stack([s[n + t] for s, n in zip(seqs, PROMPTS)])[:, None], state=state,
                          output_state=True)
        steps.append(yt)
    want_prompt, want_steps = _split(want)
    assert rel(y, want_prompt) <= TOL
    assert rel(torch.cat(steps, 1), want_steps) <= TOL
    assert_state_matches(state, finals, TOL)


def test_reference_continues_from_its_state():
    """The reference's returned state continues a sequence as if it had not been cut
    (what the generation tests' expectations rest on)."""
    config = make_config()
    params = layer_tensors(random_checkpoint(config, LAYER, F64), LAYER)
    x = torch.randn(1, 9, config["hidden_size"], dtype=F64)
    whole, whole_final = reference_layer(params, config, x)
    head, mid = reference_layer(params, config, x[:, :2])
    tail, final = reference_layer(params, config, x[:, 2:], initial=mid)
    assert rel(torch.cat([head, tail], 1), whole) <= 1e-13
    assert_state_matches(expected_state(final), whole_final, 1e-13)


@GATES
def test_generation_through_kda_cache_matches_the_released_layer(lower_bound):
    """KDACache and forward_cached: a packed prefill into slots in a shuffled order,
    then decoding steps of one token per request, the requests in a new order each
    step: outputs as the reference gives them over the whole sequences, each request's
    final state in its slot, the unused slots untouched."""
    config = make_config(lower_bound)
    params, layer = loaded_layer(config, F64)
    seqs = _requests(config["hidden_size"])
    want, finals = _reference_requests(params, config, seqs)
    N = len(PROMPTS)
    cache = KDACache(layer, N + 3, dtype=F64)
    slots = torch.randperm(N + 3)[:N]

    with torch.no_grad():
        y = layer.forward_cached(torch.cat([s[:n] for s, n in zip(seqs, PROMPTS)])[None], cache, slots,
                                 cu_seqlens=offsets(PROMPTS))
        steps = torch.zeros(N, STEPS, config["hidden_size"], dtype=F64)
        for t in range(STEPS):
            order = torch.randperm(N)
            x = torch.stack([seqs[i][PROMPTS[i] + t] for i in order.tolist()])[:, None]
            steps[order, t] = layer.forward_cached(x, cache, slots[order])[:, 0]
    want_prompt, want_steps = _split(want)
    assert rel(y, want_prompt) <= TOL
    assert rel(steps, want_steps) <= TOL

    want_state = expected_state(finals)
    assert rel(cache.recurrent[slots], want_state.recurrent) <= TOL
    assert rel(cache.conv[slots], torch.cat(want_state[1:], 1)) <= TOL
    unused = torch.tensor([s for s in range(N + 3) if s not in slots.tolist()])
    assert not cache.recurrent[unused].any() and not cache.conv[unused].any()


# --------------------------------------------------------------------------
# The layer's earlier layout.
# --------------------------------------------------------------------------

_OLD_NAMES = {
    "f_a_proj.weight": "f_proj.0.weight",
    "f_b_proj.weight": "f_proj.1.weight",
    "g_a_proj.weight": "g_proj.0.weight",
    "g_b_proj.weight": "g_proj.1.weight",
    "g_b_proj.bias": "g_proj.1.bias",
}


def legacy_layout(params):
    """The same tensors in the layer's earlier layout: convolutions [C, W] named
    q/k/v_conv, the gate's parameters in a `gate` submodule (A_log [H], dt_bias
    [H, d]), the low-rank projections as Sequentials."""
    H = params["A_log"].numel()
    old = {}
    for name, t in params.items():
        if name.endswith("_conv1d.weight"):
            old[name.replace("_conv1d", "_conv")] = t[:, 0].clone()
        elif name == "A_log":
            old["gate.A_log"] = t.reshape(H).clone()
        elif name == "dt_bias":
            old["gate.dt_bias"] = t.reshape(H, -1).clone()
        else:
            old[_OLD_NAMES.get(name, name)] = t
    return old


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not_strict"])
def test_legacy_keys_fail_the_load_and_say_what_to_do(strict):
    """Loading the earlier layout as is would leave renamed parameters at their initial
    values under strict=False: it fails either way, before any parameter changes,
    naming the old keys and the converter."""
    config = make_config()
    params = layer_tensors(random_checkpoint(config, LAYER, F64), LAYER)
    layer = KimiDeltaAttention.from_config(config, LAYER, dtype=F64)
    before = {name: t.clone() for name, t in layer.state_dict().items()}
    with pytest.raises(RuntimeError, match="convert_legacy_state_dict") as err:
        layer.load_state_dict(legacy_layout(params), strict=strict)
    for name, t in layer.state_dict().items():
        assert torch.equal(t, before[name]), f"{name} changed by a load that failed"
    message = str(err.value)
    for key in ("q_conv.weight", "k_conv.weight", "v_conv.weight", "f_proj.0.weight", "f_proj.1.weight",
                "g_proj.0.weight", "g_proj.1.weight", "gate.A_log", "gate.dt_bias"):
        assert key in message, key
    assert "output_gate_bias" not in message  # no bias in this dict: nothing to say about one


@GATES
def test_converted_legacy_state_dict_loads_strictly_and_gives_the_same_outputs(lower_bound):
    """convert_legacy_state_dict gives back the checkpoint layout exactly, under a
    model's prefix too, and the converted layer computes what the checkpoint's does."""
    config = make_config(lower_bound)
    params, direct = loaded_layer(config, F64)
    converted = convert_legacy_state_dict(legacy_layout(params))
    assert converted.keys() == params.keys()
    for name, t in converted.items():
        assert t.shape == params[name].shape and t.dtype == params[name].dtype, name
        assert torch.equal(t, params[name]), name

    layer = KimiDeltaAttention.from_config(config, LAYER, dtype=F64)
    layer.load_state_dict(converted, strict=True)
    x, cu = _layout_inputs("varlen", config["hidden_size"])
    y, _ = layer(x, cu_seqlens=cu)
    assert torch.equal(y, direct(x, cu_seqlens=cu)[0])
    assert rel(y, reference_layer(params, config, x, cu)[0]) <= TOL

    model = nn.Module()
    model.attn = KimiDeltaAttention.from_config(config, LAYER, dtype=F64)
    old = {"attn." + k: v for k, v in legacy_layout(params).items()}
    with pytest.raises(RuntimeError, match=r"attn\.gate\.A_log.*convert_legacy_state_dict"):
        model.load_state_dict(old)
    model.load_state_dict(convert_legacy_state_dict(old), strict=True)
    assert torch.equal(model.attn(x, cu_seqlens=cu)[0], y)


def test_legacy_output_gate_bias_needs_a_layer_with_one():
    """The earlier layout's output gate had a bias, which Kimi-Linear's layer has not:
    such a dict, converted or not, fails to load into a default layer, strict or not,
    saying to build the layer with output_gate_bias=True, into which it loads and
    computes the released layer plus that bias."""
    config = make_config()
    hidden, H, d, W = _sizes(config)
    params = layer_tensors(random_checkpoint(config, LAYER, F64), LAYER)
    bias = torch.randn(H * d, dtype=F64)
    old = {**legacy_layout(params), "g_proj.1.bias": bias}
    default = KimiDeltaAttention.from_config(config, LAYER, dtype=F64)
    for strict in (True, False):
        with pytest.raises(RuntimeError, match="convert_legacy_state_dict.*output_gate_bias=True"):
            default.load_state_dict(old, strict=strict)
        with pytest.raises(RuntimeError, match=r"g_b_proj\.bias.*output_gate_bias=True"):
            default.load_state_dict(convert_legacy_state_dict(old), strict=strict)

    biased = KimiDeltaAttention(hidden, H, d, conv_size=W, norm_eps=config["rms_norm_eps"], output_gate_bias=True,
                                dtype=F64)
    biased.load_state_dict(convert_legacy_state_dict(old), strict=True)
    x, cu = _layout_inputs("varlen", hidden)
    want, _ = reference_layer({**params, "g_b_proj.bias": bias}, config, x, cu)
    assert rel(biased(x, cu_seqlens=cu)[0], want) <= TOL
    assert rel(reference_layer(params, config, x, cu)[0], want) > 1e-3  # the bias matters


# --------------------------------------------------------------------------
# from_config.
# --------------------------------------------------------------------------


def test_from_config_reads_every_field():
    config = make_config(-3.0, hidden=20, heads=3, head_dim=4, conv=2, eps=1e-4)
    layer = KimiDeltaAttention.from_config(config, LAYER)
    assert (layer.hidden_size, layer.num_heads, layer.head_dim, layer.conv_size) == (20, 3, 4, 2)
    assert layer.lower_bound == -3.0 and layer.o_norm.eps == 1e-4
    assert KimiDeltaAttention.from_config(make_config(), LAYER).lower_bound is None
    as_object = types.SimpleNamespace(**config)  # a transformers config: attributes, not keys
    built = KimiDeltaAttention.from_config(as_object, LAYER)
    assert {k: v.shape for k, v in built.state_dict().items()} == {k: v.shape for k, v in layer.state_dict().items()}


@pytest.mark.parametrize("layer_idx", [1, 4, 10])
def test_from_config_rejects_a_layer_that_is_not_kda(layer_idx):
    """kda_layers is 1-based: layer_idx 1 (0-based) is the config's full-attention layer 2."""
    with pytest.raises(ValueError, match=rf"layer {layer_idx} \(0-based\) is not a KDA layer.*"
                                         r"kda_layers \(1-based\) = \[1, 3, 4\]"):
        KimiDeltaAttention.from_config(make_config(), layer_idx)


@pytest.mark.parametrize("layer_idx", [0, 2, 3])
def test_from_config_accepts_the_kda_layers(layer_idx):
    assert isinstance(KimiDeltaAttention.from_config(make_config(), layer_idx), KimiDeltaAttention)


def test_from_config_without_kda_layers_accepts_any_layer():
    config = make_config()
    del config["linear_attn_config"]["kda_layers"]
    for layer_idx in range(6):
        KimiDeltaAttention.from_config(config, layer_idx)


@pytest.mark.parametrize("where,key", [
    ("config", "hidden_size"), ("config", "linear_attn_config"),
    ("config", "rms_norm_eps"), ("linear", "num_heads"), ("linear", "head_dim"),
    ("linear", "short_conv_kernel_size"),
])
def test_from_config_names_a_missing_key(where, key):
    config = make_config()
    del (config if where == "config" else config["linear_attn_config"])[key]
    with pytest.raises(ValueError, match=f"the config has no '{key}'"):
        KimiDeltaAttention.from_config(config, LAYER)


def test_from_config_refuses_a_full_rank_gate():
    config = make_config()
    config["linear_attn_config"]["use_full_rank_gate"] = True
    with pytest.raises(ValueError, match="use_full_rank_gate is set"):
        KimiDeltaAttention.from_config(config, LAYER)


def test_from_config_of_a_model_without_kda_layers():
    config = {**make_config(), "linear_attn_config": None}
    with pytest.raises(ValueError, match="linear_attn_config is None"):
        KimiDeltaAttention.from_config(config, LAYER)


# --------------------------------------------------------------------------
# bf16, the released head size (K = V = 128), on the CPU and on CUDA.
# --------------------------------------------------------------------------

# bf16 activations (projections, convolution outputs, the gate input, the KDA
# output, the norm and y itself) put the layer ~5e-3 from a float64 evaluation of
# the same bf16 parameters: over seeds the CPU measures 3.9e-3 to 4.7e-3, up to
# 6.1e-3 on the twelve decoded tokens (a small sample), CUDA 3.9e-3 to 4.8e-3. 2e-2
# on CUDA is what test_cuda_pool.py's forward_cached test allows between the layer's
# bf16 paths: room for the CUDA kernels' bf16 products. The convolutions' own
# rounding is pinned by test_nn.py's ShortConvolution test.
BF16_TOL = {"cpu": 8e-3, "cuda": 2e-2}


def _bf16_generation_matches_the_released_layer(lower_bound, device):
    """A bf16 layer (fp32 gate and convolutions, as loaded) with K = V = 128: a packed
    prefill and decoding steps, through `state` and through a KDACache with an fp32
    pool, against the float64 reference on the same bf16 parameters and inputs."""
    config = make_config(lower_bound, hidden=256, heads=2, head_dim=128, eps=1e-5)
    params, layer = loaded_layer(config, BF16, device=device)
    prompts, steps = [37, 0, 130, 5], 3
    seqs = _requests(config["hidden_size"], BF16, prompts, steps)
    want, _ = _reference_requests(params, config, seqs)
    want_prompt, want_steps = _split(want, prompts, steps)
    seqs = [s.to(device) for s in seqs]
    N = len(prompts)
    prompt = torch.cat([s[:n] for s, n in zip(seqs, prompts)])[None]
    cu = offsets(prompts).to(device)

    with torch.no_grad():
        y, state = layer(prompt, cu_seqlens=cu, output_state=True)
        decoded = []
        for t in range(steps):
            yt, state = layer(torch.stack([s[n + t] for s, n in zip(seqs, prompts)])[:, None], state=state,
                              output_state=True)
            decoded.append(yt)
        errors = {"state: prefill": rel(y.cpu(), want_prompt),
                  "state: steps": rel(torch.cat(decoded, 1).cpu(), want_steps)}

        cache = KDACache(layer, N + 2)
        assert cache.recurrent.dtype == torch.float32
        slots = torch.randperm(N + 2)[:N].to(device)
        y = layer.forward_cached(prompt, cache, slots, cu_seqlens=cu)
        decoded = torch.zeros(N, steps, config["hidden_size"], dtype=BF16, device=device)
        for t in range(steps):
            order = torch.randperm(N)
            x = torch.stack([seqs[i][prompts[i] + t] for i in order.tolist()])[:, None]
            decoded[order.to(device), t] = layer.forward_cached(x, cache, slots[order.to(device)])[:, 0]
        errors["cache: prefill"] = rel(y.cpu(), want_prompt)
        errors["cache: steps"] = rel(decoded.cpu(), want_steps)
    print("\n" + ", ".join(f"{name} {e:.2e}" for name, e in errors.items()))
    for name, e in errors.items():
        assert e <= BF16_TOL[torch.device(device).type], name


@GATES
@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.cuda, requires_cuda,
        pytest.mark.skipif(not torch_kda.cuda_built(), reason="the CUDA kernels exist in CUDA builds"),
    ]),
])
def test_bf16_layer_matches_the_released_layer(lower_bound, device):
    _bf16_generation_matches_the_released_layer(lower_bound, device)
