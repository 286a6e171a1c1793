// The state pool's kernels (params.h PoolParams): kda::fwd_pool_'s decode for
// requests of a few tokens, and the copies between the pool and the chunked
// forward's states for long ones.
//
// The decode is bound by the state's bytes: each (request, head) reads its
// 128 x 128 state once and writes it once (after every token with
// speculative decoding), while a token's arithmetic is 4 * 128 * 128 FMAs.
// Smaller head sizes run in the same 128 x 128 tile, zero-padded (kNarrow);
// wider ones take the chunked forward (pool_ops.cpp) between the copies.
// With the V-first layout the state's rows (value channels) evolve
// independently given the token's activations:
//   s <- s * alpha;  w = s . k^;  u = beta (v - w);  s <- s + u k^;  o = s . (scale q^)
// so a block of 128 threads carries a slab of 32 rows in registers across the
// request's tokens, four slabs a (request, head): 16 lanes a row, each lane 8
// key columns as 16-byte vectors (two fp32, one bf16), so that a warp's access
// is two rows' 256-byte halves (fp32) or whole rows (bf16). A token's step reads
// the tile's alpha, k^ and q^ from shared memory, 16 bytes at a time, and each
// read serves the thread's four rows, so that the step waits on its arithmetic
// rather than on the SM's shared-memory port. A row's four sums meet by halving
// (each lane hands half of its partial sums to its partner), five shuffles, and
// three more share them. Each
// warp computes a whole token's activations (norms by warp sums), a tile of four
// tokens at once, so that the tile's steps wait on one barrier. fp32 throughout;
// the state is stored in the pool's dtype, rounded once.
#include <c10/cuda/CUDAException.h>

#include <string>

#include "cuda/device_utils.cuh"
#include "cuda/launch.h"
#include "cuda/mma.cuh"

namespace kda::cuda {
namespace {

constexpr int D = kHeadDim;
constexpr int kThreads = 256;  // the copy kernels
static_assert(kThreads >= kMaxHeadSize, "the padding rows' zeros: a thread a value channel");
constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kSlabRows = 32;                            // value rows a decode block carries
constexpr int kSlabs = D / kSlabRows;                    // decode blocks a (request, head)
constexpr int kRowLanes = 16;                            // lanes a row
constexpr int kRowGroups = kDecodeThreads / kRowLanes;   // rows a block updates at once
constexpr int kRowsPerThread = kSlabRows / kRowGroups;
constexpr int kLaneCols = D / kRowLanes;                 // key columns a lane
constexpr int kTileTokens = kDecodeWarps;                // a token a warp
constexpr int kDecodeBlocksPerSm = 7;                    // a cap of 72 registers a thread
static_assert(kRowsPerThread * kRowGroups == kSlabRows && kSlabs * kSlabRows == D, "whole rows, whole slabs");
static_assert(kRowsPerThread == 4 && kRowLanes == 16, "rows_sum_one halves four sums over 16 lanes");
static_assert(D == 32 * 4, "a warp's lanes take four channels of a token");

__device__ __forceinline__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : x > hi ? hi : x;
}

// Request n's tokens [bos, eos) and its start slot, -1 for a padding row.
struct Request {
  int64_t bos = 0, eos = 0, slot = -1;
};

__device__ __forceinline__ Request request_of(const PoolParams& p, int64_t n) {
  const FwdParams& f = p.fwd;
  Request r;
  if (f.seq_offsets != nullptr) {
    r.bos = clamp64(f.seq_offsets[n], 0, f.T);
    r.eos = clamp64(f.seq_offsets[n + 1], r.bos, f.T);
  } else {
    r.bos = n * f.T;
    r.eos = r.bos + f.T;
  }
  if (p.indices == nullptr) {
    r.slot = n;
    return r;
  }
  int64_t col = 0;
  bool ok = true;
  if (p.accepted != nullptr) {
    const int64_t accepted = load_int(p.accepted, p.accepted_int32, n);
    ok = accepted >= 1 && accepted <= p.index_cols;
    col = ok ? accepted - 1 : 0;
  }
  const int64_t slot = load_int(p.indices, p.indices_int32, n * p.index_cols + col);
  r.slot = ok && slot >= 0 && slot < p.slots ? slot : -1;
  return r;
}

// Zeros in out (rows of `width` value channels) for `rows` channels from
// `first`, at every token of r.
__device__ __forceinline__ void zero_out_rows(const PoolParams& p, const Request& r, int64_t h, int width, int first,
                                              int rows, int tid) {
  if (tid < rows) {
    for (int64_t t = r.bos; t < r.eos; ++t) {
      static_cast<__nv_bfloat16*>(p.fwd.out)[(t * p.fwd.H + h) * width + first + tid] = __float2bfloat16_rn(0.f);
    }
  }
}

// 16-byte global accesses, written out so that the compiler cannot split them.
__device__ __forceinline__ uint4 load16(const void* at) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(at));
  return v;
}

