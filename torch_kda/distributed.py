"""Context parallelism: one sequence's tokens split across the ranks of a
torch.distributed process group.

Given its slice's k, g and beta, a rank's stretch of tokens maps the state at its
start to the state at its end affinely (csrc/segments.h): X_end = X_start A + B,
A [K, K] the stretch's transitions (the end state from X_start = I with v = 0),
B [V, K] the end state from zero. So the forward is

  1. on every rank, A and B of its slice (two local forwards without outputs;
     rank 0's B from the initial state, so that it is that slice's true end state);
  2. one all-gather of every rank's A and B (float64, stacked into one tensor);
  3. on every rank, the fold of the earlier ranks' maps into its start state;
  4. on every rank, the local forward from that start state: its slice of out
     (and, on the last rank, the final state).

The backward is the dual: dX_start = dX_end A^T + C, C the start state's gradient
from the slice's outputs alone. Each rank finds its C (a local backward with no
final-state gradient), one all-gather of every C (beside the final state's gradient,
which the last rank's holds), a fold from the last rank back gives each rank dX_end,
and a local backward with it gives the slice's gradients. Nothing of size T crosses
ranks: per layer each rank sends N H (K K + V K) float64 numbers forward and 2 N H V K
back (at 32 heads of 128: 8 MiB each way per sequence), and receives W times that.

Packed batches (cu_seqlens) run each slice as a varlen call of all the batch's
sequences, most of them empty on a given rank: an empty piece passes the state
through (A = I, B its start), so one fold serves sequences that cross any number of
ranks, and the last rank's final states are every sequence's.

The collective sits behind one function, `_gather`, so that tests can run the
ranks' local steps in one process.
"""
import torch
import torch.distributed as dist

from torch_kda._ops import kda

__all__ = ["context_parallel_kda", "local_offsets"]


def _gather(x, group):
    """[W, *x.shape]: every rank's x, in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)


def local_offsets(cu_seqlens, tokens, group):
    """This rank's offsets [N + 1] of every packed sequence, for its slice of `tokens`
    tokens: the whole batch's cu_seqlens shifted to the slice's first token and clamped
    to the slice (a small gather of the slices' lengths, and a host sync)."""
    device = cu_seqlens.device
    lengths = _gather(torch.tensor([tokens], device=device), group).flatten().tolist()
    first = sum(lengths[: dist.get_rank(group)])
    return (cu_seqlens.to(torch.long) - first).clamp(0, tokens)


def _maps(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state=None, cu_seqlens=None):
    """This slice's (A [N, H, K, K], B [N, H, V, K]) in float64; B from initial_state
    (zeros where None): the first slice's B is its true end state. With cu_seqlens
    (this slice's offsets of every sequence, most of them empty here) N is its
    sequences, whose empty pieces pass the state through (A = I, B = its start)."""
    H, K = v.shape[2], k.shape[-1]
    N = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    kw = dict(scale=scale, lower_bound=lower_bound, output_final_state=True, cu_seqlens=cu_seqlens)
    eye = torch.eye(K, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32, device=q.device)
    _, A = kda(q, k, torch.zeros(*v.shape[:3], K, dtype=v.dtype, device=v.device), g, beta, A_log, dt_bias,
               initial_state=eye.expand(N, H, K, K).contiguous(), **kw)
    _, Bm = kda(q, k, v, g, beta, A_log, dt_bias, initial_state=initial_state, **kw)
    return A.double(), Bm.double()


def _fold(A, B):
    """The start states [W, N, H, V, K] (float64) of slices 1 .. W - 1 of W, from their
    maps A [W, N, H, K, K] and B [W, N, H, V, K] (slice 0's B its true end state);
    entry 0, slice 0's own initial state, is left zero."""
    starts = [torch.zeros_like(B[0]), B[0]]
    for r in range(1, A.shape[0] - 1):
        starts.append(starts[-1] @ A[r] + B[r])
    return torch.stack(starts[: A.shape[0]])


def _unfold_grads(A, C, grad_final):
    """dX_end [W, N, H, V, K] of every slice: the last slice's is grad_final, slice r's
    is slice r + 1's dX_start = dX_end A^T + C."""
    ends = [grad_final]
    for r in range(A.shape[0] - 1, 0, -1):
        ends.append(ends[-1] @ A[r].transpose(-1, -2) + C[r])
    return torch.stack(ends[::-1])


class _ContextParallelKDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound, group,
                state_dtype):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        with torch.no_grad():
            A, Bm = _maps(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens)
            # One collective: A [.., K, K] and B [.., V, K] stacked along their rows.
            maps = _gather(torch.cat([A, Bm], dim=-2), group)
            # A_all is kept for the backward: a copy, so that B's half of the gather is freed.
            A_all, B_all = maps[..., : A.shape[-2], :].contiguous(), maps[..., A.shape[-2]:, :]
            if rank == 0:
                start = (initial_state if initial_state is not None else torch.zeros_like(Bm)).to(state_dtype)
            else:
                start = _fold(A_all, B_all)[rank].to(state_dtype)
            out, final = kda(q, k, v, g, beta, A_log, dt_bias, scale=scale, lower_bound=lower_bound,
                             initial_state=start, output_final_state=True, cu_seqlens=cu_seqlens)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, start, A_all, cu_seqlens)
        ctx.scale, ctx.lower_bound, ctx.group = scale, lower_bound, group
        ctx.rank, ctx.world = rank, world
        ctx.has_initial_state = initial_state is not None
        return out, final.to(state_dtype)

    @staticmethod
    def backward(ctx, grad_out, grad_final):
        q, k, v, g, beta, A_log, dt_bias, start, A_all, cu_seqlens = ctx.saved_tensors
        kw = dict(scale=ctx.scale, lower_bound=ctx.lower_bound, initial_state=start, cu_seqlens=cu_seqlens)
        if grad_out is None:
            grad_out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
        # Only the last rank's final state is the sequence's: the others' are not outputs.
        if grad_final is None or ctx.rank != ctx.world - 1:
            grad_final = torch.zeros_like(start, dtype=torch.float64)
        grads = torch.ops.kda.bwd(grad_out, None, q, k, v, g, beta, A_log, dt_bias, **kw)
        # One collective: every rank's C beside its final-state gradient (the last rank's is the one read).
        both = _gather(torch.stack([grads[7].double(), grad_final.double()]), ctx.group)
        d_end = _unfold_grads(A_all, both[:, 0], both[-1, 1])[ctx.rank]
        grads = torch.ops.kda.bwd(grad_out, d_end.to(torch.float32 if start.dtype != torch.float64 else start.dtype),
                                  q, k, v, g, beta, A_log, dt_bias, **kw)
        dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dstart = grads
        if A_log is None:
            dA_log = ddt_bias = None
        d_init = dstart.to(start.dtype) if ctx.has_initial_state and ctx.rank == 0 else None
        return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, d_init, None, None, None, None, None


