// K1's backward: from the gradients of a chunk's record (left by the backward
// sweep), the gradients of the chunk's q^, k^, v, log decays and sigmoid(beta);
// torch_kda/reference.py chunk_record_backward is the same math in float64. One
// block of D threads per (chunk slot, head) at head size D (64 or 128; at 256
// two blocks of 128, kBlocksOf), thread d owns key channel d and value channel
// d: it recomputes what K1 computed (G, the norms, A = diag(beta) P), inverts
// I + A once (T, 16 threads), and forms W, U0 and the transposed solves as products with T on
// the tensor cores, tile by tile in shared memory; then the 16 x 16 dA from
// column-sum products, and the rest per column; then, for kda.bwd, the chain
// rule through the L2 norms, the gate and beta's sigmoid, so that no
// activation or activation gradient goes through memory. Its products in
// bf16x3 (fp32-level accuracy), the rest in fp32 FMAs.
#include <c10/cuda/CUDAException.h>

#include <string>
#include <type_traits>

#include "cuda/block_pair.cuh"
#include "cuda/chunk_inputs.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/launch.h"
#include "cuda/mma.cuh"

namespace kda::cuda {
namespace {

constexpr int C = kChunk;

// At head size 256 one block of 256 threads would take 130 KB of shared memory
// and 235 registers a thread, alone on its SM. A (chunk slot, head) takes two
// blocks of 128 channels as a cluster instead (block_pair.cuh), each laid out
// as the 128-wide block, three an SM, so that the 256-wide kernel is the
// 128-wide code and its launches' tails are half as coarse (measured in
// docs/performance-notes.md). The blocks add each other's partial sums over the
// channels: in each block own + partner's, the same bits in both, as IEEE
// addition commutes, so that both hold the same P, T and dA.
// A block's channels and threads: thread d owns channel W r + d of block r.
template <int D>
constexpr int kWidthOf = D / kBlocksOf<D>;

// The tiles' rows W + 4 floats apart at block width W (reduce_rows32's bank offsets).
template <int W>
constexpr int kPadOf = W + 4;

// The 16 x 16 products' entries each thread forms: 2 at W = 128, 4 at 64.
template <int W>
constexpr int kEntries = C * C / W;

// The warps' partial sums of a 16 x 16 product: [warp][n-tile][lane], C fragments.
template <int W>
using ProductParts = float4[W / 32][2][32];

// The row of thread d's e-th entry of a 16 x 16 product, in column d % 16.
template <int W>
__device__ __forceinline__ int entry_row(int d, int e) {
  return d / C + e * (W / C);
}

// Entries (entry_row<W>(d, e), d % 16) of X Y^T (+ X2 Y2^T where X2 is
// given), into r[e], X and Y [16][W] tiles of the block's channels, as K1
// forms its 16 x 16 products: on the tensor cores in bf16x3, warp w over
// channels [32w, 32w + 32), the partial sums through `parts`, added in warp
// order; in a pair the partner's sum is added to the block's. All threads call
// it; one barrier inside (the pair's in a pair), after every read of the tiles.
// The caller's barriers keep two calls' uses of `parts` apart; in a pair the
// calls alternate between two, as the partner reads one until it reaches the
// next call's barrier.
template <int D, int W = kWidthOf<D>>
__device__ __forceinline__ void rows_times_rows(const float (*X)[kPadOf<W>], const float (*Y)[kPadOf<W>], int d,
                                                float (&r)[kEntries<W>], ProductParts<W>& parts,
                                                const float (*X2)[kPadOf<W>] = nullptr,
                                                const float (*Y2)[kPadOf<W>] = nullptr) {
  constexpr int kPad = kPadOf<W>;
  const int warp = d / 32, lane = d % 32, g = lane / 4, t = lane % 4;
  float acc[2][4] = {};
  auto add = [&](const float (*A)[kPad], const float (*B)[kPad]) {
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const int c0 = 32 * warp + 16 * kk + 2 * t;
      uint32_t yh[2][2], yl[2][2], xh[4], xl[4];
      split_b_fragments(B, g, c0, yh, yl);
      split_a_fragment(A, g, c0, xh, xl);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_bf16x3(acc[nt], xh, xl, yh[nt][0], yh[nt][1], yl[nt][0], yl[nt][1]);
      }
    }
  };
  add(X, Y);
  if (X2 != nullptr) {
    add(X2, Y2);
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    parts[warp][nt][lane] = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
  }
  if constexpr (kPairOf<D>) {
    pair_sync();
  } else {
    __syncthreads();
  }
  // Entry (i, j) is element 2 (i / 8) + j % 2 of lane 4 (i % 8) + (j % 8) / 2 in n-tile j / 8.
  const int j = d % C, nt = j / 8;
  auto sum_warps = [&](const ProductParts<W>& from, float (&sums)[kEntries<W>]) {
#pragma unroll
    for (int e = 0; e < kEntries<W>; ++e) {
      sums[e] = 0.f;
    }
#pragma unroll
    for (int w = 0; w < W / 32; ++w) {
#pragma unroll
      for (int e = 0; e < kEntries<W>; ++e) {
        const int i = entry_row<W>(d, e);
        const float* part = reinterpret_cast<const float*>(&from[w][nt][4 * (i % 8) + (j % 8) / 2]);
        sums[e] += part[2 * (i / 8) + j % 2];
      }
    }
  };
  sum_warps(parts, r);
  if constexpr (kPairOf<D>) {
    float other[kEntries<W>];
    sum_warps(*partner_of(&parts), other);
#pragma unroll
    for (int e = 0; e < kEntries<W>; ++e) {
      r[e] += other[e];
    }
  }
}