__device__ __forceinline__ void store16(void* at, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(at), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// A lane's key columns: vector j (of kVec elements, 16 bytes in the pool's
// dtype) starts at column kVec (kRowLanes j + c), c the lane's place in its row.
template <bool kFp32>
struct LaneColumns {
  static constexpr int kVec = kFp32 ? 4 : 8;
  static constexpr int kVecs = kLaneCols / kVec;
  __device__ __forceinline__ static int column(int c, int j) { return kVec * (kRowLanes * j + c); }
};

// f(i, col) for each of the lane's columns: x[i] holds column col.
template <bool kFp32, class F>
__device__ __forceinline__ void each_lane_column(int c, F f) {
  using L = LaneColumns<kFp32>;
#pragma unroll
  for (int j = 0; j < L::kVecs; ++j) {
#pragma unroll
    for (int e = 0; e < L::kVec; ++e) {
      f(L::kVec * j + e, L::column(c, j) + e);
    }
  }
}

// One state row's kLaneCols columns of this lane from the pool (slot, head h, row).
// kNarrow: the pool's head sizes p.V x p.K are below the tile's D x D, whose
// padding rows and columns are zeros (inert: padded_heads.h); element by
// element, as a row of the pool need not start on a 16-byte boundary.
template <bool kFp32, bool kNarrow>
__device__ __forceinline__ void load_row(const PoolParams& p, const void* states, int64_t slot, int64_t h, int row,
                                         int c, float (&x)[kLaneCols]) {
  using L = LaneColumns<kFp32>;
  if constexpr (kNarrow) {
    const int64_t base = slot * p.pool_stride + (h * p.V + row) * p.K;
    each_lane_column<kFp32>(c, [&](int i, int col) {
      const bool in = row < p.V && col < p.K;
      x[i] = !in      ? 0.f
             : kFp32 ? static_cast<const float*>(states)[base + col]
                     : __bfloat162float(static_cast<const __nv_bfloat16*>(states)[base + col]);
    });
    return;
  }
  const int64_t base = slot * p.pool_stride + (h * D + row) * D;
#pragma unroll
  for (int j = 0; j < L::kVecs; ++j) {
    const int64_t at = base + L::column(c, j);
    if constexpr (kFp32) {
      const uint4 v = load16(static_cast<const float*>(states) + at);
      x[4 * j] = __uint_as_float(v.x), x[4 * j + 1] = __uint_as_float(v.y);
      x[4 * j + 2] = __uint_as_float(v.z), x[4 * j + 3] = __uint_as_float(v.w);
    } else {
      const uint4 v = load16(static_cast<const __nv_bfloat16*>(states) + at);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        x[8 * j + 2 * e] = lo_half(w[e]), x[8 * j + 2 * e + 1] = hi_half(w[e]);
      }
    }
  }
}

template <bool kFp32, bool kNarrow>
__device__ __forceinline__ void store_row(const PoolParams& p, int64_t slot, int64_t h, int row, int c,
                                          const float (&x)[kLaneCols]) {
  using L = LaneColumns<kFp32>;
  if constexpr (kNarrow) {
    if (row >= p.V) {
      return;
    }
    const int64_t base = slot * p.pool_stride + (h * p.V + row) * p.K;
    each_lane_column<kFp32>(c, [&](int i, int col) {
      if (col < p.K) {
        if constexpr (kFp32) {
          static_cast<float*>(p.pool)[base + col] = x[i];
        } else {
          static_cast<__nv_bfloat16*>(p.pool)[base + col] = __float2bfloat16_rn(x[i]);
        }
      }
    });
    return;
  }
  const int64_t base = slot * p.pool_stride + (h * D + row) * D;
#pragma unroll
  for (int j = 0; j < L::kVecs; ++j) {
    const int64_t at = base + L::column(c, j);
    if constexpr (kFp32) {
      store16(static_cast<float*>(p.pool) + at,
              make_uint4(__float_as_uint(x[4 * j]), __float_as_uint(x[4 * j + 1]), __float_as_uint(x[4 * j + 2]),
                         __float_as_uint(x[4 * j + 3])));
    } else {
      store16(static_cast<__nv_bfloat16*>(p.pool) + at,
              make_uint4(pack_bf16x2_rn(x[8 * j], x[8 * j + 1]), pack_bf16x2_rn(x[8 * j + 2], x[8 * j + 3]),
                         pack_bf16x2_rn(x[8 * j + 4], x[8 * j + 5]), pack_bf16x2_rn(x[8 * j + 6], x[8 * j + 7])));
    }
  }
}

