"""The KDA layer of Kimi-Linear as an nn.Module, built on torch_kda.kda.

Shapes: hidden states x [B, T, hidden_size]; with cu_seqlens ([N + 1]) B must be 1
and the N sequences are packed along T. H = num_heads (q and k), HV = num_v_heads (v,
the gate, beta, the state and the output; H unless grouped), d = head_dim (K = V = d).
"""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from torch_kda._ops import kda, kda_pool
from torch_kda.distributed import context_parallel_kda, local_offsets


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
    """[N, C, width]: for each of the N sequences in this rank's packed slice z [1, L,
    C] (offsets [N + 1]), the `width` inputs before its piece here, the earlier ranks'
    last ones (oldest first; zeros before the sequence's first token): a
    ShortConvolution's carried state under context parallelism. Every rank runs the
    same collectives forward and backward, whatever its slice holds."""

    @staticmethod
    def forward(ctx, z, offsets, width, group):
        import torch.distributed as dist

        offsets = [int(x) for x in offsets.tolist()]
        N, C = len(offsets) - 1, z.shape[-1]
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        tail = z.new_zeros(N, width, C)  # each sequence's last inputs here, front-padded
        for n in range(N):
            start, end = offsets[n], offsets[n + 1]
            m = min(end - start, width)
            if m:
                tail[n, width - m:] = z[0, end - m:end]
        lengths = torch.tensor([offsets[n + 1] - offsets[n] for n in range(N)], device=z.device)
        all_lengths = [torch.empty_like(lengths) for _ in range(world)]
        dist.all_gather(all_lengths, lengths, group=group)
        all_lengths = torch.stack(all_lengths).tolist()  # [rank][sequence]
        tails = [torch.empty_like(tail) for _ in range(world)]
        dist.all_gather(tails, tail, group=group)
        carried = z.new_zeros(N, width, C)
        for n in range(N):
            for p, src in enumerate(_halo_sources([row[n] for row in all_lengths], rank, width)):
                if src is not None:
                    carried[n, p] = tails[src[0]][n, src[1]]
        ctx.offsets, ctx.all_lengths, ctx.width, ctx.group, ctx.rank = offsets, all_lengths, width, group, rank
        ctx.shape = z.shape
        return carried.transpose(1, 2)

    @staticmethod
    def backward(ctx, d_carried):
        import torch.distributed as dist

        width, rank, offsets, all_lengths = ctx.width, ctx.rank, ctx.offsets, ctx.all_lengths
        d = d_carried.transpose(1, 2).contiguous()  # [N, width, C]
        all_d = [torch.empty_like(d) for _ in all_lengths]
        dist.all_gather(all_d, d, group=ctx.group)
        dz = d.new_zeros(ctx.shape)
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
                dz[0, end - m:end] = d_tail[width - m:]
        return dz, None, None, None


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
    a packed sequence never sees the tokens of the one before it. Written with
    fixed-shape tensor ops (no data-dependent sizes), so it compiles without graph
    breaks and never reads cu_seqlens on the host."""

    def __init__(self, channels, kernel_size=4):
        super().__init__()
        self.channels = channels
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))
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
        weight = self.weight.to(x.dtype)
        y = torch.zeros(L, C, dtype=x.dtype, device=x.device)
        for j in range(W):  # tap j reads the input W - 1 - j steps back
            y = y + buf[rows(seq, pos - (W - 1 - j))] * weight[:, j]
        y = F.silu(y)[None]
        if not output_state:
            return y, None
        # The last W - 1 inputs of each sequence (carried ones for short sequences).
        n = torch.arange(N, device=x.device)[:, None]
        lengths = (offsets[1:] - offsets[:-1])[:, None]
        tail = lengths - (W - 1) + torch.arange(W - 1, device=x.device)[None, :]  # [N, W-1]
        return y, buf[rows(n, tail)].transpose(1, 2)  # [N, C, W-1]


class GatedRMSNorm(nn.Module):
    """RMSNorm over the head dimension, then times sigmoid(gate)."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate):
        dtype = _at_least_fp32(x.dtype)
        xf = x.to(dtype)
        normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(dtype) * torch.sigmoid(gate.to(dtype))).to(x.dtype)


class KDAGateParameters(nn.Module):
    """A_log [H] and dt_bias [H, d] in their own module, so that FSDP2 can keep them
    in fp32 (their own MixedPrecisionPolicy) while the rest of the layer runs in bf16:
    the operator requires them in fp32 on CUDA, and the gate is sensitive to them."""

    def __init__(self, num_heads, head_dim):
        super().__init__()
        # Decay rates spread over heads, as in Mamba-style initialisations.
        self.A_log = nn.Parameter(torch.log(torch.empty(num_heads).uniform_(1, 16)))
        dt = torch.exp(torch.empty(num_heads, head_dim).uniform_(torch.log(torch.tensor(1e-3)).item(),
                                                                   torch.log(torch.tensor(1e-1)).item()))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def forward(self):
        # Copies, not the parameters themselves: FSDP2 frees an unsharded parameter's
        # storage when this module's forward returns, before the operator reads it.
        return (
            self.A_log.to(_at_least_fp32(self.A_log.dtype), copy=True),
            self.dt_bias.to(_at_least_fp32(self.dt_bias.dtype), copy=True),
        )


