// What K1 and its backward share: where a block's chunk lies (place_chunk) and
// the substitution with I + A (forward_substitute: K1's M, the backward's T). The
// rest is K1's backward's: the chunk's inputs (raw q and k rows into shared
// tiles, g and v into registers), beta's sigmoid, the gate and its cumulative
// sum G, and the rows' inverse L2 norms, in a block of W threads, each owning
// a channel: all D of a (chunk slot, head) at head size D, or half of them in
// each block of a pair (block_pair.cuh). The forward's K1 works on mma
// fragments instead: forward/prepare_chunks.cu.
#pragma once

#include "cuda/block_pair.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/mma.cuh"

namespace kda::cuda {

// The fragments of K1's backward's 16 x 16 products X Y^T (bf16x3 on
// mma.sync) from fp32 [16][kPitch] tiles, split into bf16 hi and lo: 16 channels
// whose lane's first is c0 (32 w + 16 kk + 2 t for warp w, k-step kk); A (rows g,
// g + 8) of X, and B (n-tiles nt = 0, 1: rows 8 nt + g) of Y.
template <int kPitch>
__device__ __forceinline__ void split_a_fragment(const float (*X)[kPitch], int g, int c0, uint32_t (&hi)[4],
                                                 uint32_t (&lo)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const float2 x = *reinterpret_cast<const float2*>(&X[g + 8 * (r % 2)][c0 + 8 * (r / 2)]);
    split_pack(x.x, x.y, hi[r], lo[r]);
  }
}

template <int kPitch>
__device__ __forceinline__ void split_b_fragments(const float (*Y)[kPitch], int g, int c0, uint32_t (&hi)[2][2],
                                                  uint32_t (&lo)[2][2]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float2 y = *reinterpret_cast<const float2*>(&Y[8 * nt + g][c0 + 8 * r]);
      split_pack(y.x, y.y, hi[nt][r], lo[nt][r]);
    }
  }
}

struct ChunkPlace {
  int64_t slot = 0;
  int64_t h = 0;
  int64_t bos = 0;  // the chunk's first token
  int len = 0;      // its tokens (< 16 only for a sequence's last chunk)
};

// The (chunk slot, head) of the grid's unit-th; false for a slot past the live
// chunks (the grid covers the capacity; sequences ending in partial chunks or
// empty ones leave fewer).
__device__ __forceinline__ bool place_chunk(const FwdParams& p, ChunkPlace& c, int64_t unit) {
  c.slot = p.slot_begin + unit / p.H;
  c.h = unit % p.H;
  if (c.slot >= chunk_offset(p, p.N)) {
    return false;
  }
  const int64_t n = sequence_of_slot(p, c.slot);
  c.bos = seq_offset(p, n) + (c.slot - chunk_offset(p, n)) * kChunk;
  c.len = static_cast<int>(min64(kChunk, seq_offset(p, n + 1) - c.bos));
  return true;
}

// For each of the 32 rows of two [16][D] tiles (X's rows, then Y's; rows kPad
// floats apart): out[r / 16][r % 16] = post(sum of f over the row's 16-byte
// pieces). D / 32 threads per row (lanes 32 / (D / 32) apart: 8 at D = 128),
// each every (D / 32)-th piece, then a shuffle per halving; far fewer
// instructions than a warp reduction per row. With kPad = D + 4 the rows a
// quarter warp reads start 4 banks apart: at D = 64 and 128 its eight lanes
// read eight rows' same piece without bank conflicts. Exactly D threads, all
// of them calling it; no barrier inside.
template <int D, int kPad, typename F, typename Post>
__device__ __forceinline__ void reduce_rows32(const float (*X)[kPad], const float (*Y)[kPad], F f, Post post,
                                              float (*out)[kChunk]) {
  constexpr int C = kChunk, kParts = D / 32, kRowsPerWarp = 32 / kParts;
  static_assert(kPad % 32 == 4, "the rows' bank offsets assumed above");
  const int d = threadIdx.x;
  const int row = (d / 32) * kRowsPerWarp + d % kRowsPerWarp;
  const int part = (d % 32) / kRowsPerWarp;
  const float* src = row < C ? &X[row][0] : &Y[row - C][0];
  float s = 0.f;
#pragma unroll
  for (int m = 0; m < D / 4 / kParts; ++m) {
    s += f(*reinterpret_cast<const float4*>(src + (m * kParts + part) * 4));
  }
#pragma unroll
  for (int lanes = kRowsPerWarp; lanes < 32; lanes *= 2) {
    s += __shfl_xor_sync(0xffffffffu, s, lanes);
  }
  if (part == 0) {
    out[row / C][row % C] = post(s);
  }
}