// The products L B for warp w's 32 channels [32w, 32w + 32) on the tensor
// cores: L [16][16] given by its entries l(i, j) (fp32, split into bf16 hi and
// lo) as the A fragment, B a [16][W] tile whose rows are the products' k
// index (the tokens) as four n-tiles' B fragments, split too (kBLo) or exact in
// bf16 (v). Each warp reads and writes only its own channels, so a product may
// go in place of its operand once the warp's reads are done (__syncwarp).
struct SplitA {
  uint32_t hi[4], lo[4];
};
struct SplitB {
  uint32_t hi[4][2], lo[4][2];
};

template <typename L>
__device__ __forceinline__ SplitA l_fragment(L l, int lane) {
  const int g = lane / 4, t = lane % 4;
  SplitA a;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int i = g + 8 * (r % 2), j = 2 * t + 8 * (r / 2);
    split_pack(l(i, j), l(i, j + 1), a.hi[r], a.lo[r]);
  }
  return a;
}

template <bool kBLo, int kPad>
__device__ __forceinline__ SplitB b_fragments(const float (*B)[kPad], int d) {
  const int warp = d / 32, g = d % 32 / 4, t = d % 4;
  SplitB b;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int col = 32 * warp + 8 * nt + g;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int k = 2 * t + 8 * r;
      if constexpr (kBLo) {
        split_pack(B[k][col], B[k + 1][col], b.hi[nt][r], b.lo[nt][r]);
      } else {
        b.hi[nt][r] = pack_bf16x2_rn(B[k][col], B[k + 1][col]);
      }
    }
  }
  return b;
}

// acc[nt] (+)= L B for n-tile nt, zero: start the sums.
template <bool kBLo>
__device__ __forceinline__ void product_into(float (&acc)[4][4], const SplitA& a, const SplitB& b, bool zero) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    mma_bf16_into(acc[nt], a.lo, b.hi[nt][0], b.hi[nt][1], zero);
    if constexpr (kBLo) {
      mma_bf16(acc[nt], a.hi, b.lo[nt][0], b.lo[nt][1]);
    }
    mma_bf16(acc[nt], a.hi, b.hi[nt][0], b.hi[nt][1]);
  }
}

// Row g and g + 8 of the warp's n-tile nt in a C fragment: f(row, column, value) for each entry.
template <typename F>
__device__ __forceinline__ void for_each_entry(const float (&acc)[4][4], int d, F f) {
  const int warp = d / 32, g = d % 32 / 4, t = d % 4;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int col = 32 * warp + 8 * nt + 2 * t;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      f(g + 8 * (e / 2), col + e % 2, acc[nt][e]);
    }
  }
}

template <int kPad>
__device__ __forceinline__ void store_tile(const float (&acc)[4][4], int d, float (*Z)[kPad]) {
  const int warp = d / 32, g = d % 32 / 4, t = d % 4;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int col = 32 * warp + 8 * nt + 2 * t;
    *reinterpret_cast<float2*>(&Z[g][col]) = make_float2(acc[nt][0], acc[nt][1]);
    *reinterpret_cast<float2*>(&Z[g + 8][col]) = make_float2(acc[nt][2], acc[nt][3]);
  }
}

// Z = L B, in place of B where Z is B.
template <bool kBLo, int kPad, typename L>
__device__ __forceinline__ void left_product(L l, const float (*B)[kPad], float (*Z)[kPad], int d) {
  const SplitA a = l_fragment(l, d % 32);
  const SplitB b = b_fragments<kBLo>(B, d);
  __syncwarp();  // the warp's reads of B are done before Z, which may be B, is written
  float acc[4][4];
  product_into<kBLo>(acc, a, b, true);
  store_tile(acc, d, Z);
}

__device__ __forceinline__ void store_bf16(void* base, int64_t index, float x) {
  static_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn(x);
}

