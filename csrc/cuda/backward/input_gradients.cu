// K1's backward: from the gradients of a chunk's record (left by the backward
// sweep), the gradients of the chunk's q^, k^, v, log decays and sigmoid(beta);
// torch_kda/reference.py chunk_record_backward is the same math in float64. One
// block of 128 threads per (chunk slot, head), thread d owns key channel d and
// value channel d: it recomputes what K1 computed (G, the norms, A = diag(beta)
// P, W and U0 by forward substitution), then runs the two transposed solves per
// column, the 16 x 16 dA from two column-sum products, and the rest per column;
// then, for kda.bwd, the chain rule through the L2 norms, the gate and beta's
// sigmoid, so that no activation or activation gradient goes through memory.
// Its 16 x 16 products on the tensor cores in bf16x3, like K1's; the rest in fp32 FMAs.
#include <c10/cuda/CUDAException.h>

#include <string>

#include "cuda/chunk_inputs.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/launch.h"
#include "cuda/mma.cuh"

namespace kda::cuda {
namespace {

constexpr int C = kChunk;
constexpr int D = kHeadDim;
constexpr int kThreads = D;
constexpr int kPad = D + 4;

// The warps' partial sums of a 16 x 16 product: [warp][n-tile][lane], C fragments.
using ProductParts = float4[kThreads / 32][2][32];

// Row i0 = d / 16 and i0 + 8 of column j = d % 16 of X Y^T, X and Y [16][128]
// tiles, as K1 forms its 16 x 16 products: on the tensor cores in bf16x3, warp
// w over channels [32w, 32w + 32), the partial sums through `parts`, added in
// warp order. All threads call it; one barrier inside (the caller's barriers
// keep two calls' uses of `parts` apart).
__device__ __forceinline__ void rows_times_rows(const float (*X)[kPad], const float (*Y)[kPad], int d, float& r0,
                                                float& r1, ProductParts& parts) {
  const int warp = d / 32, lane = d % 32, g = lane / 4, t = lane % 4;
  float acc[2][4] = {};
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    const int c0 = 32 * warp + 16 * kk + 2 * t;
    uint32_t yh[2][2], yl[2][2], xh[4], xl[4];
    split_b_fragments(Y, g, c0, yh, yl);
    split_a_fragment(X, g, c0, xh, xl);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      mma_bf16x3(acc[nt], xh, xl, yh[nt][0], yh[nt][1], yl[nt][0], yl[nt][1]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    parts[warp][nt][lane] = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
  }
  __syncthreads();
  // Entry (i, j) is element 2 (i / 8) + j % 2 of lane 4 (i % 8) + (j % 8) / 2 in n-tile j / 8.
  const int j = d % C, i0 = d / C, nt = j / 8, ln = 4 * i0 + (j % 8) / 2;
  r0 = 0.f;
  r1 = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    const float* part = reinterpret_cast<const float*>(&parts[w][nt][ln]);
    r0 += part[j % 2];
    r1 += part[2 + j % 2];
  }
}

__device__ __forceinline__ void store_bf16(void* base, int64_t index, float x) {
  static_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn(x);
}

// exp(G_i - G_j) for the softplus gate, which admits no factor exp(-G_j)
// (params.h): a product of the tokens' decays alpha_t = exp(lambda_t) over t in
// (j, i], never a difference of cumulative sums. The factors of level h (as in
// K1, forward/prepare_chunks.cu Range): in blocks of 2h tokens with reference r = block
// start + h - 1, token i > r gets prod alpha over (r, i] and token i <= r over
// (i, r]; both are <= 1, and their product is exp(G_i - G_j) for i in the
// block's second half and j in its first.
__device__ __forceinline__ void level_factors(int h, const float (&alpha)[kChunk], float (&f)[kChunk]) {
#pragma unroll
  for (int b = 0; b < kChunk; b += 2 * h) {
    const int r = b + h - 1;
    float up = 1.f, down = 1.f;
#pragma unroll
    for (int n = 1; n <= h; ++n) {
      up *= alpha[r + n];
      f[r + n] = up;
      f[r + 1 - n] = down;
      down *= alpha[r + 1 - n];
    }
  }
}

// P = (k^ exp(G)) (k^ exp(-G))^T, strictly lower, into sP, and A = diag(beta)
// P into sA: thread d forms entries (d / 16, d % 16) and (d / 16 + 8, d % 16)
// from the column sums of two tiles (rows_times_rows). The softplus gate sums
// P over the levels of (k^ f_h) (k^ f_h)^T, each entry from the level of its
// highest differing bit (the others are finite and unread). Waits for the
// record gradients' copies (sRec) before its last barrier.
template <bool kSoftplus>
__device__ __forceinline__ void form_p_and_a(int d, const float (&kn)[C], const float (&E)[C], const float (&alpha)[C],
                                             float (*sT0)[kPad], float (*sT1)[kPad], float (*sP)[C + 1],
                                             float (*sA)[C + 1], const float* sBeta, ProductParts& sParts) {
  const int j = d % C, i0 = d / C, i1 = i0 + C / 2;
  float p0 = 0.f, p1 = 0.f;  // P's entries (i0, j), (i1, j)
  if constexpr (kSoftplus) {
    auto level_of = [](int x) { return x >= 8 ? 8 : x >= 4 ? 4 : x >= 2 ? 2 : 1; };
    cp_async_wait<0>();  // sRec: every thread's copies are in before the barrier
    auto level = [&](const int h) {
      float f[C];
      level_factors(h, alpha, f);
      __syncthreads();  // the tile's and the parts' last readers are done
#pragma unroll
      for (int i = 0; i < C; ++i) {
        sT0[i][d] = kn[i] * f[i];
      }
      __syncthreads();
      float r0, r1;
      rows_times_rows(sT0, sT0, d, r0, r1, sParts);
      p0 = level_of(i0 ^ j) == h ? r0 : p0;
      p1 = level_of(i1 ^ j) == h ? r1 : p1;
    };
    level(8);
    level(4);
    level(2);
    level(1);
  } else {
    // Each thread rewrites only its own column below, and the norms' reads of
    // other columns ended at load_chunk_inputs' last barrier: this one orders
    // nothing that needs it (kept as run on the GPU; removable).
    __syncthreads();
#pragma unroll
    for (int i = 0; i < C; ++i) {
      sT0[i][d] = kn[i] * E[i];
      sT1[i][d] = kn[i] * fast_rcp(E[i]);
    }
    cp_async_wait<0>();  // sRec: every thread's copies are in before the barrier
    __syncthreads();
    rows_times_rows(sT0, sT1, d, p0, p1, sParts);
  }
  sP[i0][j] = j < i0 ? p0 : 0.f;
  sP[i1][j] = j < i1 ? p1 : 0.f;
  sA[i0][j] = j < i0 ? sBeta[i0] * p0 : 0.f;
  sA[i1][j] = j < i1 ? sBeta[i1] * p1 : 0.f;
}

// The per-column sums of the softplus gate (prepare_backward_kernel), with
// exp(G_i - G_j) as products of decays: along row i (j from i down) and along
// column i (j from i up), whose last product is exp(G_last - G_i), Kd's decay.
template <class Put>
__device__ __forceinline__ void softplus_column_sums(const FwdParams& p, int d, const float* dr,
                                                     const float (&qn)[C], const float (&kn)[C],
                                                     const float (&E)[C], const float (&alpha)[C],
                                                     const float (&rw)[C], const float (*sDAb)[C + 1],
                                                     const float (*sDPq)[C + 1], const float* sBeta, float gl,
                                                     float dgl, float (&dG)[C], Put&& put) {
  float dgl_terms = 0.f;
#pragma unroll
  for (int i = 0; i < C; ++i) {
    float dKe = 0.f, dQe = 0.f, dKi = 0.f, e = 1.f;
#pragma unroll
    for (int j = i; j >= 0; --j) {
      if (j < i) {
        e *= alpha[j + 1];
        dKe += sDAb[i][j] * (kn[j] * e);
      }
      dQe += sDPq[i][j] * (kn[j] * e);
    }
    e = 1.f;
#pragma unroll
    for (int j = i; j < C; ++j) {
      if (j > i) {
        e *= alpha[j];
        dKi += sDAb[j][i] * (kn[j] * e);
      }
      dKi += sDPq[j][i] * (qn[j] * e);
    }
    const float kd = dr[kDRecKd + i * D + d] * e;
    const float dq = E[i] * p.scale * dr[kDRecQs + i * D + d] + dQe;
    const float dke = E[i] * sBeta[i] * rw[i] + dKe;
    dG[i] = qn[i] * dq + kn[i] * dke - kn[i] * (dKi + kd);
    dgl_terms += kn[i] * kd;
    put(i, dq, dke + dKi + kd);
  }
  dG[C - 1] += gl * dgl + dgl_terms;
}

// From the decays' gradients dG to the op's gradients (kChain: through the
// gate, the L2 norms and beta's sigmoid, in bf16, with this block's parts of
// ddt_bias and dA_log) or to those of lambda and sigmoid(beta) (the private
// test op). dq, dk of every row wait in sDq, sDk and their products with qn,
// kn in sT0, sT1 (the tiles' last use).
template <bool kChain, bool kSoftplus>
__device__ __forceinline__ void activation_gradients(const PrepareBwdParams& bp, const ChunkPlace& c, int d,
                                                     const float (&dG)[C], const float (&lam2)[C],
                                                     const float (&qn)[C], const float (&kn)[C],
                                                     float (*sT0)[kPad], float (*sT1)[kPad], float (*sDot)[C],
                                                     float* sDA_part, const float (*sDq)[D], const float (*sDk)[D],
                                                     const float (*sG)[D], const float (*sInvNorm)[C],
                                                     const float* sDb, const float* sBeta) {
  const FwdParams& p = bp.fwd;
  const int64_t H = p.H;
  // G = cumsum(lambda): dlambda_i = sum over j >= i of dG_j.
  if constexpr (kChain) {
    // Bounded: lambda = lower_bound * sigmoid(x), x = exp(A_log) (g + dt_bias):
    // with dx = dlambda lower_bound s (1 - s), dg = A dx, ddt_bias sums A dx
    // over the tokens and dA_log sums dx x. Softplus: lambda = -A softplus(x),
    // x = g + dt_bias: dg = dlambda (-A) sigmoid(x), ddt_bias sums dg and
    // dA_log sums dlambda lambda.
    const float A = expf(p.A_log[c.h]);
    const float bias = p.dt_bias[c.h * D + d];
    float tail = 0.f, ddt = 0.f, dA = 0.f;
#pragma unroll
    for (int i = C - 1; i >= 0; --i) {
      tail += dG[i];
      if (i < c.len) {
        const int64_t idx = ((c.bos + i) * H + c.h) * D + d;
        if constexpr (kSoftplus) {
          // Every term of dlambda_i holds the token's own decay as a factor,
          // so a decay that underflows to zero (lambda < -87) has dlambda_i = 0
          // exactly; the suffix sum leaves there only the rounding of terms
          // that cancel, which dA_log's lambda_i (up to -1e30) would amplify.
          const float dlam = lam2[i] < -126.f ? 0.f : tail;
          const float x = sG[i][d] + bias;
          const float dx = -A * dlam * fast_rcp(1.f + fast_exp2(-kLog2e * x));
          store_bf16(bp.grads.dg, idx, dx);
          ddt += dx;
          dA += dlam * lam2[i] * kLn2;
        } else {
          const float x = A * (sG[i][d] + bias);
          const float s = fast_rcp(1.f + fast_exp2(-kLog2e * x));
          const float darg = tail * p.lower_bound * s * (1.f - s);
          store_bf16(bp.grads.dg, idx, darg * A);
          ddt += darg * A;
          dA += darg * x;
        }
      }
    }
    const int64_t part = (c.slot - p.slot_begin) * H + c.h;
    bp.grads.ddt_bias_part[part * D + d] = ddt;
    dA = warp_sum(dA);
    if (d % 32 == 0) {
      sDA_part[d / 32] = dA;
    }
    __syncthreads();
    reduce_rows32<kPad>(
        sT0, sT1, [](float4 x) { return x.x + x.y + x.z + x.w; }, [](float s) { return s; }, sDot);
    if (d == 0) {
      float a = 0.f;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) {
        a += sDA_part[w];
      }
      bp.grads.dA_log_part[part] = a;
    }
    __syncthreads();
    // The L2 norm's backward: dx = (dxn - xn (xn . dxn)) / ||x||.
#pragma unroll
    for (int i = 0; i < C; ++i) {
      if (i < c.len) {
        const int64_t idx = ((c.bos + i) * H + c.h) * D + d;
        store_bf16(bp.grads.dq, idx, (sDq[i][d] - qn[i] * sDot[0][i]) * sInvNorm[0][i]);
        store_bf16(bp.grads.dk, idx, (sDk[i][d] - kn[i] * sDot[1][i]) * sInvNorm[1][i]);
      }
    }
    if (d < c.len) {
      store_bf16(bp.grads.dbeta, (c.bos + d) * H + c.h, sDb[d] * sBeta[d] * (1.f - sBeta[d]));
    }
  } else {
    float tail = 0.f;
#pragma unroll
    for (int i = C - 1; i >= 0; --i) {
      tail += dG[i];
      if (i < c.len) {
        bp.dlam[((c.bos + i) * H + c.h) * D + d] = tail;
      }
    }
    if (d < c.len) {
      bp.dbeta[(c.bos + d) * H + c.h] = sDb[d];
    }
  }
}

