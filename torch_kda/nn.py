"""The KDA layer of Kimi-Linear as an nn.Module, built on torch_kda.kda.

Shapes: hidden states x [B, T, hidden_size]; with cu_seqlens ([N + 1]) B must be 1
and the N sequences are packed along T. H = num_heads (q and k), HV = num_v_heads (v,
the gate, beta, the state and the output; H unless grouped), d = head_dim (K = V = d).
"""
import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torch_kda._ops import kda, kda_pool
from torch_kda import distributed  # its _gather is the one seam for every collective


class KDAState(NamedTuple):
    """Recurrent state of one KimiDeltaAttention layer, per sequence.

    recurrent: [N, HV, d, d], V-first (state[n, h, v, k] = S[k, v]); fp32 unless the
    state first passed in had another dtype.
    conv_q, conv_k: [N, H * d, conv_size - 1], conv_v: [N, HV * d, conv_size - 1], the
    last inputs of each short convolution (oldest first).
    """

    recurrent: torch.Tensor
    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor


class KDACache:
    """Generation state of one KimiDeltaAttention layer, per request slot.

    recurrent: [slots, HV, d, d] (V-first), the KDA state pool that
        torch_kda.kda_pool reads and writes in place; fp32 unless `dtype` says.
    conv: [slots + 1, (2 H + HV) * d, conv_size - 1], the last inputs of the q, k
        and v convolutions (their channels in that order, oldest input first), in
        the layer's dtype; the extra last slot takes what padding rows (slot < 0) write.
    A new request's slot must be zeroed first (reset).
    """

    def __init__(self, layer, slots, dtype=torch.float32, device=None):
        H, HV, d, W = layer.num_heads, layer.num_v_heads, layer.head_dim, layer.conv_size
        device = layer.q_proj.weight.device if device is None else device
        self.slots = slots
        self.recurrent = torch.zeros(slots, HV, d, d, dtype=dtype, device=device)
        self.conv = torch.zeros(slots + 1, (2 * H + HV) * d, W - 1, dtype=layer.q_proj.weight.dtype, device=device)

    def reset(self, slots):
        """Zeroes the given slots (a LongTensor or list of slot indices) for new requests."""
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.recurrent.device)
        self.recurrent[slots] = 0
        self.conv[slots] = 0


def _halo_sources(lengths, rank, width):
    """Where one sequence's carried inputs on rank `rank` come from: [(rank j, row in
    j's last-`width` tail of it)] for each of the `width` positions (oldest first),
    None for zeros before the sequence's first token; lengths[j]: its tokens on rank j."""
    history = [None] * width
    for j in range(rank):
        n = min(lengths[j], width)
        history += [(j, width - n + i) for i in range(n)]
    return history[-width:] if width else []


class _Halo(torch.autograd.Function):
    """[N, C, width]: for each of the N sequences in this rank's packed slices zs
    ([1, L, C_i] each, C their channels side by side; offsets [N + 1]), the `width`
    inputs before its piece here, the earlier ranks' last ones (oldest first; zeros
    before the sequence's first token): ShortConvolutions' carried states under
    context parallelism, for all of zs in one exchange. Only the sequences' last
    `width` tokens are joined, not the slices. Every rank runs the same collectives
    forward and backward, whatever its slice holds."""

    @staticmethod
    def forward(ctx, offsets, width, group, *zs):
        offsets = [int(x) for x in offsets.tolist()]
        channels = [z.shape[-1] for z in zs]
        N, C, z0 = len(offsets) - 1, sum(channels), zs[0]
        rank = dist.get_rank(group)
        tail = z0.new_zeros(N, width, C)  # each sequence's last inputs here, front-padded
        for n in range(N):
            start, end = offsets[n], offsets[n + 1]
            m = min(end - start, width)
            if m:
                tail[n, width - m:] = torch.cat([z[0, end - m:end] for z in zs], -1)
        lengths = torch.tensor([offsets[n + 1] - offsets[n] for n in range(N)], device=z0.device)
        all_lengths = distributed._gather(lengths, group).tolist()  # [rank][sequence]
        tails = distributed._gather(tail, group)
        carried = z0.new_zeros(N, width, C)
        for n in range(N):
            for p, src in enumerate(_halo_sources([row[n] for row in all_lengths], rank, width)):
                if src is not None:
                    carried[n, p] = tails[src[0]][n, src[1]]
        ctx.offsets, ctx.all_lengths, ctx.width, ctx.group, ctx.rank = offsets, all_lengths, width, group, rank
        ctx.shapes, ctx.channels = [z.shape for z in zs], channels
        return carried.transpose(1, 2)

    @staticmethod
    def backward(ctx, d_carried):
        width, rank, offsets, all_lengths = ctx.width, ctx.rank, ctx.offsets, ctx.all_lengths
        d = d_carried.transpose(1, 2).contiguous()  # [N, width, C]
        all_d = distributed._gather(d, ctx.group)
        dzs = [d.new_zeros(shape) for shape in ctx.shapes]
        for n in range(len(offsets) - 1):
            lengths = [row[n] for row in all_lengths]
            d_tail = d.new_zeros(width, d.shape[2])
            for r in range(rank + 1, len(all_lengths)):
                for p, src in enumerate(_halo_sources(lengths, r, width)):
                    if src is not None and src[0] == rank:
                        d_tail[src[1]] += all_d[r][n, p]
            end = offsets[n + 1]
            m = min(end - offsets[n], width)
            if m:
                for dz, piece in zip(dzs, d_tail[width - m:].split(ctx.channels, -1)):
                    dz[0, end - m:end] = piece
        return (None, None, None, *dzs)