// Channel ch's column of a [T][H][D] gradient (bf16, or fp32: a precomputed fp32
// gate's dg), from the chunk's first token: token i lies i * stride elements on,
// a 32-bit step (launch_prepare_backward checks that a chunk's 16 H D elements
// fit), so that each row's address costs one multiply-add: a 64-bit index per
// row and output costs about a dozen integer instructions, and integer work is a
// third of this kernel's issue.
template <int D, typename T = __nv_bfloat16>
struct ChunkColumn {
  T* first;
  int stride;
  __device__ __forceinline__ ChunkColumn(void* base, const ChunkPlace& c, int64_t H, int ch)
      : first(static_cast<T*>(base) + (c.bos * H + c.h) * D + ch), stride(static_cast<int>(H) * D) {}
  __device__ __forceinline__ void store(int i, float x) const {
    if constexpr (std::is_same_v<T, float>) {
      first[i * stride] = x;
    } else {
      first[i * stride] = __float2bfloat16_rn(x);
    }
  }
};

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
// P into sA: thread d forms entries (entry_row(d, e), d % 16) from the column
// sums of two tiles (rows_times_rows). The softplus gate sums P over the
// levels of (k^ f_h) (k^ f_h)^T, each entry from the level of its highest
// differing bit (the others are finite and unread). Waits for the record
// gradients' copies before its last barrier. The products take sParts[n %
// kBlocksOf<D>] for the n-th call of rows_times_rows, counted from 0 here.
template <int D, bool kSoftplus, int W = kWidthOf<D>>
__device__ __forceinline__ void form_p_and_a(int d, const float (&kn)[C], const float (&E)[C], const float (&alpha)[C],
                                             float (*sT0)[kPadOf<W>], float (*sT1)[kPadOf<W>], float (*sP)[C + 1],
                                             float (*sA)[C + 1], const float* sBeta,
                                             ProductParts<W> (&sParts)[kBlocksOf<D>]) {
  const int j = d % C;
  float pe[kEntries<W>] = {};  // P's entries (entry_row(d, e), j)
  if constexpr (kSoftplus) {
    auto level_of = [](int x) { return x >= 8 ? 8 : x >= 4 ? 4 : x >= 2 ? 2 : 1; };
    cp_async_wait<0>();  // the record gradients: every thread's copies are in before the barrier
    auto level = [&](const int h, const int call) {
      float f[C];
      level_factors(h, alpha, f);
      __syncthreads();  // the tile's and the parts' last readers are done
#pragma unroll
      for (int i = 0; i < C; ++i) {
        sT0[i][d] = kn[i] * f[i];
      }
      __syncthreads();
      float r[kEntries<W>];
      rows_times_rows<D>(sT0, sT0, d, r, sParts[call % kBlocksOf<D>]);
#pragma unroll
      for (int e = 0; e < kEntries<W>; ++e) {
        pe[e] = level_of(entry_row<W>(d, e) ^ j) == h ? r[e] : pe[e];
      }
    };
    level(8, 0);
    level(4, 1);
    level(2, 2);
    level(1, 3);
  } else {
    // Each thread rewrites only its own column below, and the norms' reads of
    // other columns ended at load_chunk_inputs' last barrier: this one orders
    // nothing that needs it.
    __syncthreads();
#pragma unroll
    for (int i = 0; i < C; ++i) {
      sT0[i][d] = kn[i] * E[i];
      sT1[i][d] = kn[i] * fast_rcp(E[i]);
    }
    cp_async_wait<0>();  // the record gradients: every thread's copies are in before the barrier
    __syncthreads();
    rows_times_rows<D>(sT0, sT1, d, pe, sParts[0]);
  }
#pragma unroll
  for (int e = 0; e < kEntries<W>; ++e) {
    const int i = entry_row<W>(d, e);
    sP[i][j] = j < i ? pe[e] : 0.f;
  }
#pragma unroll
  for (int e = 0; e < kEntries<W>; ++e) {
    const int i = entry_row<W>(d, e);
    sA[i][j] = j < i ? sBeta[i] * pe[e] : 0.f;
  }
}

// The calls of rows_times_rows before dA's: form_p_and_a's.
template <bool kSoftplus>
constexpr int kCallsBeforeDa = kSoftplus ? 4 : 1;