def context_parallel_kda(q, k, v, g, beta, A_log, dt_bias, *, group=None, scale=None, lower_bound=None,
                         initial_state=None, output_final_state=False, cu_seqlens=None):
    """Kimi Delta Attention over a sequence split along T across `group`'s ranks.

    Each rank passes its contiguous slice of every sequence (q, k, g [B, T_r, H, K],
    v [B, T_r, HV, V], beta [B, T_r, HV]; rank r holds the r-th slice, in rank
    order; the slices may differ in length), the same A_log and dt_bias (or None,
    a precomputed gate), and on rank 0 the initial state [B, HV, V, K] (None
    elsewhere). Returns (out [B, T_r, HV, V] of this slice, final_state [B, HV,
    V, K] on the last rank when output_final_state, else None), equal to
    torch_kda.kda on the whole sequence within the precision rules. Gradients
    reach every input; A_log's and dt_bias's are this rank's part (sum them over
    the group, as data-parallel training sums replicated parameters' gradients).

    Packed sequences: B = 1, each rank its contiguous slice of the packed tokens, and
    cu_seqlens [N + 1] the whole batch's offsets (the same on every rank); a sequence
    may start on one rank and end on another. States are then [N, HV, V, K]. Reading
    the slices' lengths costs one small gather and a host sync.
    """
    group = group if group is not None else dist.group.WORLD
    local_cu = None if cu_seqlens is None else local_offsets(cu_seqlens, q.shape[1], group)
    return _context_parallel(q, k, v, g, beta, A_log, dt_bias, group, scale=scale, lower_bound=lower_bound,
                             initial_state=initial_state, output_final_state=output_final_state, local_cu=local_cu)


def _context_parallel(q, k, v, g, beta, A_log, dt_bias, group, *, scale, lower_bound, initial_state,
                      output_final_state, local_cu):
    """context_parallel_kda with this slice's offsets already known (local_offsets, or
    None for a fixed-length batch), for callers that found them for other uses too."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if initial_state is not None and rank != 0:
        raise ValueError(f"context_parallel_kda: initial_state enters on rank 0 only, got one on rank {rank}")
    if initial_state is not None:
        state_dtype = initial_state.dtype
    else:
        state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out, final = _ContextParallelKDA.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, local_cu, scale,
                                           lower_bound, group, state_dtype)
    return out, (final if output_final_state and rank == world - 1 else None)