// Where a token's channels 4 q .. 4 q + 3 sit in the tile's [D] vectors: lane
// c of a row reads quads c and kRowLanes + c, its key columns with an fp32 pool
// (LaneColumns) and 8 c .. 8 c + 7 with a bf16 one, so that a quarter-warp's
// 16-byte reads cover 128 contiguous bytes (no bank conflict) in both.
template <bool kFp32>
__device__ __forceinline__ int tile_quad(int q) {
  return kFp32 ? q : (q & 1) * kRowLanes + (q >> 1);
}

// A tile of tokens' activations, shared by the block: the scale folded into q^.
struct DecodeTile {
  float q[kTileTokens][D];      // scale q^
  float k[kTileTokens][D];      // k^
  float alpha[kTileTokens][D];  // exp(lambda)
  float v[kTileTokens][kSlabRows];  // the block's value channels
  float beta[kTileTokens];
};

// The first tile's inputs, warp w's token: its q, k and g (lane l's four
// channels; a precomputed gate's g may be fp32), the slab's 32 values of v,
// and the head's dt_bias (lane l's four) and A_log, a copy a warp, so that
// each warp reads only what it fetched. beta, 2 bytes, comes through a register.
struct TileInputs {
  uint2 raw[3][kTileTokens][32];
  float4 g32[kTileTokens][32];
  __nv_bfloat16 v[kTileTokens][kSlabRows];
  float4 bias[kTileTokens][32];
  float A_log[kTileTokens];
};

// Four channels of g as floats, from bf16 pairs.
__device__ __forceinline__ float4 bf16x4(uint2 x) {
  return make_float4(lo_half(x.x), hi_half(x.x), lo_half(x.y), hi_half(x.y));
}

__device__ __forceinline__ void cp_async_8(uint32_t smem_dst, const void* gmem_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_dst), "l"(gmem_src));
}

__device__ __forceinline__ void cp_async_4(uint32_t smem_dst, const void* gmem_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_dst), "l"(gmem_src));
}

// This warp's token t of the first tile, head h, the slab's value rows from
// row0; beta's logit into `beta`.
__device__ __forceinline__ void fetch_token(const FwdParams& f, int64_t t, int h, const QkPlace& qkp, int row0, int warp,
                                            int lane, TileInputs& in, float& beta) {
  const int64_t th = t * f.H + h, qk = qk_row<D>(qkp, t);
  const void* rows[3] = {f.q, f.k, f.g};
  const int64_t at[3] = {qk, qk, th * D};
#pragma unroll
  for (int m = 0; m < 3; ++m) {
    if (m == 2 && f.g_fp32) {
      cp_async_16(smem_u32(&in.g32[warp][lane]), static_cast<const float*>(f.g) + th * D + 4 * lane);
    } else {
      cp_async_8(smem_u32(&in.raw[m][warp][lane]), static_cast<const __nv_bfloat16*>(rows[m]) + at[m] + 4 * lane);
    }
  }
  if (lane < kSlabRows / 8) {
    cp_async_16(smem_u32(&in.v[warp][8 * lane]), static_cast<const __nv_bfloat16*>(f.v) + th * D + row0 + 8 * lane);
  }
  if (!f.gate_given) {
    cp_async_16(smem_u32(&in.bias[warp][lane]), f.dt_bias + int64_t{h} * D + 4 * lane);
    if (lane == 0) {
      cp_async_4(smem_u32(&in.A_log[warp]), f.A_log + h);
    }
  }
  cp_async_commit();
  beta = load_bf16(f.beta, th);
}