// kChain: finish with the chain rule through the activations (PrepareBwdParams
// `chain`); otherwise leave the activation gradients (the private test op).
// kSoftplus: the softplus gate (FwdParams::softplus), whose pairs' decays are
// products of the tokens' decays (level_factors) instead of exp(G_i) exp(-G_j).
template <bool kChain, bool kSoftplus>
__global__ void __launch_bounds__(kThreads) prepare_backward_kernel(const PrepareBwdParams bp) {
  static_assert(kChain || !kSoftplus, "the private test op serves the bounded gate only");
  const FwdParams& p = bp.fwd;
  __shared__ __align__(16) float sT0[C][kPad];  // raw q; then k^ exp(G); then scratch
  __shared__ __align__(16) float sT1[C][kPad];  // raw k; then k^ exp(-G); then scratch
  __shared__ float sP[C][C + 1];    // P = (k^ exp(G)) (k^ exp(-G))^T, strictly lower
  __shared__ float sA[C][C + 1];    // A = diag(beta) P
  __shared__ float sDA[C][C + 1];   // dA, strictly lower
  __shared__ float sDAb[C][C + 1];  // dP = diag(beta) dA
  __shared__ float sDPq[C][C + 1];  // scale * dAqk, lower with the diagonal
  __shared__ float sInvNorm[2][C];
  __shared__ float sBeta[C];
  __shared__ float sDb[C];
  __shared__ float sDot[2][C];   // qn . dqn and kn . dkn per row (kChain)
  __shared__ __align__(16) float sDq[kChain ? C : 1][D];  // dqn, dkn of every row (kChain)
  __shared__ __align__(16) float sDk[kChain ? C : 1][D];
  // The raw g rows (kChain): the gate's chain rule reads them again at the end,
  // where reloading them from global memory left each row's loads waiting.
  __shared__ __align__(16) float sG[kChain ? C : 1][D];
  __shared__ float sDA_part[kThreads / 32];
  __shared__ ProductParts sParts;
  // The chunk's record gradients (34 KB), copied in while the inputs load and
  // the record is recomputed: read from global memory where they are used, they
  // stalled the block on memory latency at 8 warps per SM (255 registers).
  extern __shared__ __align__(16) float sRec[];

  ChunkPlace c;
  if (!place_chunk(p, c)) {
    return;
  }
  const int64_t H = p.H;
  const int d = threadIdx.x;
  {
    const float* src = bp.d_record + ((c.slot - p.slot_begin) * H + c.h) * kDRecFloats;
    const uint32_t dst = smem_u32(sRec);
    for (int e = d; e < kDRecFloats / 4; e += kThreads) {
      cp_async_16(dst + e * 16, src + e * 4);
    }
    cp_async_commit();
  }
  float G2[C], lam2[C], v[C];
  load_chunk_inputs<kPad, kSoftplus>(p, c, sT0, sT1, sBeta, sInvNorm, G2, lam2, v, kChain ? sG : nullptr);

  float qn[C], kn[C], E[C];
#pragma unroll
  for (int i = 0; i < C; ++i) {
    qn[i] = sT0[i][d] * sInvNorm[0][i];
    kn[i] = sT1[i][d] * sInvNorm[1][i];
    // Bounded: |G| <= 80, so exp(G) and its reciprocal are finite. Softplus:
    // only exp(G) (G <= 0) is formed.
    E[i] = fast_exp2(G2[i]);
  }
  const float gl = E[C - 1];
  float alpha[C];  // softplus: the tokens' decays exp(lambda)
#pragma unroll
  for (int i = 0; i < C; ++i) {
    alpha[i] = kSoftplus ? fast_exp2(lam2[i]) : 0.f;
  }
  form_p_and_a<kSoftplus>(d, kn, E, alpha, sT0, sT1, sP, sA, sBeta, sParts);
  // The record's gradients for this column (and dAqk, scaled and masked, for all).
  const float* dr = sRec;
  for (int e = d; e < C * C; e += kThreads) {
    const int i = e / C, j = e % C;
    sDPq[i][j] = j <= i ? p.scale * dr[kDRecAqk + e] : 0.f;
  }
  __syncthreads();

  // W and U0, column d: (I + A) X = diag(beta) [k^ exp(G) | v].
  float x[C], y[C];
  forward_substitute(
      sA, [&](int i) { return make_float2(sBeta[i] * kn[i] * E[i], sBeta[i] * v[i]); }, x, y,
      [](int, float, float) {});
  // dRw, dRu = (I + A)^-T [dW | dU0], column d: back substitution.
  float rw[C], ru[C];
#pragma unroll
  for (int i = C - 1; i >= 0; --i) {
    float a = dr[kDRecW + i * D + d];
    float b = dr[kDRecU0 + i * D + d];
#pragma unroll
    for (int j = i + 1; j < C; ++j) {
      a -= sA[j][i] * rw[j];
      b -= sA[j][i] * ru[j];
    }
    rw[i] = a;
    ru[i] = b;
  }

  // dA = -strict_lower(dRw W^T + dRu U0^T): sums over the columns, two passes
  // through the tiles (every thread is done with them: the barrier above).
  float da0, da1;
  {
#pragma unroll
    for (int i = 0; i < C; ++i) {
      sT0[i][d] = rw[i];
      sT1[i][d] = x[i];
    }
    __syncthreads();
    rows_times_rows(sT0, sT1, d, da0, da1, sParts);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < C; ++i) {
      sT0[i][d] = ru[i];
      sT1[i][d] = y[i];
    }
    __syncthreads();
    float u0, u1;
    rows_times_rows(sT0, sT1, d, u0, u1, sParts);
    const int j = d % C, i0 = d / C, i1 = i0 + C / 2;
    sDA[i0][j] = j < i0 ? -(da0 + u0) : 0.f;
    sDA[i1][j] = j < i1 ? -(da1 + u1) : 0.f;
    sDAb[i0][j] = j < i0 ? sBeta[i0] * -(da0 + u0) : 0.f;
    sDAb[i1][j] = j < i1 ? sBeta[i1] * -(da1 + u1) : 0.f;
    __syncthreads();
  }

  // dbeta_i = sum_d (dRw_id Ke_id + dRu_id v_id) + sum_j dA_ij P_ij: the column
  // terms staged, then four threads a row as in the norms.