// reduce_rows32 over all D channels where a block holds W of them: in a pair
// each block sums its own into `own`, and then each adds the partner's to its
// own (the same bits in both blocks, as IEEE addition commutes) and applies
// post. The pair's barrier is inside; `own` must not be written again.
template <int D, int W, int kPad, typename F, typename Post>
__device__ __forceinline__ void channel_sums32(const float (*X)[kPad], const float (*Y)[kPad], F f, Post post,
                                               float (*out)[kChunk], float (*own)[kChunk]) {
  if constexpr (W == D) {
    reduce_rows32<W, kPad>(X, Y, f, post, out);
  } else {
    reduce_rows32<W, kPad>(X, Y, f, [](float s) { return s; }, own);
    pair_sync();
    const int r = threadIdx.x;
    if (r < 2 * kChunk) {
      out[r / kChunk][r % kChunk] = post(own[r / kChunk][r % kChunk] + partner_of(&own[0][0])[r]);
    }
  }
}

// Forward substitution with the unit lower triangular I + A (A = sA, strictly
// lower, rows kPitch floats apart), column d of two right-hand sides at once
// (kSecond; else of the first alone, y untouched): row i of the right-hand
// sides is rhs(i) (a float2, x then y), already scaled by beta; row(i, x_i, y_i)
// is called as each row is solved (K1 stores its record there). Rows 16-byte
// aligned (kPitch % 4 == 0) are read four entries per load: every thread reads
// the same entry, so a load's cost is per instruction, not per byte.
template <int kPitch, bool kSecond = true, typename Rhs, typename Row>
__device__ __forceinline__ void forward_substitute(const float (*sA)[kPitch], Rhs rhs, float (&x)[kChunk],
                                                   float (&y)[kChunk], Row row) {
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    const float2 r = rhs(i);
    float xi = r.x, yi = kSecond ? r.y : 0.f;
    auto sub = [&](int j, float a) {
      xi -= a * x[j];
      if constexpr (kSecond) {
        yi -= a * y[j];
      }
    };
    if constexpr (kPitch % 4 == 0) {
#pragma unroll
      for (int jb = 0; jb < i; jb += 4) {
        const float4 a = *reinterpret_cast<const float4*>(&sA[i][jb]);
        sub(jb, a.x);
        if (jb + 1 < i) sub(jb + 1, a.y);
        if (jb + 2 < i) sub(jb + 2, a.z);
        if (jb + 3 < i) sub(jb + 3, a.w);
      }
    } else {
#pragma unroll
      for (int j = 0; j < i; ++j) {
        sub(j, sA[i][j]);
      }
    }
    x[i] = xi;
    if constexpr (kSecond) {
      y[i] = yi;
    }
    row(i, xi, yi);
  }
}