// One token's activations (warp-wide; lane l's channels 4 l..4 l + 3) into
// row tt of the tile, from its raw q, k (bf16 pairs) and g, the lane's value
// channel v, beta's logit, and A_log and the lane's four dt_bias (unread for a
// precomputed gate, whose g is the log decay).
template <bool kFp32>
__device__ __forceinline__ void token_activations(const FwdParams& p, uint2 qv, uint2 kv, float4 gv, float v,
                                                  float beta, float A_log, float4 bias, int tt, int lane,
                                                  DecodeTile& s) {
  const float q[4] = {lo_half(qv.x), hi_half(qv.x), lo_half(qv.y), hi_half(qv.y)};
  const float k[4] = {lo_half(kv.x), hi_half(kv.x), lo_half(kv.y), hi_half(kv.y)};
  const float x[4] = {gv.x + bias.x, gv.y + bias.y, gv.z + bias.z, gv.w + bias.w};
  const float sq = warp_sum((q[0] * q[0] + q[1] * q[1]) + (q[2] * q[2] + q[3] * q[3]));
  const float sk = warp_sum((k[0] * k[0] + k[1] * k[1]) + (k[2] * k[2] + k[3] * k[3]));
  const float qn = rsqrtf(sq + static_cast<float>(kNormEps)) * p.scale, kn = rsqrtf(sk + static_cast<float>(kNormEps));
  const float A = expf(A_log);
  float al[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    // The gates in fp32: bounded lower_bound * sigmoid(A x); softplus -A softplus(x).
    const float lam = p.gate_given ? x[e]
                      : p.softplus ? -A * (fmaxf(x[e], 0.f) + log1pf(expf(-fabsf(x[e]))))
                                   : p.lower_bound / (1.f + expf(-A * x[e]));
    al[e] = expf(lam);
  }
  const int at = 4 * tile_quad<kFp32>(lane);
  *reinterpret_cast<float4*>(&s.q[tt][at]) = make_float4(q[0] * qn, q[1] * qn, q[2] * qn, q[3] * qn);
  *reinterpret_cast<float4*>(&s.k[tt][at]) = make_float4(k[0] * kn, k[1] * kn, k[2] * kn, k[3] * kn);
  *reinterpret_cast<float4*>(&s.alpha[tt][at]) = make_float4(al[0], al[1], al[2], al[3]);
  s.v[tt][lane] = v;
  if (lane == 0) {
    s.beta[tt] = 1.f / (1.f + expf(-beta));
  }
}

// A later tile's token for this warp, read where it is used (requests past one
// tile are rare in decode; only the first tile is fetched ahead).
template <bool kFp32>
__device__ __forceinline__ void later_token_activations(const FwdParams& p, int64_t t, int h, const QkPlace& qkp,
                                                        int row0, int tt, int lane, DecodeTile& s) {
  const int64_t th = t * p.H + h, qk = qk_row<D>(qkp, t);
  auto row = [&](const void* x, int64_t at) {
    return *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(x) + at + 4 * lane);
  };
  const float4 gate = p.g_fp32 ? *reinterpret_cast<const float4*>(static_cast<const float*>(p.g) + th * D + 4 * lane)
                                : bf16x4(row(p.g, th * D));
  const bool given = p.gate_given;
  token_activations<kFp32>(
      p, row(p.q, qk), row(p.k, qk), gate, load_bf16(p.v, th * D + row0 + lane), load_bf16(p.beta, th),
      given ? 0.f : p.A_log[h],
      given ? make_float4(0.f, 0.f, 0.f, 0.f) : *reinterpret_cast<const float4*>(p.dt_bias + int64_t{h} * D + 4 * lane),
      tt, lane, s);
}

// The sums over a row's 16 lanes of the thread's four rows x[0..3], in five
// shuffles: lanes c and c ^ 8 swap two partial sums each, then c and c ^ 4 one,
// so that lane c holds row own_row(c)'s sum over four lanes, which c ^ 2 and c ^ 1
// complete. Every lane with that row holds the same bits.
__device__ __forceinline__ int own_row(int c) { return (c >> 2) & 3; }

