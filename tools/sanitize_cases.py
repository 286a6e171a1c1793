"""Small calls of the CUDA kernels, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck python3 tools/sanitize_cases.py decode
    compute-sanitizer --tool racecheck python3 tools/sanitize_cases.py segments

decode: kda_pool's decode kernel (fp32 and bf16 pools; one token, a varlen batch
with a padding row and a request past a tile of tokens, speculative decoding, several
waves of blocks), kda::fwd_ with decode shapes (with and without an initial
state), grouped value heads, a precomputed fp32 gate's one token and speculative calls,
and pools of head sizes below 128 and above (the chunked path's copies at 200 x 256).
segments: a forward over forced segments (K1, three K2 passes, the scan).
head_sizes: the 64- and 256-wide forwards (K1, K2's 2x2 and 4x4 at 64, its 8x4 and
16x4 at 256, the segments' passes and scan): both gates, fp32 and bf16 states, K = V = 64, K = 48, V = 64 and
K = 256, V = 200 on a varlen batch; steps at 256 x 200 and 48 x 64 whose
backward runs the 256- and 64-wide kernels on the padded problem, with each of
the dS recurrence's block shapes there and with a precomputed gate.
backward: forward + backward steps of both gates, of grouped value heads and of a
precomputed gate (fp32 and bf16 g) on varlen sequences (an empty one, odd lengths, a partial last chunk),
the backward over segments (a lone sequence with and without windows, a varlen
batch in one pass), and K1's backward alone (the private test op).
Each result is checked finite; a sanitizer's report is the test.
"""
import sys

import torch

import torch_kda
from torch_kda.testing import RECORD_GRAD_FLOATS, forced

D = 128


def inputs(T, H, gen):
    def r(*s):
        return torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16)
    return r(1, T, H, D), r(1, T, H, D), r(1, T, H, D), r(1, T, H, D), r(1, T, H)


