"""Thin Python wrappers over torch.ops.kda.* and the autograd registration.

Argument checks live in C++ (csrc/checks.cpp) so that direct callers of the
operators get the same errors; this file only maps Python conveniences
(None for "no final state") onto the schemas.
"""
import math
import numbers

import torch

import torch_kda._C  # noqa: F401  (loads the library: registers torch.ops.kda.*)


def _check_scalar(name, value):
    if value is None:
        return None
    # A plain float, the common case, needs no type check (every call pays for this function).
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.SymFloat, torch.SymInt)):
            raise TypeError(f"torch_kda: {name} must be a real number or None, got {type(value).__name__}")
    # Under torch.compile a float argument may be symbolic, and testing it here
    # would break the graph; the operator checks finiteness itself.
    if torch.compiler.is_compiling():
        return value
    if not math.isfinite(value):
        raise ValueError(f"torch_kda: {name} must be finite, got {value}")
    return float(value)


_SAVE_CHOICES = ("states_and_records", "states", "none")


def kda(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    *,
    scale=None,
    lower_bound=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    save_for_backward="states_and_records",
):
    """Kimi Delta Attention, differentiable.

    Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]
    (logits); A_log [HV] and dt_bias [HV, K], or both None (a precomputed gate:
    g is the log decay itself, <= 0, and lower_bound, if given, promises g >=
    lower_bound; g may then be float32); initial_state [N, HV, V, K] (V-first);
    cu_seqlens [N + 1] packs N sequences along T when B == 1. HV is H, or a
    multiple of it (grouped value heads: value head j reads query/key
    head j // (HV / H)).
    lower_bound < 0 selects the bounded gate, None the softplus gate;
    scale defaults to K ** -0.5.

    Returns (out [B, T, HV, V] in q's dtype, final_state [N, HV, V, K] or None).
    final_state has initial_state's dtype, else float32 (float64 for float64 inputs).
    On CUDA that dtype also sets the recurrence's precision: a bfloat16 state takes
    the state's products in bf16 (out and state ~3e-3 of float64, like fla's
    chunk_kda), a float32 state, or none, in bf16x3 (state ~5e-6).

    save_for_backward (CUDA, when a gradient is wanted): what the forward keeps
    for the backward. "states_and_records" (the fastest backward) keeps the
    state at every 16-token chunk's start (2 KiB per token and head at head
    size 128, 0.5 KiB at 64, 8 KiB at 256) and the chunks' prepared operands
    (1.66 KiB, 0.89 KiB, 3.19 KiB); "states" the states alone (the backward
    recomputes the operands); "none" neither (the least memory). The results
    are the same bits with each. The CPU backward recomputes from the inputs
    whatever this says.
    """
    if not isinstance(output_final_state, bool):
        raise TypeError(f"torch_kda.kda: output_final_state must be a bool, got {type(output_final_state).__name__}")
    args = (
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        _check_scalar("scale", scale),
        _check_scalar("lower_bound", lower_bound),
        initial_state,
        output_final_state,
        cu_seqlens,
    )
    if save_for_backward not in _SAVE_CHOICES:
        raise ValueError(
            f"torch_kda.kda: save_for_backward must be one of {', '.join(map(repr, _SAVE_CHOICES))}, "
            f"got {save_for_backward!r}"
        )
    # (Anything that is not a tensor goes to fwd, whose checks name it.)
    differentiable = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    if (
        isinstance(q, torch.Tensor)
        and q.is_cuda
        and torch.is_grad_enabled()
        and any(isinstance(t, torch.Tensor) and t.requires_grad for t in differentiable)
    ):
        out, final_state, _, _ = torch.ops.kda._fwd_checkpointed(*args, save=save_for_backward)
    else:
        out, final_state = torch.ops.kda.fwd.default(*args)
    return out, (final_state if output_final_state else None)


def fwd(
    q,
    k,
    v,
    g,
    beta,
    scale,
    out,
    A_log,
    dt_bias,
    lower_bound,
    initial_state=None,
    final_state=None,
    cu_seqlens=None,
):
    """Drop-in for flash_kda.fwd: writes `out` (and `final_state` if given) in place, returns None."""
    torch.ops.kda.fwd_.default(
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        out,
        final_state,
        _check_scalar("scale", scale),
        _check_scalar("lower_bound", lower_bound),
        initial_state,
        cu_seqlens,
    )