// The per-column sums of the softplus gate (prepare_backward_kernel), with
// exp(G_i - G_j) as products of decays: along row i (j from i down) and along
// column i (j from i up), whose last product is exp(G_last - G_i), Kd's decay.
// Row i of dRw is read before put(i), which may write dq^ over it.
template <int W, class Put>
__device__ __forceinline__ void softplus_column_sums(const FwdParams& p, int d, const float (*sQs)[W],
                                                     const float (*sKd)[W], const float (&qn)[C],
                                                     const float (&kn)[C], const float (&E)[C],
                                                     const float (&alpha)[C], const float (*sRW)[kPadOf<W>],
                                                     const float (*sDAb)[C + 1],
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
    const float kd = sKd[i][d] * e;
    const float dq = E[i] * p.scale * sQs[i][d] + dQe;
    const float dke = E[i] * sBeta[i] * sRW[i][d] + dKe;
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
// kn in sT0, sT1 (the tiles' last use). Thread d owns channel ch; in a pair,
// block `rank` 0 stores dbeta (from sDb of both blocks), each block its part
// of dA_log, and the partner's shared memory is released here (pair_arrive;
// the kernel waits for the partner at its end).
template <int D, bool kChain, bool kSoftplus, bool kGiven, int W = kWidthOf<D>>
__device__ __forceinline__ void activation_gradients(const PrepareBwdParams& bp, const ChunkPlace& c, int d, int ch,
                                                     int rank, const float (&dG)[C], const float (&lam2)[C],
                                                     const float (&qn)[C], const float (&kn)[C],
                                                     float (*sT0)[kPadOf<W>], float (*sT1)[kPadOf<W>],
                                                     float (*sDot)[C], float (*sDotPart)[C], float* sDA_part,
                                                     const float (*sDq)[kPadOf<W>], const float (*sDk)[kPadOf<W>],
                                                     const float (*sG)[W], const float (*sInvNorm)[C], float* sDb,
                                                     const float* sBeta) {
  const FwdParams& p = bp.fwd;
  const int64_t H = p.H;
  // G = cumsum(lambda): dlambda_i = sum over j >= i of dG_j.
  if constexpr (kChain) {
    const int64_t part = (c.slot - p.slot_begin) * H + c.h;
    // Bounded: lambda = lower_bound * sigmoid(x), x = exp(A_log) (g + dt_bias):
    // with dx = dlambda lower_bound s (1 - s), dg = A dx, ddt_bias sums A dx
    // over the tokens and dA_log sums dx x. Softplus: lambda = -A softplus(x),
    // x = g + dt_bias: dg = dlambda (-A) sigmoid(x), ddt_bias sums dg and
    // dA_log sums dlambda lambda. A precomputed gate: dg = dlambda. Stores dg
    // and this channel's part of ddt_bias, and leaves the warps' parts of
    // dA_log in sDA_part.
    auto gate_rows = [&] {
      float tail = 0.f, ddt = 0.f, dA = 0.f;
      const ChunkColumn<D> dg(bp.grads.dg, c, H, ch);
      if constexpr (kGiven) {
        const ChunkColumn<D, float> dg32(bp.grads.dg, c, H, ch);
#pragma unroll
        for (int i = C - 1; i >= 0; --i) {
          tail += dG[i];
          if (i < c.len) {
            // As below: a decay that underflows leaves dlambda only rounding.
            const float dlam = kSoftplus && lam2[i] < -126.f ? 0.f : tail;
            if (p.g_fp32) {
              dg32.store(i, dlam);
            } else {
              dg.store(i, dlam);
            }
          }
        }
      } else {
        const float A = expf(p.A_log[c.h]);
        const float bias = p.dt_bias[c.h * D + ch];
#pragma unroll
        for (int i = C - 1; i >= 0; --i) {
          tail += dG[i];
          if (i < c.len) {
            if constexpr (kSoftplus) {
              // Every term of dlambda_i holds the token's own decay as a factor,
              // so a decay that underflows to zero (lambda < -87) has dlambda_i = 0
              // exactly; the suffix sum leaves there only the rounding of terms
              // that cancel, which dA_log's lambda_i (up to -1e30) would amplify.
              const float dlam = lam2[i] < -126.f ? 0.f : tail;
              const float x = sG[i][d] + bias;
              const float dx = -A * dlam * fast_rcp(1.f + fast_exp2(-kLog2e * x));
              dg.store(i, dx);
              ddt += dx;
              dA += dlam * lam2[i] * kLn2;
            } else {
              const float x = A * (sG[i][d] + bias);
              const float s = fast_rcp(1.f + fast_exp2(-kLog2e * x));
              const float darg = tail * p.lower_bound * s * (1.f - s);
              dg.store(i, darg * A);
              ddt += darg * A;
              dA += darg * x;
            }
          }
        }
      }
      if constexpr (!kGiven) {
        bp.grads.ddt_bias_part[part * D + ch] = ddt;
        dA = warp_sum(dA);
        if (d % 32 == 0) {
          sDA_part[d / 32] = dA;
        }
      }
    };
    // This block's part of dA_log, from its warps' (after a barrier).
    auto store_dA_log = [&](float* dst) {
      if (d == 0 && !kGiven) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < W / 32; ++w) {
          a += sDA_part[w];
        }
        *dst = a;
      }
    };
    auto dbeta_rows = [&] {
      if (d < c.len) {
        const float db = kPairOf<D> ? sDb[d] + partner_of(sDb)[d] : sDb[d];
        store_bf16(bp.grads.dbeta, (c.bos + d) * H + c.h, db * sBeta[d] * (1.f - sBeta[d]));
      }
    };
    auto dot_sums = [&] {
      channel_sums32<D, W, kPadOf<W>>(
          sT0, sT1, [](float4 x) { return x.x + x.y + x.z + x.w; }, [](float s) { return s; }, sDot, sDotPart);
    };
    // The L2 norm's backward: dx = (dxn - xn (xn . dxn)) / ||x||. With grouped
    // value heads, this value head's part in fp32 (the host sums the group's).
    auto norm_rows = [&] {
      const ChunkColumn<D> dq(bp.grads.dq, c, H, ch), dk(bp.grads.dk, c, H, ch);
      const ChunkColumn<D, float> dq32(bp.grads.dq, c, H, ch), dk32(bp.grads.dk, c, H, ch);
#pragma unroll
      for (int i = 0; i < C; ++i) {
        if (i < c.len) {
          const float dqi = (sDq[i][d] - qn[i] * sDot[0][i]) * sInvNorm[0][i];
          const float dki = (sDk[i][d] - kn[i] * sDot[1][i]) * sInvNorm[1][i];
          if (p.group > 1) {
            dq32.store(i, dqi);
            dk32.store(i, dki);
          } else {
            dq.store(i, dqi);
            dk.store(i, dki);
          }
        }
      }
    };
    if constexpr (!kPairOf<D>) {
      gate_rows();
      __syncthreads();
      dot_sums();
      store_dA_log(bp.grads.dA_log_part + part);
      dbeta_rows();
      __syncthreads();
      norm_rows();
    } else {
      // In a pair each meeting's release is a memory barrier, which waits for
      // the thread's stores in flight: the gate's rows (16 stores a thread) go
      // after the last meeting, and each block stores its own part of dA_log,
      // in a plane of its own (num_slots rows apart), which the host sums.
      __syncthreads();
      dot_sums();
      if (rank == 0) {
        dbeta_rows();
      }
      pair_arrive();
      gate_rows();
      __syncthreads();
      store_dA_log(bp.grads.dA_log_part + part + rank * p.num_slots * H);
      norm_rows();
    }
  } else {
    float tail = 0.f;
#pragma unroll
    for (int i = C - 1; i >= 0; --i) {
      tail += dG[i];
      if (i < c.len) {
        bp.dlam[((c.bos + i) * H + c.h) * D + ch] = tail;
      }
    }
    if (d < c.len) {
      bp.dbeta[(c.bos + d) * H + c.h] = sDb[d];
    }
  }
}