__device__ __forceinline__ float rows_sum_one(const float (&x)[kRowsPerThread], int c) {
  const bool b3 = c & 8, b2 = c & 4;
  const float a = (b3 ? x[2] : x[0]) + __shfl_xor_sync(0xffffffffu, b3 ? x[0] : x[2], 8);  // row 2 b3
  const float b = (b3 ? x[3] : x[1]) + __shfl_xor_sync(0xffffffffu, b3 ? x[1] : x[3], 8);  // row 2 b3 + 1
  float r = (b2 ? b : a) + __shfl_xor_sync(0xffffffffu, b2 ? a : b, 4);
  r += __shfl_xor_sync(0xffffffffu, r, 2);
  return r + __shfl_xor_sync(0xffffffffu, r, 1);
}

// All four rows' sums in every lane: lanes c ^ 4, c ^ 8 and c ^ 12 hold rows
// own_row(c) ^ 1, ^ 2 and ^ 3.
__device__ __forceinline__ void rows_sum_all(const float (&x)[kRowsPerThread], int c, float (&sum)[kRowsPerThread]) {
  const float r = rows_sum_one(x, c);
  const float s1 = __shfl_xor_sync(0xffffffffu, r, 4), s2 = __shfl_xor_sync(0xffffffffu, r, 8),
              s3 = __shfl_xor_sync(0xffffffffu, r, 12);
  const bool b3 = c & 8, b2 = c & 4;
  const float p0 = b2 ? s1 : r, p1 = b2 ? r : s1;   // rows 2 b3 and 2 b3 + 1
  const float q0 = b2 ? s3 : s2, q1 = b2 ? s2 : s3;  // the other pair
  sum[0] = b3 ? q0 : p0;
  sum[1] = b3 ? q1 : p1;
  sum[2] = b3 ? p0 : q0;
  sum[3] = b3 ? p1 : q1;
}

// One token on this thread's rows: the tile's activations read from shared
// memory four columns at a time where they are used (iteration m: the lane's
// tile quad kRowLanes m + c, tile_quad), not held for the whole step, so that
// the kernel fits the register cap. Returns the output of row own_row(c).
__device__ __forceinline__ float token_step(const DecodeTile& s, int tt, int group, int c,
                                            float (&x)[kRowsPerThread][kLaneCols]) {
  float w[kRowsPerThread] = {};
#pragma unroll
  for (int m = 0; m < kLaneCols / 4; ++m) {
    const int col = 4 * (kRowLanes * m + c);
    const float4 a = *reinterpret_cast<const float4*>(&s.alpha[tt][col]);
    const float4 k = *reinterpret_cast<const float4*>(&s.k[tt][col]);
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      float* y = &x[i][4 * m];
      y[0] *= a.x, y[1] *= a.y, y[2] *= a.z, y[3] *= a.w;
      w[i] = fmaf(y[3], k.w, fmaf(y[2], k.z, fmaf(y[1], k.y, fmaf(y[0], k.x, w[i]))));
    }
  }
  float ws[kRowsPerThread], u[kRowsPerThread], o[kRowsPerThread] = {};
  rows_sum_all(w, c, ws);
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    u[i] = s.beta[tt] * (s.v[tt][group + kRowGroups * i] - ws[i]);
  }
#pragma unroll
  for (int m = 0; m < kLaneCols / 4; ++m) {
    const int col = 4 * (kRowLanes * m + c);
    const float4 k = *reinterpret_cast<const float4*>(&s.k[tt][col]);
    const float4 q = *reinterpret_cast<const float4*>(&s.q[tt][col]);
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      float* y = &x[i][4 * m];
      y[0] = fmaf(u[i], k.x, y[0]), y[1] = fmaf(u[i], k.y, y[1]), y[2] = fmaf(u[i], k.z, y[2]),
      y[3] = fmaf(u[i], k.w, y[3]);
      o[i] = fmaf(y[3], q.w, fmaf(y[2], q.z, fmaf(y[1], q.y, fmaf(y[0], q.x, o[i]))));
    }
  }
  return rows_sum_one(o, c);
}