def _at_least_fp32(dtype):
    """float32 for half types, the dtype itself for float32 and float64."""
    return torch.promote_types(dtype, torch.float32)


def _sequence_offsets(B, T, cu_seqlens, device):
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"KimiDeltaAttention: x must have batch size 1 with cu_seqlens, got {B}")
        return cu_seqlens.to(device=device, dtype=torch.long)
    return torch.arange(B + 1, device=device) * T


class ShortConvolution(nn.Module):
    """Causal depthwise 1-D convolution over time with SiLU, one sequence at a time:
    a packed sequence never sees the tokens of the one before it. The weight is
    [channels, 1, kernel_size] as nn.Conv1d(groups=channels) keeps it, fp32 as
    Kimi-Linear's checkpoints hold it; weight[:, 0, -1] multiplies the current token.
    Sums in fp32 (float64 for float64 inputs), rounds once to the input's dtype.
    Written with fixed-shape tensor ops (no data-dependent sizes), so it compiles
    without graph breaks and never reads cu_seqlens on the host."""

    def __init__(self, channels, kernel_size=4, device=None):
        super().__init__()
        self.channels = channels
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, device=device, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def forward(self, x, offsets, state=None, output_state=False, state_name="state"):
        """x [1, L, C] packed tokens; offsets [N + 1] token offsets (int64, on x's
        device); state [N, C, W - 1] or None (zeros). Returns (y [1, L, C], new state or None).
        state_name is how errors call the state (the layer passes e.g. "state.conv_q")."""
        W = self.kernel_size
        L, C = x.shape[1], x.shape[2]
        N = offsets.shape[0] - 1
        if state is not None and tuple(state.shape) != (N, C, W - 1):
            raise ValueError(
                f"ShortConvolution: {state_name} must have shape [N, C, W - 1] = [{N}, {C}, {W - 1}], "
                f"got {list(state.shape)}")
        # One buffer holds every sequence's carried inputs (W - 1 rows each), then the
        # tokens; each tap and the new state are gathers from it, never a masked product
        # (a non-finite input elsewhere would turn 0 * inf into NaN).
        carried = (torch.zeros(N * (W - 1), C, dtype=x.dtype, device=x.device) if state is None
                   else state.to(x.dtype).transpose(1, 2).reshape(N * (W - 1), C))
        buf = torch.cat([carried, x[0]])
        last = max(buf.shape[0] - 1, 0)

        def rows(seq, pos):
            """Buffer rows of the inputs at in-sequence positions `pos` (< 0: carried) of
            sequences `seq`; clamped so that a malformed cu_seqlens cannot index out of bounds."""
            inside = N * (W - 1) + offsets[seq] + pos
            before = seq * (W - 1) + (W - 1) + pos
            return torch.where(pos >= 0, inside, before).clamp(0, last)

        t = torch.arange(L, device=x.device)
        # seq[t] = the number of inner boundaries at or before t, counted by a scatter and a
        # cumsum rather than searchsorted: inductor's GPU lowering of searchsorted fails on a
        # sliced boundary tensor (torch 2.11: "NotImplementedError: SliceView").
        marks = torch.zeros(L + 1, dtype=torch.int64, device=x.device)
        inner = offsets[1:N].to(torch.int64).clamp(0, L)
        marks = marks.index_add(0, inner, torch.ones_like(inner))
        seq = marks.cumsum(0)[:L].clamp(0, max(N - 1, 0))  # [L]
        pos = t - offsets[seq]
        acc_dtype = _at_least_fp32(torch.promote_types(x.dtype, self.weight.dtype))
        weight = self.weight[:, 0].to(acc_dtype)
        y = torch.zeros(L, C, dtype=acc_dtype, device=x.device)
        for j in range(W):  # tap j reads the input W - 1 - j steps back
            y = y + buf[rows(seq, pos - (W - 1 - j))].to(acc_dtype) * weight[:, j]
        y = F.silu(y).to(x.dtype)[None]
        if not output_state:
            return y, None
        # The last W - 1 inputs of each sequence (carried ones for short sequences).
        n = torch.arange(N, device=x.device)[:, None]
        lengths = (offsets[1:] - offsets[:-1])[:, None]
        tail = lengths - (W - 1) + torch.arange(W - 1, device=x.device)[None, :]  # [N, W-1]
        return y, buf[rows(n, tail)].transpose(1, 2)  # [N, C, W-1]