#pragma unroll
  for (int i = 0; i < C; ++i) {
    sT0[i][d] = rw[i] * kn[i] * E[i] + ru[i] * v[i];
  }
  __syncthreads();
  if (d < 4 * C) {
    const int row = d / 4, part = d % 4;
    float s = 0.f;
#pragma unroll
    for (int m = 0; m < D / 16; ++m) {
      const float4 t = *reinterpret_cast<const float4*>(&sT0[row][m * 16 + part * 4]);
      s += t.x + t.y + t.z + t.w;
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (part == 0) {
      float a = 0.f;
#pragma unroll
      for (int j = 0; j < C; ++j) {
        a += sDA[row][j] * sP[row][j];
      }
      sDb[row] = s + a;
    }
  }
  __syncthreads();

  // v's gradient now: ru is not needed past here.
#pragma unroll
  for (int i = 0; i < C; ++i) {
    if (i < c.len) {
      const int64_t idx = ((c.bos + i) * H + c.h) * D + d;
      if constexpr (kChain) {
        store_bf16(bp.grads.dv, idx, sBeta[i] * ru[i]);
      } else {
        bp.dv[idx] = sBeta[i] * ru[i];
      }
    }
  }

  // Per column: dKe = diag(beta) dRw + dP Ki, dKi = dP^T Ke + dPq^T Qe,
  // dQe = scale dQs + dPq Ki (dP = diag(beta) dA), then the decays. dP is
  // strictly lower and dPq lower: the sums run over their nonzero triangles
  // (the loops are unrolled, so the bounds cost nothing).
  const float dgl_in = dr[kDRecGl + d];
  float dG[C];
  float dgl = dgl_in;
  // dq and dk of row i, wherever they were formed.
  auto put = [&](int i, float dq, float dk) {
    const int64_t idx = ((c.bos + i) * H + c.h) * D + d;
    if constexpr (kChain) {
      // dq, dk wait in the tiles (free since the dbeta sums) for their rows'
      // dot products with qn, kn: sT0 / sT1 hold the products, sDq / sDk the values.
      sT0[i][d] = qn[i] * dq;
      sT1[i][d] = kn[i] * dk;
      sDq[i][d] = dq;
      sDk[i][d] = dk;
    } else if (i < c.len) {
      bp.dqn[idx] = dq;
      bp.dkn[idx] = dk;
    }
  };
  if constexpr (kSoftplus) {
    softplus_column_sums(p, d, dr, qn, kn, E, alpha, rw, sDAb, sDPq, sBeta, gl, dgl, dG, put);
  } else {
    float ki[C];  // Ki column d: k^ exp(-G)
#pragma unroll
    for (int j = 0; j < C; ++j) {
      ki[j] = kn[j] * fast_rcp(E[j]);
    }
#pragma unroll
    for (int i = 0; i < C; ++i) {
      const float ei = E[i], ei_inv = fast_rcp(ei);
      float dKe = sBeta[i] * rw[i], dKi = 0.f, dQe = p.scale * dr[kDRecQs + i * D + d];
#pragma unroll
      for (int j = 0; j < i; ++j) {
        dKe += sDAb[i][j] * ki[j];
      }
#pragma unroll
      for (int j = 0; j <= i; ++j) {
        dQe += sDPq[i][j] * ki[j];
      }
#pragma unroll
      for (int j = i; j < C; ++j) {
        if (j > i) {
          dKi += sDAb[j][i] * (kn[j] * E[j]);
        }
        dKi += sDPq[j][i] * (qn[j] * E[j]);
      }
      const float dKd = dr[kDRecKd + i * D + d];
      const float dq = ei * dQe;
      const float dk = ei * dKe + ei_inv * dKi + gl * ei_inv * dKd;
      dG[i] = ei * (qn[i] * dQe + kn[i] * dKe) - ei_inv * (kn[i] * dKi + gl * kn[i] * dKd);
      dgl += ei_inv * kn[i] * dKd;
      put(i, dq, dk);
    }
    dG[C - 1] += gl * dgl;
  }
  activation_gradients<kChain, kSoftplus>(bp, c, d, dG, lam2, qn, kn, sT0, sT1, sDot, sDA_part, sDq, sDk, sG,
                                          sInvNorm, sDb, sBeta);
}

}  // namespace

void launch_prepare_backward(const PrepareBwdParams& bp, cudaStream_t stream) {
  const int64_t slots = bp.fwd.slot_end - bp.fwd.slot_begin;
  if (slots <= 0 || bp.fwd.H == 0) {
    return;
  }
  const int64_t blocks = slots * bp.fwd.H;
  TORCH_CHECK(blocks <= INT32_MAX, "kda.bwd: ", std::to_string(slots), " chunks x ", std::to_string(bp.fwd.H),
              " heads is more blocks than one launch takes");
  constexpr int kSmem = kDRecFloats * 4;  // sRec; with the static part over the 48 KB default
  TORCH_CHECK(bp.chain || !bp.fwd.softplus, "kda: the activation gradients alone serve the bounded gate only");
  auto* kernel = bp.fwd.softplus ? prepare_backward_kernel<true, true>
                 : bp.chain      ? prepare_backward_kernel<true, false>
                                 : prepare_backward_kernel<false, false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  kernel<<<static_cast<unsigned int>(blocks), kThreads, kSmem, stream>>>(bp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kda::cuda