class KimiDeltaAttention(nn.Module):
    """The KDA block of Kimi-Linear.

    q, k, v projections with short causal convolutions (kernel conv_size, SiLU) that
    respect sequence boundaries; the low-rank gate projection with per-head A_log and
    dt_bias (fp32); the beta projection; the KDA core (torch_kda.kda); an output gate
    with gated RMSNorm; the output projection.

    Args:
        hidden_size: model width.
        num_heads: H, the heads of q and k.
        head_dim: d (K = V = d; 128 in the shipped models, the size the CUDA kernels serve).
        conv_size: short convolution width (4).
        lower_bound: None for the softplus gate of Kimi-Linear; a negative number for the
            bounded gate lower_bound * sigmoid(exp(A_log) (g + dt_bias)).
        norm_eps: epsilon of the gated RMSNorm.
        num_v_heads: HV, the heads of v, the gate, beta, the state and the output; a
            multiple of H (grouped value heads: value head j reads query/key head
            j // (HV / H); CPU only); None for H.

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
                 num_v_heads=None):
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
        self.q_proj = nn.Linear(hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(hidden_size, inner_v, bias=False)
        self.q_conv = ShortConvolution(inner, conv_size)
        self.k_conv = ShortConvolution(inner, conv_size)
        self.v_conv = ShortConvolution(inner_v, conv_size)
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, head_dim, bias=False),
                                    nn.Linear(head_dim, inner_v, bias=False))
        self.gate = KDAGateParameters(num_v_heads, head_dim)
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, head_dim, bias=False),
                                    nn.Linear(head_dim, inner_v, bias=True))
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(inner_v, hidden_size, bias=False)

    def forward(self, x, cu_seqlens=None, state: Optional[KDAState] = None, output_state: bool = False,
                cp_group=None):
        B, T, _ = x.shape
        HV, d = self.num_v_heads, self.head_dim
        if cp_group is not None and (state is not None or output_state):
            raise ValueError("KimiDeltaAttention: with cp_group each rank passes its slice of the tokens; "
                             "state and output_state are not served with it")
        if cp_group is not None and cu_seqlens is not None:
            # The whole batch's offsets, as every rank passes them: this slice's pieces.
            offsets = local_offsets(_sequence_offsets(B, T, cu_seqlens, x.device), T, cp_group)
        else:
            offsets = _sequence_offsets(B, T, cu_seqlens, x.device)
        packed = x.reshape(1, B * T, x.shape[-1])

        def conv(proj, conv_mod, field):
            z = proj(packed)
            if cp_group is not None:
                carried = _Halo.apply(z, offsets, self.conv_size - 1, cp_group)
            else:
                carried = getattr(state, field) if state is not None else None
            y, new = conv_mod(z, offsets, carried, output_state, state_name=f"state.{field}")
            return y.reshape(B, T, conv_mod.channels // d, d), new

        q, conv_q = conv(self.q_proj, self.q_conv, "conv_q")
        k, conv_k = conv(self.k_proj, self.k_conv, "conv_k")
        v, conv_v = conv(self.v_proj, self.v_conv, "conv_v")
        g = self.f_proj(x).reshape(B, T, HV, d)
        beta = self.b_proj(x)
        A_log, dt_bias = self.gate()
        if cp_group is not None:
            o, recurrent = context_parallel_kda(q, k, v, g.to(q.dtype), beta.to(q.dtype), A_log, dt_bias,
                                                group=cp_group, lower_bound=self.lower_bound,
                                                cu_seqlens=cu_seqlens)
        else:
            o, recurrent = kda(
                q, k, v, g.to(q.dtype), beta.to(q.dtype), A_log, dt_bias,
                lower_bound=self.lower_bound,
                initial_state=state.recurrent if state is not None else None,
                output_final_state=output_state,
                cu_seqlens=cu_seqlens,
            )
        o = self.o_norm(o, self.g_proj(x).reshape(B, T, HV, d))
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
        convs = ((self.q_proj, self.q_conv), (self.k_proj, self.k_conv), (self.v_proj, self.v_conv))
        carried = cache.conv[conv_slots].split([c.channels for _, c in convs], dim=1)  # each [N, C, W - 1]
        new_conv = []
        qkv = []
        for (proj, conv_mod), held in zip(convs, carried):
            y, new = conv_mod(proj(packed), offsets, held, True, state_name="cache.conv")
            qkv.append(y.reshape(B, T, conv_mod.channels // d, d))
            new_conv.append(new)
        q, k, v = qkv
        g = self.f_proj(x).reshape(B, T, HV, d)
        beta = self.b_proj(x)
        A_log, dt_bias = self.gate()
        o = kda_pool(q, k, v, g.to(q.dtype), beta.to(q.dtype), A_log, dt_bias, cache.recurrent, slots,
                     lower_bound=self.lower_bound, cu_seqlens=cu_seqlens)
        cache.conv.index_copy_(0, conv_slots, torch.cat(new_conv, 1).to(cache.conv.dtype))
        o = self.o_norm(o, self.g_proj(x).reshape(B, T, HV, d))
        return self.o_proj(o.reshape(B, T, HV * d))