class GatedRMSNorm(nn.Module):
    """RMSNorm over the head dimension, then times sigmoid(gate)."""

    def __init__(self, dim, eps=1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x, gate):
        dtype = _at_least_fp32(x.dtype)
        xf = x.to(dtype)
        normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(dtype) * torch.sigmoid(gate.to(dtype))).to(x.dtype)


_REQUIRED = object()

# Keys of the layer's earlier layout -> (the checkpoint layout's key, how its tensor changes).
_LEGACY_KEYS = {
    "q_conv.weight": ("q_conv1d.weight", lambda w: w.unsqueeze(1)),
    "k_conv.weight": ("k_conv1d.weight", lambda w: w.unsqueeze(1)),
    "v_conv.weight": ("v_conv1d.weight", lambda w: w.unsqueeze(1)),
    "f_proj.0.weight": ("f_a_proj.weight", None),
    "f_proj.1.weight": ("f_b_proj.weight", None),
    "g_proj.0.weight": ("g_a_proj.weight", None),
    "g_proj.1.weight": ("g_b_proj.weight", None),
    "g_proj.1.bias": ("g_b_proj.bias", None),
    "gate.A_log": ("A_log", lambda a: a.reshape(1, 1, -1, 1)),
    "gate.dt_bias": ("dt_bias", lambda b: b.reshape(-1)),
}


def convert_legacy_state_dict(state_dict):
    """A state dict of KimiDeltaAttention layers saved in the layout before Kimi-Linear's
    checkpoint names (q_conv, f_proj.0/1, g_proj.0/1, gate.A_log, gate.dt_bias), in the
    checkpoint layout: keys renamed by their last components, whatever prefix they
    have, convolution weights [C, W] -> [C, 1, W], A_log [HV] -> [1, 1, HV, 1], dt_bias
    [HV, d] -> [HV d]. Other keys pass through. The old layout's output gate had a
    bias (g_proj.1.bias -> g_b_proj.bias): load the result into layers built with
    output_gate_bias=True, which lose nothing.

        layer.load_state_dict(torch_kda.nn.convert_legacy_state_dict(old))
    """
    out = {}
    for key, value in state_dict.items():
        for old, (new, change) in _LEGACY_KEYS.items():
            if key == old or key.endswith("." + old):
                key = key[: len(key) - len(old)] + new
                value = change(value) if change is not None else value
                break
        out[key] = value
    return out


def _refuse_legacy_keys(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                        error_msgs):
    """A load_state_dict pre-hook: the earlier layout's keys stop the load, strict or
    not, before the layer's parameters take any value, and say what to do."""
    old = [prefix + k for k in _LEGACY_KEYS if prefix + k in state_dict]
    if old:
        bias = prefix + "g_proj.1.bias" in state_dict
        raise RuntimeError(
            f"KimiDeltaAttention: {', '.join(old)} are keys of the layout before Kimi-Linear's checkpoint names; "
            f"convert the state dict with torch_kda.nn.convert_legacy_state_dict(state_dict)"
            + (" and build the layer with output_gate_bias=True (it has an output-gate bias)" if bias else ""))
    if prefix + "g_b_proj.bias" in state_dict and module.g_b_proj.bias is None:
        raise RuntimeError(
            f"KimiDeltaAttention: {prefix}g_b_proj.bias is an output-gate bias, which Kimi-Linear's layer does "
            f"not have; build the layer with output_gate_bias=True to load it")