def decode():
    gen = torch.Generator(device="cuda").manual_seed(0)
    H = 2
    A_log = torch.rand(H, device="cuda", generator=gen)
    dt_bias = torch.rand(H, D, device="cuda", generator=gen)
    for pool_dtype in (torch.float32, torch.bfloat16):
        for lower_bound in (-5.0, None):
            pool = torch.randn(6, H, D, D, device="cuda", generator=gen).to(pool_dtype)
            # varlen: 1, 11 (three tiles of 4), 0 and 2 tokens; request 2 a padding row
            cu = torch.tensor([0, 1, 12, 12, 14], device="cuda")
            q, k, v, g, beta = inputs(14, H, gen)
            idx = torch.tensor([3, 0, -1, 5], device="cuda")
            out = torch_kda.kda_pool(q, k, v, g, beta, A_log, dt_bias, pool, idx, lower_bound=lower_bound,
                                     cu_seqlens=cu)
            assert torch.isfinite(out).all() and torch.isfinite(pool.float()).all()
            # speculative: 3 requests of 4 tokens
            q, k, v, g, beta = (t.view(3, 4, *t.shape[2:]) for t in inputs(12, H, gen))
            idx = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1], [-1, -1, -1, -1]], device="cuda")
            accepted = torch.tensor([2, 1, 1], device="cuda")
            out = torch_kda.kda_pool(q, k, v, g, beta, A_log, dt_bias, pool, idx, lower_bound=lower_bound,
                                     num_accepted_tokens=accepted)
            assert torch.isfinite(out).all()
            # several waves of blocks, padding rows among them
            N = 3 * 8 * torch.cuda.get_device_properties(0).multi_processor_count // (4 * H) + 1
            q, k, v, g, beta = (t.view(N, 1, *t.shape[2:]) for t in inputs(N, H, gen))
            big = torch.randn(N + 3, H, D, D, device="cuda", generator=gen).to(pool_dtype)
            idx = torch.randperm(N + 3, device="cuda", generator=gen)[:N]
            idx[::7] = -1
            out = torch_kda.kda_pool(q, k, v, g, beta, A_log, dt_bias, big, idx, lower_bound=lower_bound)
            assert torch.isfinite(out).all() and torch.isfinite(big.float()).all()
            # kda::fwd_ with decode shapes: varlen 1, 0 and 3 tokens
            q, k, v, g, beta = inputs(4, H, gen)
            cu = torch.tensor([0, 1, 1, 4], device="cuda")
            out = torch.empty_like(v)
            final = torch.empty(3, H, D, D, device="cuda", dtype=pool_dtype)
            for init in (None, pool[:3].clone()):
                torch_kda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, lower_bound, initial_state=init,
                              final_state=final, cu_seqlens=cu)
                assert torch.isfinite(out).all() and torch.isfinite(final.float()).all()
    # Grouped value heads (one query/key head for two value heads), one token a request
    q, k, v, g, beta = inputs(3, H, gen)
    out = torch_kda.kda_pool(q[:, :, :1].reshape(3, 1, 1, D), k[:, :, :1].reshape(3, 1, 1, D), v.view(3, 1, H, D),
                             g.view(3, 1, H, D), beta.view(3, 1, H), A_log, dt_bias, big[:6],
                             torch.tensor([4, -1, 1], device="cuda"))
    assert torch.isfinite(out).all()
    # A precomputed gate, fp32: one token a request, then speculative
    for lower_bound in (-5.0, None):
        q, k, v, g, beta = inputs(3, H, gen)
        lam = -5.0 * torch.sigmoid(g.view(3, 1, H, D).float())
        pool = torch.randn(6, H, D, D, device="cuda", generator=gen)
        out = torch_kda.kda_pool(q.view(3, 1, H, D), k.view(3, 1, H, D), v.view(3, 1, H, D), lam,
                                 beta.view(3, 1, H), None, None, pool, torch.tensor([4, -1, 1], device="cuda"),
                                 lower_bound=lower_bound)
        assert torch.isfinite(out).all()
        q, k, v, g, beta = (t.view(2, 4, *t.shape[2:]) for t in inputs(8, H, gen))
        out = torch_kda.kda_pool(q, k, v, -5.0 * torch.sigmoid(g.float()), beta, None, None, pool,
                                 torch.tensor([[0, 1, 2, 3], [5, -1, 4, -1]], device="cuda"), lower_bound=lower_bound,
                                 num_accepted_tokens=torch.tensor([3, 1], device="cuda"))
        assert torch.isfinite(out).all() and torch.isfinite(pool).all()
    # Head sizes below 128 (K = 60, V = 17; pools read element by element): one
    # token, speculative, and a prefill through the copies (both pool dtypes)
    K, V = 60, 17
    for pool_dtype in (torch.float32, torch.bfloat16):
        pool = torch.randn(7, H, V, K, device="cuda", generator=gen).to(pool_dtype)
        q, k, v, g, beta = inputs(40, H, gen)
        q, k, g, v = q[..., :K], k[..., :K], g[..., :K], v[..., :V]
        dt = dt_bias[:, :K].contiguous()
        for T, extra in ((1, {}), (4, {"num_accepted_tokens": torch.tensor([2, 1], device="cuda")}), (20, {})):
            idx = (torch.tensor([[0, 1, 2, 3], [4, -1, 5, 6]], device="cuda") if extra
                   else torch.tensor([3, -1], device="cuda"))
            x = [t[:, :2 * T].reshape(2, T, *t.shape[2:]) for t in (q, k, v, g, beta)]
            out = torch_kda.kda_pool(*x, A_log, dt, pool, idx, lower_bound=-5.0, **extra)
            assert torch.isfinite(out).all() and torch.isfinite(pool.float()).all()
    # Heads wider than 128 (K = 200, V = 256: the chunked forward at any length):
    # one token with a padding row, and a prefill
    K, V = 200, 256
    dt = torch.rand(H, K, device="cuda", generator=gen)
    for pool_dtype in (torch.float32, torch.bfloat16):
        pool = torch.randn(5, H, V, K, device="cuda", generator=gen).to(pool_dtype)
        for T in (1, 20):
            x = [torch.randn(2, T, H, n, device="cuda", generator=gen).to(torch.bfloat16) for n in (K, K, V, K)]
            beta = torch.randn(2, T, H, device="cuda", generator=gen).to(torch.bfloat16)
            out = torch_kda.kda_pool(*x, beta, A_log, dt, pool, torch.tensor([3, -1], device="cuda"), lower_bound=-5.0)
            assert torch.isfinite(out).all() and torch.isfinite(pool.float()).all()
    torch.cuda.synchronize()