// The block's shared memory (over the 48 KB of static shared memory at D =
// 128, so dynamic): 70.9 KB there, three blocks an SM; 39 KB at D = 64, five;
// at 256, a pair's block of 128 channels, 75.3 KB, three.
template <int D>
struct Smem {
  static constexpr int W = kWidthOf<D>;
  static constexpr int kPad = kPadOf<W>;
  // The tiles, [token][channel], each thread writing its own column outside
  // the products, in turn (bounded gate / softplus gate where they differ):
  //   T0: raw q; P's factors; k^ exp(G), then W; dbeta's terms; Ki, then dPq Ki
  //       (bounded); qn dq^
  //   T1: raw k; P's factor (bounded); v, then U0; Ke, then dKi (bounded); kn dk^
  //   RW: dW (copied in), then dRw = T^T dW; dKe in place (bounded); dq^ (kChain)
  //   RU: dU0 (copied in), then dRu = T^T dU0; Qe (bounded); dk^ (kChain)
  float T0[C][kPad];
  float T1[C][kPad];
  float RW[C][kPad];
  float RU[C][kPad];
  // The raw g rows (kChain): the gate's chain rule reads them again at the end,
  // so that its reads do not wait on memory there, 16 rows deep.
  float G[C][W];
  // The rest of the chunk's record gradients (of the block's channels, and
  // dAqk whole), copied in while the inputs load and the record is recomputed,
  // so that no read waits on memory where they are used.
  float Qs[C][W];
  float Kd[C][W];
  float Aqk[C * C];
  float gl[W];
  float Tm[C][C + 1];   // T = (I + A)^-1, lower with a unit diagonal
  float P[C][C + 1];    // P = (k^ exp(G)) (k^ exp(-G))^T, strictly lower
  float A[C][C + 1];    // A = diag(beta) P
  float DA[C][C + 1];   // dA, strictly lower
  float DAb[C][C + 1];  // dP = diag(beta) dA
  float DPq[C][C + 1];  // scale * dAqk, lower with the diagonal
  float InvNorm[2][C];
  float Beta[C];
  float Db[C];      // dbeta's sums over the channels (in a pair: block 1's, its own channels' alone)
  float Dot[2][C];  // qn . dqn and kn . dkn per row (kChain)
  float NormPart[2][C];  // in a pair: the block's own channels' sums of squares
  float DotPart[2][C];   // and of Dot's products
  float DA_part[W / 32];
  ProductParts<W> parts[kBlocksOf<D>];
};