class KimiDeltaAttention(nn.Module):
    """The KDA layer of Kimi-Linear, with the parameters of its released checkpoints.

    q, k, v projections with short causal convolutions (kernel conv_size, SiLU) that
    respect sequence boundaries; the low-rank gate projection with per-head A_log and
    per-channel dt_bias; the beta projection; the KDA core (torch_kda.kda); an output
    gate through a sigmoid-gated RMSNorm; the output projection.

    Parameters, as named, shaped and typed in Kimi-Linear's checkpoints, so that
    `load_state_dict(layer_tensors, strict=True)` takes one layer's tensors as stored
    (d = head_dim, H = num_heads, HV = num_v_heads):
        q_proj, k_proj [H d, hidden]; v_proj [HV d, hidden]      (Linear, no bias)
        q_conv1d, k_conv1d [H d, 1, W]; v_conv1d [HV d, 1, W]   (fp32)
        f_a_proj [d, hidden]; f_b_proj [HV d, d]                (the gate's input)
        A_log [1, 1, HV, 1]; dt_bias [HV d]                      (fp32)
        b_proj [HV, hidden]                                      (beta's logits)
        g_a_proj [d, hidden]; g_b_proj [HV d, d]                 (the output gate)
        o_norm.weight [d]; o_proj [hidden, HV d]
    The fp32 ones stay fp32 whatever `dtype` the layer is built with; the operator
    needs A_log and dt_bias in fp32 on CUDA. `.to(torch.bfloat16)` would round them
    too (the forward still hands the operator fp32): build with `dtype=` instead.

    Args:
        hidden_size: model width.
        num_heads: H, the heads of q and k.
        head_dim: d (K = V = d; 128 in the released models; on CUDA up to 256, speculative decoding up to 128).
        conv_size: W, the short convolutions' width (4).
        lower_bound: None for Kimi-Linear's softplus gate, lambda = -exp(A_log)
            softplus(g + dt_bias); a negative number for the bounded gate, lambda =
            lower_bound sigmoid(exp(A_log) (g + dt_bias)), of the models that
            configure `gate_lower_bound` (Kimi-K3 style): the same parameters, only
            the gate's formula differs.
        norm_eps: the gated RMSNorm's epsilon (the model's rms_norm_eps).
        num_v_heads: HV, the heads of v, the gate, beta, the state and the output; a
            multiple of H (grouped value heads: value head j reads query/key head
            j // (HV / H)); None for H.
        output_gate_bias: give g_b_proj a bias, as layers saved before the checkpoint
            layout had (see convert_legacy_state_dict); Kimi-Linear's has none.
        device, dtype: of the parameters, except the fp32 ones above.

    KimiDeltaAttention.from_config(config, layer_idx) builds layer layer_idx of a
    Kimi-Linear model from its config (a dict as in config.json, or an object with
    those attributes).

    forward(x [B, T, hidden_size], cu_seqlens=None, state=None, output_state=False,
    cp_group=None) returns (y [B, T, hidden_size], KDAState or None). Passing the
    returned state to the next call continues each sequence (chunked prefill,
    token-by-token generation). With cp_group (context parallelism) each rank passes
    its slice of the tokens, in rank order (packed: B = 1 and the whole batch's
    cu_seqlens on every rank); the short
    convolutions take the earlier ranks' last inputs, the KDA core runs across the
    group (torch_kda.distributed), and parameter gradients are this rank's part.

    forward_cached(x, cache, slots, cu_seqlens=None) serves generation from a
    KDACache: each request continues from its slot and leaves its state there
    (prefill and decoding steps alike; no gradient).
    """

    def __init__(self, hidden_size, num_heads, head_dim, conv_size=4, lower_bound=None, norm_eps=1e-5,
                 num_v_heads=None, output_gate_bias=False, device=None, dtype=None):
        super().__init__()
        if lower_bound is not None and not lower_bound < 0:
            raise ValueError(f"KimiDeltaAttention: lower_bound must be negative or None, got {lower_bound}")
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        if num_v_heads < num_heads or num_v_heads % num_heads != 0:
            raise ValueError(f"KimiDeltaAttention: num_v_heads must be a multiple of num_heads = {num_heads}, "
                             f"got {num_v_heads}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads
        self.head_dim = head_dim
        self.conv_size = conv_size
        self.lower_bound = lower_bound
        inner, inner_v = num_heads * head_dim, num_v_heads * head_dim
        factory = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, inner, bias=False, **factory)
        self.k_proj = nn.Linear(hidden_size, inner, bias=False, **factory)
        self.v_proj = nn.Linear(hidden_size, inner_v, bias=False, **factory)
        self.q_conv1d = ShortConvolution(inner, conv_size, device=device)
        self.k_conv1d = ShortConvolution(inner, conv_size, device=device)
        self.v_conv1d = ShortConvolution(inner_v, conv_size, device=device)
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False, **factory)
        self.f_b_proj = nn.Linear(head_dim, inner_v, bias=False, **factory)
        # Decay rates spread over heads (exp(A_log) in [1, 16]) and dt_bias the inverse
        # softplus of rates in [1e-3, 1e-1], as in Mamba-style initialisations.
        self.A_log = nn.Parameter(torch.empty(1, 1, num_v_heads, 1, device=device, dtype=torch.float32).uniform_(1, 16).log())
        dt = torch.empty(inner_v, device=device, dtype=torch.float32).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False, **factory)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False, **factory)
        self.g_b_proj = nn.Linear(head_dim, inner_v, bias=output_gate_bias, **factory)
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps, **factory)
        self.o_proj = nn.Linear(inner_v, hidden_size, bias=False, **factory)
        self.register_load_state_dict_pre_hook(_refuse_legacy_keys)

    @classmethod
    def from_config(cls, config, layer_idx, *, device=None, dtype=None):
        """Layer layer_idx (0-based) of a Kimi-Linear model: hidden_size, rms_norm_eps
        and linear_attn_config (num_heads, head_dim, short_conv_kernel_size; kda_layers,
        1-based as published, where present; gate_lower_bound, where present, selects
        the bounded gate). config: a dict as in config.json, or an object with those
        attributes. A configuration of another gate layout (use_full_rank_gate) is
        refused, as this layer's parameters would not be its checkpoint's."""
        def get(c, key, default=_REQUIRED):
            value = c.get(key, default) if isinstance(c, dict) else getattr(c, key, default)
            if value is _REQUIRED:
                raise ValueError(f"KimiDeltaAttention.from_config: the config has no {key!r}")
            return value

        linear = get(config, "linear_attn_config")
        if linear is None:
            raise ValueError("KimiDeltaAttention.from_config: linear_attn_config is None (a model without KDA layers)")
        if get(linear, "use_full_rank_gate", False):
            raise ValueError("KimiDeltaAttention.from_config: linear_attn_config.use_full_rank_gate is set; this layer "
                             "has Kimi-Linear's low-rank gate (f_a_proj, f_b_proj) only")
        kda_layers = get(linear, "kda_layers", None)
        if kda_layers is not None and layer_idx + 1 not in kda_layers:
            raise ValueError(f"KimiDeltaAttention.from_config: layer {layer_idx} (0-based) is not a KDA layer; "
                             f"linear_attn_config.kda_layers (1-based) = {list(kda_layers)}")
        return cls(
            get(config, "hidden_size"), get(linear, "num_heads"), get(linear, "head_dim"),
            conv_size=get(linear, "short_conv_kernel_size"), lower_bound=get(linear, "gate_lower_bound", None),
            norm_eps=get(config, "rms_norm_eps"), device=device, dtype=dtype,
        )

    def _gate(self):
        """A_log [HV] and dt_bias [HV, d] as the operator takes them, in fp32 (or float64)."""
        HV, d = self.num_v_heads, self.head_dim
        return (self.A_log.reshape(HV).to(_at_least_fp32(self.A_log.dtype)),
                self.dt_bias.reshape(HV, d).to(_at_least_fp32(self.dt_bias.dtype)))

    def forward(self, x, cu_seqlens=None, state: Optional[KDAState] = None, output_state: bool = False,
                cp_group=None):
        B, T, _ = x.shape
        HV, d = self.num_v_heads, self.head_dim
        if cp_group is not None and (state is not None or output_state):
            raise ValueError("KimiDeltaAttention: with cp_group each rank passes its slice of the tokens; "
                             "state and output_state are not served with it")
        if cp_group is not None and cu_seqlens is not None:
            # The whole batch's offsets, as every rank passes them: this slice's pieces.
            offsets = distributed.local_offsets(_sequence_offsets(B, T, cu_seqlens, x.device), T, cp_group)
        else:
            offsets = _sequence_offsets(B, T, cu_seqlens, x.device)
        packed = x.reshape(1, B * T, x.shape[-1])

        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        fields = ("conv_q", "conv_k", "conv_v")
        zs = [proj(packed) for proj in (self.q_proj, self.k_proj, self.v_proj)]
        if cp_group is not None:
            # One halo exchange for the three convolutions' carried inputs.
            halo = _Halo.apply(offsets, self.conv_size - 1, cp_group, *zs)
            carried = halo.split([c.channels for c in convs], dim=1)
        else:
            carried = [getattr(state, f) if state is not None else None for f in fields]
        outs = []
        for conv, z, h, field in zip(convs, zs, carried, fields):
            y, new = conv(z, offsets, h, output_state, state_name=f"state.{field}")
            outs.append((y.reshape(B, T, conv.channels // d, d), new))
        (q, conv_q), (k, conv_k), (v, conv_v) = outs
        g = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, HV, d)
        beta = self.b_proj(x)
        A_log, dt_bias = self._gate()
        if cp_group is not None:
            # The slice's offsets found above serve the recurrence too.
            o, recurrent = distributed._context_parallel(
                q, k, v, g.to(q.dtype), beta.to(q.dtype), A_log, dt_bias, cp_group, scale=None,
                lower_bound=self.lower_bound, initial_state=None, output_final_state=False,
                local_cu=offsets if cu_seqlens is not None else None)
        else:
            o, recurrent = kda(
                q, k, v, g.to(q.dtype), beta.to(q.dtype), A_log, dt_bias,
                lower_bound=self.lower_bound,
                initial_state=state.recurrent if state is not None else None,
                output_final_state=output_state,
                cu_seqlens=cu_seqlens,
            )
        o = self.o_norm(o, self.g_b_proj(self.g_a_proj(x)).reshape(B, T, HV, d))
        y = self.o_proj(o.reshape(B, T, HV * d))
        if not output_state:
            return y, None
        return y, KDAState(recurrent, conv_q, conv_k, conv_v)

    def forward_cached(self, x, cache: KDACache, slots, cu_seqlens=None):
        """x [N, T, hidden_size] for N requests (or [1, L, hidden_size] packed with
        cu_seqlens [N + 1]); slots [N] (int64, on x's device) their cache slots, a
        negative slot marking a padding row (its output is zero from the KDA core and
        it reads and writes no state). Returns y like x. Runs no host sync, so a
        decoding step can be captured in a CUDA graph and replayed with new slots."""
        B, T, _ = x.shape
        HV, d = self.num_v_heads, self.head_dim
        offsets = _sequence_offsets(B, T, cu_seqlens, x.device)
        packed = x.reshape(1, B * T, x.shape[-1])
        conv_slots = torch.where(slots < 0, torch.full_like(slots, cache.slots), slots)
        convs = ((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d), (self.v_proj, self.v_conv1d))
        carried = cache.conv[conv_slots].split([c.channels for _, c in convs], dim=1)  # each [N, C, W - 1]
        new_conv = []
        qkv = []
        for (proj, conv_mod), held in zip(convs, carried):
            y, new = conv_mod(proj(packed), offsets, held, True, state_name="cache.conv")
            qkv.append(y.reshape(B, T, conv_mod.channels // d, d))
            new_conv.append(new)
        q, k, v = qkv
        g = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, HV, d)
        beta = self.b_proj(x)
        A_log, dt_bias = self._gate()
        o = kda_pool(q, k, v, g.to(q.dtype), beta.to(q.dtype), A_log, dt_bias, cache.recurrent, slots,
                     lower_bound=self.lower_bound, cu_seqlens=cu_seqlens)
        cache.conv.index_copy_(0, conv_slots, torch.cat(new_conv, 1).to(cache.conv.dtype))
        o = self.o_norm(o, self.g_b_proj(self.g_a_proj(x)).reshape(B, T, HV, d))
        return self.o_proj(o.reshape(B, T, HV * d))