def segments():
    gen = torch.Generator(device="cuda").manual_seed(0)
    H = 2
    A_log = torch.rand(H, device="cuda", generator=gen)
    dt_bias = torch.rand(H, D, device="cuda", generator=gen)
    q, k, v, g, beta = inputs(700, H, gen)
    h0 = torch.randn(1, H, D, D, device="cuda", generator=gen)
    for lower_bound in (-5.0, None):
        with forced(segments=4):
            out, final = torch_kda.kda(q, k, v, g, beta, A_log, dt_bias, lower_bound=lower_bound, initial_state=h0,
                                       output_final_state=True)
        assert torch.isfinite(out).all() and torch.isfinite(final).all()
    torch.cuda.synchronize()


def head_sizes():
    gen = torch.Generator(device="cuda").manual_seed(0)
    H = 2
    cu = torch.tensor([0, 37, 37, 38, 140], device="cuda")
    A_log = torch.rand(H, device="cuda", generator=gen)
    for K, V in ((256, 200), (64, 64), (48, 64)):
        dt_bias = torch.rand(H, K, device="cuda", generator=gen)
        q, k, v, g = (torch.randn(1, 140, H, K if n != "v" else V, device="cuda", generator=gen).to(torch.bfloat16)
                      for n in "qkvg")
        beta = torch.randn(1, 140, H, device="cuda", generator=gen).to(torch.bfloat16)
        for state_dtype in (torch.float32, torch.bfloat16):
            h0 = torch.randn(4, H, V, K, device="cuda", generator=gen).to(state_dtype)
            for lower_bound in (-5.0, None):
                for block in ("8x4", "16x4") if K == 256 else ("2x2", "4x4"):
                    with forced(recurrence_block=block):
                        out, final = torch_kda.kda(q, k, v, g, beta, A_log, dt_bias, lower_bound=lower_bound,
                                                   initial_state=h0, output_final_state=True, cu_seqlens=cu)
                    assert torch.isfinite(out).all() and torch.isfinite(final.float()).all()
        with forced(segments=4):
            out, final = torch_kda.kda(q[:, :128], k[:, :128], v[:, :128], g[:, :128], beta[:, :128], A_log, dt_bias,
                                       lower_bound=-5.0, initial_state=h0[:1].float(), output_final_state=True)
        assert torch.isfinite(out).all() and torch.isfinite(final).all()
        if (K, V) == (64, 64):
            continue
        for ds_block in ("4x1", "4x2", "2x2") if K <= 128 else ("4x2", "2x2", "8x2"):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta)]
            with forced(ds_block=ds_block):
                out, final = torch_kda.kda(*leaves, A_log, dt_bias, lower_bound=None, initial_state=h0.float(),
                                           output_final_state=True, cu_seqlens=cu)
                (out.float().square().sum() + final.square().sum()).backward()
            assert all(torch.isfinite(t.grad).all() for t in leaves)
            if K == 256:  # the dS recurrence's fp32-dO kernels too
                with forced(ds_block=ds_block):
                    grads = torch.ops.kda.bwd(torch.randn(out.shape, device="cuda", generator=gen), None, q, k, v, g,
                                              beta, A_log, dt_bias, lower_bound=None, initial_state=h0.float(),
                                              cu_seqlens=cu)
                assert all(torch.isfinite(t).all() for t in grads if t is not None)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, (-5.0 * torch.sigmoid(g.float())), beta)]
        out, final = torch_kda.kda(*leaves, None, None, lower_bound=-5.0, initial_state=h0.float(),
                                   output_final_state=True, cu_seqlens=cu)
        (out.float().square().sum() + final.square().sum()).backward()
        assert all(torch.isfinite(t.grad).all() for t in leaves)
    torch.cuda.synchronize()