def kda_pool(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    state_pool,
    state_indices,
    *,
    scale=None,
    lower_bound=None,
    cu_seqlens=None,
    num_accepted_tokens=None,
    out=None,
):
    """KDA for serving from a state pool, in place; returns out.

    state_pool [slots, H, V, K] (bfloat16, float32 or float64; each slot
    contiguous, any slot stride, so a view of a larger cache works) holds every
    request's state. Request n (B = N requests of T tokens, or B = 1 with
    cu_seqlens) starts from slot state_indices[n] and leaves its final state
    there. Speculative decoding: state_indices [N, T_max] and
    num_accepted_tokens [N]; request n starts from slot
    state_indices[n, num_accepted_tokens[n] - 1] and the state after its token t
    goes to slot state_indices[n, t] (a negative entry: not written). A negative
    start slot marks a padding row: nothing is read or written and its out rows
    are zero. Slots named by different requests must differ. Pool rows that no
    index names are left as they are. out: [B, T, H, V] in q's dtype, allocated
    when None. No gradient.

    Out-of-range indices raise on the CPU; on CUDA reading them costs a device
    sync, so they are checked under TORCH_KDA_CHECK=1 only, and otherwise a slot
    past the pool makes its row a padding row. On CUDA, calls averaging at most
    8 tokens a request (and speculative calls) run token by token, longer ones
    the chunked forward; a varlen call mixing a long prefill with many decode
    requests runs the long one token by token, so call prefill and decode apart.
    """
    if out is None:
        out = torch.empty(v.shape, dtype=q.dtype, device=q.device) if isinstance(v, torch.Tensor) else None
    torch.ops.kda.fwd_pool_.default(
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        state_pool,
        state_indices,
        out,
        _check_scalar("scale", scale),
        _check_scalar("lower_bound", lower_bound),
        cu_seqlens,
        num_accepted_tokens,
    )
    return out


def get_workspace_size(T_total, H, N=1):
    """Kept for source compatibility with flash_kda: the operators allocate their
    own scratch through PyTorch's caching allocator, so no workspace is needed."""
    return 0


def cuda_built():
    """True when this build of torch_kda carries CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("kda::fwd", "CUDA")


def _save(ctx, inputs, checkpoints, records):
    # kda::fwd's twelve arguments; _fwd_checkpointed's `save` follows them.
    (q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, _output_final_state, cu_seqlens) = inputs[:12]
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, checkpoints, records)
    ctx.scale = scale
    ctx.lower_bound = lower_bound
    ctx.has_initial_state = initial_state is not None


def _setup_context(ctx, inputs, output):
    _save(ctx, inputs, None, None)


def _setup_context_checkpointed(ctx, inputs, output):
    checkpoints, records = output[2], output[3]
    ctx.mark_non_differentiable(checkpoints, records)
    # No zero-filled gradients for the checkpoints and records (3.7 KiB per
    # token and head); the backward fills in out's where it is missing.
    ctx.set_materialize_grads(False)
    _save(ctx, inputs, checkpoints, records)


def _backward_checkpointed(ctx, grad_out, grad_final_state, _grad_checkpoints, _grad_records):
    if grad_out is None:
        if grad_final_state is None:
            return (None,) * 13
        q, v = ctx.saved_tensors[0], ctx.saved_tensors[2]
        grad_out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    return _backward(ctx, grad_out, grad_final_state) + (None,)  # none for `save`


def _backward(ctx, grad_out, grad_final_state):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, checkpoints, records = ctx.saved_tensors
    if grad_final_state is not None and grad_final_state.numel() == 0:
        # final_state was not asked for: the op returned an empty placeholder.
        grad_final_state = None
    dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinitial_state = torch.ops.kda.bwd(
        grad_out,
        grad_final_state,
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        ctx.scale,
        ctx.lower_bound,
        initial_state,
        cu_seqlens,
        checkpoints,
        records,
    )
    if not ctx.has_initial_state:
        dinitial_state = None
    if A_log is None:  # a precomputed gate: bwd returned empty placeholders
        dA_log = ddt_bias = None
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, None, None, dinitial_state, None, None


def _no_double_backward_setup(ctx, inputs, output):
    pass


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(
        "torch_kda: the backward of kda is not differentiable (double backward, e.g. "
        "autograd.grad(..., create_graph=True) followed by another backward, is not supported)"
    )


torch.library.register_autograd("kda::fwd", _backward, setup_context=_setup_context)
torch.library.register_autograd(
    "kda::_fwd_checkpointed", _backward_checkpointed, setup_context=_setup_context_checkpointed
)
# Without this, a second-order gradient would silently differentiate only part of the
# backward kernel's internals; with it, asking for one raises.
torch.library.register_autograd("kda::bwd", _no_double_backward, setup_context=_no_double_backward_setup)