// Blocks an SM, as many as the shared memory admits (228 KB, 1 KB of each block
// reserved), which cap the registers (__launch_bounds__): 204 a thread at D =
// 64 (five blocks), 170 at 128 and in a pair (three).
template <int D>
constexpr int kMinBlocks = static_cast<int>(228 * 1024 / (sizeof(Smem<D>) + 1024));
static_assert(kMinBlocks<kMaxHeadSize> >= 3, "a pair's blocks as the 128-wide block");

// The record gradients of the block's channels (from channel ch0) into shared
// memory by cp.async (one group): dW and dU0 into the padded tiles that the
// products read, the rest as they lie; dAqk whole.
template <int D>
__device__ __forceinline__ void copy_record_gradients(const float* src, Smem<D>& sm, int d, int ch0) {
  using DR = RecordGradLayout<D>;
  constexpr int W = kWidthOf<D>;
  constexpr int kRowPieces = W / 4;  // 16-byte pieces of the block's part of a row
  for (int e = d; e < C * kRowPieces; e += W) {
    const int i = e / kRowPieces, col = 4 * (e % kRowPieces);
    const float* row = src + i * D + ch0 + col;
    cp_async_16(smem_u32(&sm.RW[i][col]), row + DR::kW);
    cp_async_16(smem_u32(&sm.RU[i][col]), row + DR::kU0);
    cp_async_16(smem_u32(&sm.Qs[i][col]), row + DR::kQs);
    cp_async_16(smem_u32(&sm.Kd[i][col]), row + DR::kKd);
  }
  for (int e = d; e < (C * C + W) / 4; e += W) {
    const bool aqk = e < C * C / 4;
    cp_async_16(aqk ? smem_u32(&sm.Aqk[4 * e]) : smem_u32(&sm.gl[4 * e - C * C]),
                src + (aqk ? DR::kAqk + 4 * e : DR::kGl + ch0 + 4 * e - C * C));
  }
  cp_async_commit();
}