// The tokens of one tile: outputs, and with kSpec the state after each token
// into that token's slot.
template <bool kFp32, bool kSpec, bool kNarrow>
__device__ __forceinline__ void tile_tokens(const PoolParams& p, int64_t n, int h, const Request& r, int first,
                                            int tokens, const DecodeTile& s, int group, int c,
                                            const int (&rows)[kRowsPerThread], float (&x)[kRowsPerThread][kLaneCols]) {
  const FwdParams& f = p.fwd;
  auto* out = static_cast<__nv_bfloat16*>(f.out);
#pragma unroll 1
  for (int tt = 0; tt < tokens; ++tt) {
    const float o = token_step(s, tt, group, c, x);
    if ((c & 3) == 0) {  // one lane a row
      const int64_t th = (r.bos + first + tt) * f.H + h;
      out[th * D + rows[0] + kRowGroups * own_row(c)] = __float2bfloat16_rn(o);
    }
    if constexpr (kSpec) {
      const int64_t col = first + tt;
      const int64_t slot = col < p.index_cols ? load_int(p.indices, p.indices_int32, n * p.index_cols + col) : -1;
      if (slot >= 0 && slot < p.slots) {
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          store_row<kFp32, kNarrow>(p, slot, h, rows[i], c, x[i]);
        }
      }
    }
  }
}

// kSpec: speculative decoding (PoolParams::accepted): the state after every
// token goes to that token's slot; else the final state goes to the start slot.
// Block b: (request, head) b / kSlabs, value rows from kSlabRows (b % kSlabs). A
// block's life is a chain of memory latencies (the request's bounds and slot,
// then its state; the first tile's inputs, then the activations): the inputs
// are fetched first, as they need no slot, so that the two chains overlap.
// kNarrow: the pool's head sizes are below D (load_row).
template <bool kFp32, bool kSpec, bool kNarrow>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeBlocksPerSm) pool_decode_kernel(const PoolParams p) {
  __shared__ __align__(16) DecodeTile s;
  __shared__ __align__(16) TileInputs in;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const FwdParams& f = p.fwd;
  const int slab = blockIdx.x % kSlabs;
  const int64_t pair = blockIdx.x / kSlabs, n = pair / f.H;
  const int h = static_cast<int>(pair % f.H);
  const QkPlace qkp = qk_place(f, h);
  const Request r = request_of(p, n);
  const int len = static_cast<int>(r.eos - r.bos);
  float beta = 0.f;
  if (warp < len) {
    fetch_token(f, r.bos + warp, h, qkp, slab * kSlabRows, warp, lane, in, beta);
  }
  if (r.slot < 0) {
    cp_async_wait<0>();  // no copy may still be landing once the block has exited
    zero_out_rows(p, r, h, D, slab * kSlabRows, kSlabRows, tid);
    return;
  }
  const int group = tid / kRowLanes, c = tid % kRowLanes;
  int rows[kRowsPerThread];  // this thread's rows of the head's state
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    rows[i] = slab * kSlabRows + group + kRowGroups * i;
  }
  float x[kRowsPerThread][kLaneCols] = {};
  if (!p.zero_start) {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      load_row<kFp32, kNarrow>(p, p.start != nullptr ? p.start : p.pool, r.slot, h, rows[i], c, x[i]);
    }
  }
  if (warp < len) {
    cp_async_wait<0>();
    __syncwarp();  // the wait covers this thread's copies; v and A_log came by other lanes'
    const bool given = f.gate_given;
    token_activations<kFp32>(f, in.raw[0][warp][lane], in.raw[1][warp][lane],
                             f.g_fp32 ? in.g32[warp][lane] : bf16x4(in.raw[2][warp][lane]),
                             __bfloat162float(in.v[warp][lane]), beta, given ? 0.f : in.A_log[warp],
                             given ? make_float4(0.f, 0.f, 0.f, 0.f) : in.bias[warp][lane], warp, lane, s);
  }
  for (int first = 0; first < len; first += kTileTokens) {
    if (first != 0) {
      __syncthreads();  // every read of the previous tile is done
      if (first + warp < len) {
        later_token_activations<kFp32>(f, r.bos + first + warp, h, qkp, slab * kSlabRows, warp, lane, s);
      }
    }
    __syncthreads();
    const int tokens = len - first < kTileTokens ? len - first : kTileTokens;
    tile_tokens<kFp32, kSpec, kNarrow>(p, n, h, r, first, tokens, s, group, c, rows, x);
  }
  if (!kSpec && p.pool != nullptr) {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      store_row<kFp32, kNarrow>(p, r.slot, h, rows[i], c, x[i]);
    }
  }
}