def backward():
    gen = torch.Generator(device="cuda").manual_seed(0)
    H = 2
    cu = torch.tensor([0, 37, 37, 54], device="cuda")
    for lower_bound in (-5.0, None):
        q, k, v, g, beta = (t.requires_grad_() for t in inputs(54, H, gen))
        A_log = torch.rand(H, device="cuda", generator=gen).requires_grad_()
        dt_bias = torch.rand(H, D, device="cuda", generator=gen).requires_grad_()
        h0 = torch.randn(3, H, D, D, device="cuda", generator=gen).requires_grad_()
        out, final = torch_kda.kda(q, k, v, g, beta, A_log, dt_bias, lower_bound=lower_bound, initial_state=h0,
                                   output_final_state=True, cu_seqlens=cu)
        (out.float().square().sum() + final.square().sum()).backward()
        for t in (q, k, v, g, beta, A_log, dt_bias, h0):
            assert torch.isfinite(t.grad).all()
    # Grouped value heads: q and k with one head, v and the rest with two
    q, k, v, g, beta = inputs(54, H, gen)
    q1, k1 = (t[:, :, :1].contiguous().requires_grad_() for t in (q, k))
    v, g, beta = (t.requires_grad_() for t in (v, g, beta))
    out, final = torch_kda.kda(q1, k1, v, g, beta, A_log.detach(), dt_bias.detach(), lower_bound=None,
                               initial_state=h0.detach(), output_final_state=True, cu_seqlens=cu)
    (out.float().square().sum() + final.square().sum()).backward()
    for t in (q1, k1, v, g, beta):
        assert torch.isfinite(t.grad).all()
    # A precomputed gate (bounded, unbounded; fp32 and bf16 g)
    for lower_bound, g_dtype in ((-5.0, torch.float32), (None, torch.float32), (None, torch.bfloat16)):
        q, k, v, g, beta = inputs(54, H, gen)
        lam = (-5.0 * torch.sigmoid(g.float())).to(g_dtype)
        q, k, v, lam, beta = (t.requires_grad_() for t in (q, k, v, lam, beta))
        h0 = torch.randn(3, H, D, D, device="cuda", generator=gen).requires_grad_()
        out, final = torch_kda.kda(q, k, v, lam, beta, None, None, lower_bound=lower_bound, initial_state=h0,
                                   output_final_state=True, cu_seqlens=cu)
        (out.float().square().sum() + final.square().sum()).backward()
        for t in (q, k, v, lam, beta, h0):
            assert torch.isfinite(t.grad).all()
    # The dS recurrence of a lone sequence over segments (the passes, the scan,
    # the recurrence proper), in windows of 2 chunks cut 3 ways, and in one pass
    # cut 3 ways; an fp32 grad_out
    q, k, v, g, beta = inputs(83, H, gen)
    grad_out = torch.randn(*v.shape, device="cuda", generator=gen)
    h0 = torch.randn(1, H, D, D, device="cuda", generator=gen)
    for window in (2, 0):
        with forced(segments=3, window_slots=window):
            got = torch.ops.kda.bwd(grad_out, h0, q, k, v, g, beta, A_log.detach(), dt_bias.detach(), lower_bound=-5.0,
                                    initial_state=h0)
        assert all(torch.isfinite(t).all() for t in got)
    # ... and every sequence of a varlen batch in one pass (an empty one, short ones)
    cu = torch.tensor([0, 37, 37, 54, 83], device="cuda")
    h0 = torch.randn(4, H, D, D, device="cuda", generator=gen)
    with forced(segments=3, window_slots=0):
        got = torch.ops.kda.bwd(grad_out, h0, q, k, v, g, beta, A_log.detach(), dt_bias.detach(), lower_bound=None,
                                initial_state=h0, cu_seqlens=cu)
    assert all(torch.isfinite(t).all() for t in got)
    q, k, v, g, beta = inputs(37, H, gen)
    d_record = torch.randn(3, H, RECORD_GRAD_FLOATS, device="cuda", generator=gen)
    got = torch.ops.kda_testing.prepare_bwd(q, k, v, g, beta, A_log.detach(), dt_bias.detach(), d_record, None, -5.0)
    assert all(torch.isfinite(t).all() for t in got)
    torch.cuda.synchronize()


if __name__ == "__main__":
    {"decode": decode, "segments": segments, "head_sizes": head_sizes, "backward": backward}[sys.argv[1]]()
    print(f"{sys.argv[1]}: done")