// kChain: finish with the chain rule through the activations (PrepareBwdParams
// `chain`); otherwise leave the activation gradients (the private test op).
// kSoftplus: the softplus gate (FwdParams::softplus), whose pairs' decays are
// products of the tokens' decays (level_factors) instead of exp(G_i) exp(-G_j).
// kGiven: a precomputed gate (FwdParams::gate_given), dg = dlambda.
template <int D, bool kChain, bool kSoftplus, bool kGiven>
__global__ void __launch_bounds__(kWidthOf<D>, kMinBlocks<D>) prepare_backward_kernel(const PrepareBwdParams bp) {
  static_assert(kChain || (!kSoftplus && !kGiven), "the private test op serves the bounded gate only");
  constexpr int W = kWidthOf<D>, kThreads = W;
  const FwdParams& p = bp.fwd;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem<D>& sm = *reinterpret_cast<Smem<D>*>(smem_raw);

  ChunkPlace c;
  // Both blocks of a pair take the same chunk, so both return here or neither.
  if (!place_chunk(p, c, blockIdx.x / kBlocksOf<D>)) {
    return;
  }
  const int rank = kPairOf<D> ? static_cast<int>(pair_rank()) : 0;
  const int64_t H = p.H;
  const int d = threadIdx.x, ch0 = W * rank, ch = ch0 + d;
  float G2[C], lam2[C], v[C];
  // The record gradients are read from the products on; the inputs first.
  // In a pair they are asked for after the norms' meeting, whose release
  // (a memory barrier) would otherwise wait for all of them to land.
  const float* const d_record = bp.d_record + ((c.slot - p.slot_begin) * H + c.h) * RecordGradLayout<D>::kFloats;
  load_chunk_inputs<D, W, kPadOf<W>, kSoftplus, kGiven>(
      p, c, ch, sm.T0, sm.T1, sm.Beta, sm.InvNorm, sm.NormPart, G2, lam2, v, kChain ? sm.G : nullptr, [&] {
        if constexpr (!kPairOf<D>) {
          copy_record_gradients(d_record, sm, d, ch0);
        }
      });
  if constexpr (kPairOf<D>) {
    copy_record_gradients(d_record, sm, d, ch0);
  }

  float qn[C], kn[C], E[C];
#pragma unroll
  for (int i = 0; i < C; ++i) {
    qn[i] = sm.T0[i][d] * sm.InvNorm[0][i];
    kn[i] = sm.T1[i][d] * sm.InvNorm[1][i];
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
  form_p_and_a<D, kSoftplus>(d, kn, E, alpha, sm.T0, sm.T1, sm.P, sm.A, sm.Beta, sm.parts);
  // The operands of W and U0 (the tiles' last readers passed form_p_and_a's
  // last barrier), and dAqk, scaled and masked.
#pragma unroll
  for (int i = 0; i < C; ++i) {
    sm.T0[i][d] = kn[i] * E[i];
    sm.T1[i][d] = v[i];
  }
  for (int e = d; e < C * C; e += kThreads) {
    const int i = e / C, j = e % C;
    sm.DPq[i][j] = j <= i ? p.scale * sm.Aqk[e] : 0.f;
  }
  __syncthreads();

  // T = (I + A)^-1, column j by thread j: the one substitution chain left.
  if (d < C) {
    float col[C], unused[C];
    forward_substitute<C + 1, false>(
        sm.A, [&](int i) { return make_float2(i == d ? 1.f : 0.f, 0.f); }, col, unused,
        [&](int i, float x, float) { sm.Tm[i][d] = x; });
  }
  __syncthreads();

  // W = T diag(beta) (k^ exp(G)) and U0 = T diag(beta) v (what K1 stored),
  // and [dRw | dRu] = T^T [dW | dU0], each in place of its operand.
  {
    const auto m = [&](int i, int j) { return sm.Tm[i][j] * sm.Beta[j]; };
    const auto tt = [&](int i, int j) { return sm.Tm[j][i]; };
    left_product<true>(m, sm.T0, sm.T0, d);
    left_product<false>(m, sm.T1, sm.T1, d);
    left_product<true>(tt, sm.RW, sm.RW, d);
    left_product<true>(tt, sm.RU, sm.RU, d);
  }
  __syncthreads();

  // dA = -strict_lower(dRw W^T + dRu U0^T): sums over the columns.
  {
    float da[kEntries<W>];
    rows_times_rows<D>(sm.RW, sm.T0, d, da, sm.parts[kCallsBeforeDa<kSoftplus> % kBlocksOf<D>], sm.RU, sm.T1);
    const int j = d % C;
#pragma unroll
    for (int e = 0; e < kEntries<W>; ++e) {
      const int i = entry_row<W>(d, e);
      sm.DA[i][j] = j < i ? -da[e] : 0.f;
    }
#pragma unroll
    for (int e = 0; e < kEntries<W>; ++e) {
      const int i = entry_row<W>(d, e);
      sm.DAb[i][j] = j < i ? sm.Beta[i] * -da[e] : 0.f;
    }
    __syncthreads();
  }

  // dbeta_i = sum_d (dRw_id Ke_id + dRu_id v_id) + sum_j dA_ij P_ij: the column
  // terms staged, then four threads a row as in the norms (in a pair, block 0
  // adds block 1's channels' sums at the end: activation_gradients).
#pragma unroll
  for (int i = 0; i < C; ++i) {
    sm.T0[i][d] = sm.RW[i][d] * kn[i] * E[i] + sm.RU[i][d] * v[i];
  }
  __syncthreads();
  if (d < 4 * C) {
    const int row = d / 4, part = d % 4;
    float s = 0.f;
#pragma unroll
    for (int m = 0; m < W / 16; ++m) {
      const float4 t = *reinterpret_cast<const float4*>(&sm.T0[row][m * 16 + part * 4]);
      s += t.x + t.y + t.z + t.w;
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (part == 0) {
      float a = 0.f;
#pragma unroll
      for (int j = 0; j < C; ++j) {
        a += sm.DA[row][j] * sm.P[row][j];
      }
      sm.Db[row] = rank == 0 ? s + a : s;
    }
  }
  __syncthreads();

  // v's gradient now: dRu is not read past here (its tile takes dk^ below).
  if constexpr (kChain) {
    const ChunkColumn<D> dv(bp.grads.dv, c, H, ch);
#pragma unroll
    for (int i = 0; i < C; ++i) {
      if (i < c.len) {
        dv.store(i, sm.Beta[i] * sm.RU[i][d]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < C; ++i) {
      if (i < c.len) {
        bp.dv[((c.bos + i) * H + c.h) * D + ch] = sm.Beta[i] * sm.RU[i][d];
      }
    }
  }

  // dKe = diag(beta) dRw + dP Ki, dKi = dP^T Ke + dPq^T Qe, dQe = scale dQs +
  // dPq Ki (dP = diag(beta) dA), then the decays.
  float dG[C];
  float dgl = sm.gl[d];
  // dq and dk of row i, wherever they were formed; in the thread's own column
  // of the dRw and dRu tiles, whose row i was read before.
  auto put = [&](int i, float dq, float dk) {
    if constexpr (kChain) {
      // dq, dk wait for their rows' dot products with qn, kn: T0 / T1 hold the
      // products (the tiles are free since the dbeta sums), RW / RU the values.
      sm.T0[i][d] = qn[i] * dq;
      sm.T1[i][d] = kn[i] * dk;
      sm.RW[i][d] = dq;
      sm.RU[i][d] = dk;
    } else if (i < c.len) {
      const int64_t idx = ((c.bos + i) * H + c.h) * D + ch;
      bp.dqn[idx] = dq;
      bp.dkn[idx] = dk;
    }
  };
  if constexpr (kSoftplus) {
    softplus_column_sums(p, d, sm.Qs, sm.Kd, qn, kn, E, alpha, sm.RW, sm.DAb, sm.DPq, sm.Beta, gl, dgl, dG, put);
  } else {
    // dKe = diag(beta) dRw + dP Ki and dQe's part dPq Ki from one split of Ki
    // (T0), dKi = dP^T Ke + dPq^T Qe (Ke in T1, Qe in RU: dRu's last reader
    // was dv), on the tensor cores; then per column.
#pragma unroll
    for (int i = 0; i < C; ++i) {
      sm.T0[i][d] = kn[i] * fast_rcp(E[i]);
      sm.T1[i][d] = kn[i] * E[i];
      sm.RU[i][d] = qn[i] * E[i];
    }
    __syncwarp();  // each warp's products read only its own channels
    {
      const int lane = d % 32;
      float ke[4][4], qe[4][4], kd[4][4];
      {
        const SplitB ki = b_fragments<true>(sm.T0, d);
        product_into<true>(ke, l_fragment([&](int i, int j) { return sm.DAb[i][j]; }, lane), ki, true);
        product_into<true>(qe, l_fragment([&](int i, int j) { return sm.DPq[i][j]; }, lane), ki, true);
      }
      {
        const SplitB ke_b = b_fragments<true>(sm.T1, d);
        const SplitB qe_b = b_fragments<true>(sm.RU, d);
        product_into<true>(kd, l_fragment([&](int i, int j) { return sm.DAb[j][i]; }, lane), ke_b, true);
        product_into<true>(kd, l_fragment([&](int i, int j) { return sm.DPq[j][i]; }, lane), qe_b, false);
      }
      __syncwarp();  // the warp's reads of the operands are done
      for_each_entry(ke, d, [&](int i, int col, float x) { sm.RW[i][col] = sm.Beta[i] * sm.RW[i][col] + x; });
      store_tile(qe, d, sm.T0);
      store_tile(kd, d, sm.T1);
    }
    __syncwarp();  // column d is warp d / 32's
#pragma unroll
    for (int i = 0; i < C; ++i) {
      const float ei = E[i], ei_inv = fast_rcp(ei);
      const float dKe = sm.RW[i][d], dKi = sm.T1[i][d], dQe = p.scale * sm.Qs[i][d] + sm.T0[i][d];
      const float dKd = sm.Kd[i][d];
      const float dq = ei * dQe;
      const float dk = ei * dKe + ei_inv * dKi + gl * ei_inv * dKd;
      dG[i] = ei * (qn[i] * dQe + kn[i] * dKe) - ei_inv * (kn[i] * dKi + gl * kn[i] * dKd);
      dgl += ei_inv * kn[i] * dKd;
      put(i, dq, dk);
    }
    dG[C - 1] += gl * dgl;
  }
  activation_gradients<D, kChain, kSoftplus, kGiven>(bp, c, d, ch, rank, dG, lam2, qn, kn, sm.T0, sm.T1, sm.Dot,
                                                  sm.DotPart, sm.DA_part, sm.RW, sm.RU, sm.G, sm.InvNorm, sm.Db,
                                                  sm.Beta);
  if constexpr (kPairOf<D>) {
    pair_wait();  // the partner's last reads of this block's shared memory
  }
}

template <int D>
void launch_prepare_backward_at(const PrepareBwdParams& bp, cudaStream_t stream) {
  TORCH_CHECK(bp.fwd.H <= INT32_MAX / (C * D), "kda.bwd: H = ", std::to_string(bp.fwd.H),
              " heads (q's dimension 2) put a chunk's rows further apart than the kernel's 32-bit steps reach; ",
              "at most ", std::to_string(INT32_MAX / (C * D)));
  constexpr int kSmem = sizeof(Smem<D>);
  // The private test op's instance (no chain rule) is 128 wide, as the op.
  TORCH_CHECK(bp.chain || (D == kHeadDim && !bp.fwd.softplus && !bp.fwd.gate_given),
              "kda: the activation gradients alone serve the bounded formula gate at head size ",
              std::to_string(kHeadDim), " only");
  auto* kernel = bp.fwd.gate_given ? (bp.fwd.softplus ? prepare_backward_kernel<D, true, true, true>
                                                      : prepare_backward_kernel<D, true, false, true>)
                 : bp.fwd.softplus ? prepare_backward_kernel<D, true, true, false>
                                   : prepare_backward_kernel<D, true, false, false>;
  if constexpr (D == kHeadDim) {
    if (!bp.chain) {
      kernel = prepare_backward_kernel<D, false, false, false>;
    }
  }
  launch_chunk_heads(kernel, bp, bp.fwd, kBlocksOf<D>, kWidthOf<D>, kSmem, stream);
}

}  // namespace

void launch_prepare_backward(const PrepareBwdParams& bp, cudaStream_t stream) {
  if (bp.fwd.slot_end <= bp.fwd.slot_begin || bp.fwd.H == 0) {
    return;
  }
  ChunkedHeadSizes::dispatch(bp.fwd.head_size,
                              [&](auto head_size) { launch_prepare_backward_at<head_size.value>(bp, stream); });
}

}  // namespace kda::cuda