// Loads the chunk and computes G in base 2, G2 = G log2(e) (so exp(+-G) =
// fast_exp2(+-G2), one instruction), with kSoftplus each token's own lam2 =
// lambda log2(e) too, sigmoid(beta) (sBeta), and the inverse
// norms of q's and k's rows (sInvNorm[0], [1]; in a pair through sNormPart,
// channel_sums32); sQ and sK keep the raw rows of the block's channels (thread
// d's is channel ch), and sG, where not null, the raw g (K1's backward reads it again in the gate's
// chain rule, which a precomputed gate does not need; each thread writes and
// reads only its own column). Rows past the
// sequence's end are zeros with lambda = 0 and beta = 0, so that G_last is the
// last real row's G and the padding moves nothing. All threads of the block
// call it (two barriers). after_loads() follows the loads in program order
// (ptxas issues them all first and their uses after it): memory traffic issued
// there queues behind them.
template <int D, int W, int kPad, bool kSoftplus, bool kGiven, typename AfterLoads>
__device__ __forceinline__ void load_chunk_inputs(const FwdParams& p, const ChunkPlace& c, int ch, float (*sQ)[kPad],
                                                  float (*sK)[kPad], float* sBeta, float (*sInvNorm)[kChunk],
                                                  float (*sNormPart)[kChunk], float (&G2)[kChunk],
                                                  float (&lam2)[kChunk], float (&v)[kChunk], float (*sG)[W],
                                                  AfterLoads after_loads) {
  constexpr int C = kChunk;
  const int64_t H = p.H;
  const int d = threadIdx.x;
  // Every global load up front: the block's latency is one memory round trip.
  // Token i of the chunk is i * H * D elements on from token 0; a full chunk
  // (all but a sequence's last) loads without a predicate per token, which with
  // the 64-bit index per load cost ~1,000 instructions per thread.
  const int64_t first = (c.bos * H + c.h) * D + ch, stride = H * D;
  const QkPlace qkp = qk_place(p, static_cast<int>(c.h));
  const int64_t first_qk = qk_row<D>(qkp, c.bos) + ch, stride_qk = qkp.heads * D;
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(p.q) + first_qk;
  const __nv_bfloat16* k = static_cast<const __nv_bfloat16*>(p.k) + first_qk;
  const __nv_bfloat16* g = static_cast<const __nv_bfloat16*>(p.g) + first;
  const __nv_bfloat16* vv = static_cast<const __nv_bfloat16*>(p.v) + first;
  // A precomputed gate (kGiven) may come in fp32, read where the bf16 g is.
  const float* gf = static_cast<const float*>(p.g) + first;
  auto load_g = [&](int i) {
    if constexpr (kGiven) {
      return p.g_fp32 ? gf[i * stride] : __bfloat162float(g[i * stride]);
    } else {
      return __bfloat162float(g[i * stride]);
    }
  };
  if (c.len == C) {
#pragma unroll
    for (int i = 0; i < C; ++i) {
      sQ[i][d] = __bfloat162float(q[i * stride_qk]);
      sK[i][d] = __bfloat162float(k[i * stride_qk]);
      G2[i] = load_g(i);
      v[i] = __bfloat162float(vv[i * stride]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < C; ++i) {
      const bool valid = i < c.len;
      sQ[i][d] = valid ? __bfloat162float(q[i * stride_qk]) : 0.f;
      sK[i][d] = valid ? __bfloat162float(k[i * stride_qk]) : 0.f;
      G2[i] = valid ? load_g(i) : 0.f;
      v[i] = valid ? __bfloat162float(vv[i * stride]) : 0.f;
    }
  }
  const float beta_logit = d < c.len ? load_bf16(p.beta, (c.bos + d) * H + c.h) : 0.f;
  after_loads();
  if (d < C) {
    sBeta[d] = d < c.len ? 1.f / (1.f + expf(-beta_logit)) : 0.f;
  }

  // Gate in base 2: bounded_lam2 or softplus_lam2 (device_utils.cuh), or g
  // itself for a precomputed gate. Every row is computed and the padding
  // selected away, which is cheaper than a branch per row, as a row costs five
  // instructions.
  float acc = 0.f;
  auto cumulate = [&](int i, float l2) {
    lam2[i] = i < c.len ? l2 : 0.f;
    acc += lam2[i];
    G2[i] = acc;  // now G_i log2(e), the cumulative log decay in base 2
  };
  if constexpr (kGiven) {
#pragma unroll
    for (int i = 0; i < C; ++i) {
      cumulate(i, G2[i] * kLog2e);
    }
  } else {
    const float A = expf(p.A_log[c.h]);
    const float a2 = -A * kLog2e;
    const float bias = p.dt_bias[c.h * D + ch];
    const float b2 = a2 * bias;
    const float lb2 = p.lower_bound * kLog2e;
#pragma unroll
    for (int i = 0; i < C; ++i) {
      if (sG != nullptr) {
        sG[i][d] = G2[i];
      }
      cumulate(i, kSoftplus ? softplus_lam2(G2[i] + bias, A) : bounded_lam2(G2[i], a2, b2, lb2));
    }
  }
  __syncthreads();

  // The inverse norms of the 32 rows (q's 16, then k's).
  channel_sums32<D, W, kPad>(
      sQ, sK, [](float4 x) { return x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w; },
      [](float sq) { return rsqrtf(sq + static_cast<float>(kNormEps)); }, sInvNorm, sNormPart);
  __syncthreads();
}

}  // namespace kda::cuda