// One block per (request, head): the head's state, V x K in the pool's head
// sizes, between the pool and p.states [N, H, V, K]; zeros into p.states for a
// padding row (kToPool: nothing for it). 16 bytes a thread and step where
// every head's state starts on a 16-byte boundary and is a whole number of
// 16-byte pieces (always at 128 x 128: the host checks the slots' alignment
// there), else 2 bytes.
template <bool kToPool>
__global__ void __launch_bounds__(kThreads) pool_copy_kernel(const PoolParams p) {
  const int64_t n = blockIdx.x / p.fwd.H, h = blockIdx.x % p.fwd.H;
  const Request r = request_of(p, n);
  const int64_t elem = p.pool_fp32 ? 4 : 2;
  const int64_t bytes = p.V * p.K * elem;
  auto* states = static_cast<unsigned char*>(p.states) + (n * p.fwd.H + h) * bytes;
  auto* pool = r.slot < 0 ? nullptr : static_cast<unsigned char*>(p.pool) + r.slot * p.pool_stride * elem + h * bytes;
  auto copy = [&](auto unit) {
    using U = decltype(unit);
    auto* st = reinterpret_cast<U*>(states);
    auto* po = reinterpret_cast<U*>(pool);
    for (int64_t i = threadIdx.x; i < bytes / static_cast<int64_t>(sizeof(U)); i += kThreads) {
      if (pool == nullptr) {
        if (!kToPool) {
          st[i] = U{};
        }
      } else if (kToPool) {
        po[i] = st[i];
      } else {
        st[i] = po[i];
      }
    }
  };
  const bool vectors = bytes % 16 == 0 && p.pool_stride * elem % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.pool) % 16 == 0;
  if (vectors) {
    copy(uint4{});
  } else {
    copy(uint16_t{});
  }
}

// out's rows are p.fwd.head_size wide (at most kThreads).
__global__ void __launch_bounds__(kThreads) pool_zero_padding_kernel(const PoolParams p) {
  const int64_t n = blockIdx.x / p.fwd.H, h = blockIdx.x % p.fwd.H;
  const Request r = request_of(p, n);
  if (r.slot < 0) {
    zero_out_rows(p, r, h, p.fwd.head_size, 0, p.fwd.head_size, threadIdx.x);
  }
}

unsigned int grid_of(const PoolParams& p, int64_t blocks_per_pair = 1) {
  const int64_t blocks = p.fwd.N * p.fwd.H * blocks_per_pair;
  TORCH_CHECK(blocks <= INT32_MAX, "kda.fwd_pool_: ", std::to_string(p.fwd.N), " requests x ", std::to_string(p.fwd.H),
              " heads is more blocks than one launch takes");
  return static_cast<unsigned int>(blocks);
}

}  // namespace

void launch_pool_decode(const PoolParams& p, cudaStream_t stream) {
  if (p.fwd.N == 0 || p.fwd.H == 0) {
    return;
  }
  // 16 lanes a row of the tile, 8 columns each: built for D = 128 alone.
  TORCH_INTERNAL_ASSERT(p.fwd.head_size == D, "the decode kernel: no tile for head size ",
                        std::to_string(p.fwd.head_size));
  using Kernel = void (*)(PoolParams);
  // [narrow][fp32 pool][speculative]
  constexpr Kernel kernels[2][2][2] = {
      {{pool_decode_kernel<false, false, false>, pool_decode_kernel<false, true, false>},
       {pool_decode_kernel<true, false, false>, pool_decode_kernel<true, true, false>}},
      {{pool_decode_kernel<false, false, true>, pool_decode_kernel<false, true, true>},
       {pool_decode_kernel<true, false, true>, pool_decode_kernel<true, true, true>}}};
  const bool narrow = p.K != D || p.V != D;
  const Kernel kernel = kernels[narrow][p.pool_fp32][p.accepted != nullptr];
  kernel<<<grid_of(p, kSlabs), kDecodeThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_pool_gather(const PoolParams& p, cudaStream_t stream) {
  if (p.fwd.N == 0 || p.fwd.H == 0) {
    return;
  }
  pool_copy_kernel<false><<<grid_of(p), kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_pool_scatter(const PoolParams& p, cudaStream_t stream) {
  if (p.fwd.N == 0 || p.fwd.H == 0) {
    return;
  }
  pool_copy_kernel<true><<<grid_of(p), kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_pool_zero_padding(const PoolParams& p, cudaStream_t stream) {
  if (p.fwd.N == 0 || p.fwd.H == 0) {
    return;
  }
  pool_zero_padding_kernel<<<grid_of(p), kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kda::cuda
