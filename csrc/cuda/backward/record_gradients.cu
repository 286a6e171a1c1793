// The backward sweep's record gradients (ds_recurrence.cu has the sweep's
// equations): up to D = 128 one block of D / 16 warps per (chunk slot, head),
// all chunks at once. Warp w computes U for rows 16w.. and then takes key
// columns 16w.. of the sums over all D value rows, reading every row of S0 and
// dS1 from shared memory, so no partial sums cross warps but dgl's, added in
// a fixed order (deterministic). S0 and dS1 come as stored, in bf16 (halving the bytes
// that K2's state passes, the dS recurrence and this kernel move per chunk);
// only the fp32 side of each product is split (dU, U, and dO when it is fp32).
//
// At D = 256 the two planes alone would take 256 KB: two blocks a (chunk
// slot, head) take 128 value rows each (8 warps, each two key slices), as a
// cluster: each block sends half of its partial sums into the other's shared
// memory, which adds them to its own and stores the sums (own + other, the
// same bits in either order, as IEEE addition commutes). Block 0 of the pair
// stores dQs and dW, block 1 dKd, dAqk and dgl: no atomics, and nothing to
// zero first.
//
// S0 and dS1 (bf16, as stored) each have a plane, and of the record only W and
// M are loaded, with v, for U = M v - W S0^T: 105 KB of shared memory at D =
// 128, two blocks per SM; 214 KB at 256 (with room for the partner's sums),
// one. Every load is issued at the block's start, dS1's in a copy group of its
// own that the products reading S0 do not wait for: the kernel moves ~118 KB
// per chunk and head, and dS1's loads then overlap those products instead of
// following them.
#include <c10/cuda/CUDAException.h>

#include <cstddef>
#include <string>

#include "cuda/backward/split_products.cuh"
#include "cuda/block_pair.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/launch.h"
#include "cuda/mma.cuh"

namespace kda::cuda {
namespace {

// A block's value rows at head size D: all D up to 128; at 256, S0 and dS1
// whole would take 256 KB, so two blocks a (chunk slot, head) take 128 rows
// each, and their partial sums meet in one of them (kPairOf).
template <int D>
constexpr int kGradRows = D / kBlocksOf<D>;
// A block's warps: each takes 16 of its value rows, and D / kGradRows key
// slices of 16 columns of the record gradients.
template <int D>
constexpr int kGradWarps = kGradRows<D> / 16;
template <int D>
constexpr int kGradThreads = 32 * kGradWarps<D>;
// Where a block receives its partner's partial sums: block 0 dQs [t][k] then
// dW; block 1 dKd, then dAqk [i][j], then dgl. Rows kPitch floats apart, 8
// more than D: a half-warp's float2 accesses of rows g.. then meet no bank twice.
template <int D>
struct Recv {
  static constexpr int kPitch = D + 8;
  static constexpr int kQs = 0, kW = C * kPitch;
  static constexpr int kKd = 0, kAqk = C * kPitch, kGl = C * kPitch + C * C;
  static constexpr int kFloats = kPairOf<D> ? 2 * C * kPitch : 4;
  static_assert(kGl + D <= 2 * C * kPitch, "dKd, dAqk and dgl within the room of dQs and dW");
};

template <int D>
struct __align__(16) GradSmem {
  static constexpr int Dv = kGradRows<D>;
  __nv_bfloat16 mat[Dv * D];      // S0 [v][k], the block's rows as stored; swizzled D-wide rows (plane_index)
  __nv_bfloat16 ds1[Dv * D];      // dS1 [v][k], the same way
  __nv_bfloat16 w[2][C * D];      // the record's W planes, verbatim
  __nv_bfloat16 v[C][Dv + 8];     // v [t][v] (zero past the sequence's end), for U0 = M v
  __nv_bfloat16 m[2][C * C];      // the record's M planes, verbatim
  __nv_bfloat16 dout[2][C * Dv];  // dO [t][v], hi and lo (lo read only for an fp32 dO); Dv-wide rows
  __nv_bfloat16 u[2][C * Dv];     // U [t][v]
  __nv_bfloat16 du[2][C * Dv];    // dU [t][v]
  float dgl[kGradWarps<D>][D];    // per warp: the sum over its rows of S0 * dS1
  float recv[Recv<D>::kFloats];   // the partner block's partial sums (kPairOf)
  static_assert(RecordLayout<D>::kW % 16 == 0 && RecordLayout<D>::kM % 16 == 0, "16-byte copies");
};

// Four consecutive values of one row into the hi and lo planes at idx (a multiple of 4).
__device__ __forceinline__ void store_split4(__nv_bfloat16* hi, __nv_bfloat16* lo, int idx, float4 x) {
  uint32_t h0, l0, h1, l1;
  split_pack(x.x, x.y, h0, l0);
  split_pack(x.z, x.w, h1, l1);
  *reinterpret_cast<uint2*>(hi + idx) = make_uint2(h0, h1);
  *reinterpret_cast<uint2*>(lo + idx) = make_uint2(l0, l1);
}

// Four consecutive values of dO from bf16 or fp32; a compile-time choice, so
// that the loads all issue before the first use.
template <bool kFp32>
__device__ __forceinline__ float4 load_dout4(const void* base, int64_t idx) {
  if constexpr (kFp32) {
    return *reinterpret_cast<const float4*>(static_cast<const float*>(base) + idx);
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(base) + idx);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    return make_float4(a.x, a.y, b.x, b.y);
  }
}

// Piece e (8 consecutive values) of a stored [rows][D] matrix: row e / (D / 8), columns 8 (e % (D / 8))..
template <int D>
__device__ __forceinline__ int matrix_piece_index(int e) {
  return plane_index<D>(e / (D / 8), 8 * (e % (D / 8)));
}

// The block's rows of S0 or dS1 (from src, its first) into their plane,
// verbatim (cp.async, in the caller's commit group).
template <int D>
__device__ __forceinline__ void copy_matrix(__nv_bfloat16* plane, const __nv_bfloat16* src, int tid) {
  const uint32_t base = smem_u32(plane);
#pragma unroll
  for (int it = 0; it < kGradRows<D> * D / 8 / kGradThreads<D>; ++it) {
    const int e = tid + it * kGradThreads<D>;
    cp_async_16(base + matrix_piece_index<D>(e) * 2, src + e * 8);
  }
}

// dgl = sum_v S0 * dS1 over the block's rows (fp32, from the bf16 values), the
// part of thread tid: key columns 8 (tid % (D / 8)).. +8 of rows tid / (D / 8)
// + (D / 8) it.
template <int D>
__device__ __forceinline__ void sum_dgl(const GradSmem<D>& sm, int tid, float (&gsum)[8]) {
  auto bf16_pair = [](uint32_t x) { return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x)); };
#pragma unroll
  for (int it = 0; it < kGradRows<D> * D / 8 / kGradThreads<D>; ++it) {
    const int idx = matrix_piece_index<D>(tid + it * kGradThreads<D>);
    const uint4 s0 = *reinterpret_cast<const uint4*>(sm.mat + idx);
    const uint4 d1 = *reinterpret_cast<const uint4*>(sm.ds1 + idx);
    const uint32_t a[4] = {s0.x, s0.y, s0.z, s0.w}, b[4] = {d1.x, d1.y, d1.z, d1.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 sa = bf16_pair(a[i]), sb = bf16_pair(b[i]);
      gsum[2 * i] = fmaf(sa.x, sb.x, gsum[2 * i]);
      gsum[2 * i + 1] = fmaf(sa.y, sb.y, gsum[2 * i + 1]);
    }
  }
}

// The warp's slice of a record gradient, tokens [16] x key columns k0.. +16,
// from its split accumulators (C fragments): summed over the terms (negated
// for kNegate) in the C fragments' order, [n-tile][element].
template <bool kNegate, int kTerms>
__device__ __forceinline__ void slice_sums(const float (&acc)[kTerms][2][4], float (&x)[2][4]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      x[nt][e] = kNegate ? -sum_terms(acc, nt, e) : sum_terms(acc, nt, e);
    }
  }
}

// Those sums into the row-major [16][kPitch] at dst (the record gradients, or
// the partner's receiving plane), adding the row-major [16][kAddPitch] addend
// where given (the partner's sums).
template <int kPitch, int kAddPitch = kPitch>
__device__ __forceinline__ void store_slice(float* dst, const float (&x)[2][4], int k0, int g, int t4,
                                            const float* addend = nullptr) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int k = k0 + 8 * nt + 2 * t4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = g + 8 * half;
      float2 y = make_float2(x[nt][2 * half], x[nt][2 * half + 1]);
      if (addend != nullptr) {
        const float2 other = *reinterpret_cast<const float2*>(addend + t * kAddPitch + k);
        y = make_float2(y.x + other.x, y.y + other.y);
      }
      *reinterpret_cast<float2*>(dst + t * kPitch + k) = y;
    }
  }
}

// Blocks an SM: two up to D = 128; one at 256 (214 KB).
template <int D>
constexpr int kGradBlocksPerSm = kBlocksOf<D> == 1 ? 2 : 1;

template <int D, bool kDoutFp32>
__global__ void __launch_bounds__(kGradThreads<D>, kGradBlocksPerSm<D>) record_grads_kernel(const SweepBwdParams bp) {
  using R = RecordLayout<D>;
  using DR = RecordGradLayout<D>;
  constexpr int kWarps = kGradWarps<D>, kThreads = kGradThreads<D>;
  constexpr int Dv = kGradRows<D>, kKeySlices = D / Dv;  // the block's value rows; a warp's key slices
  static_assert(D / 8 <= 32 && 32 % (D / 8) == 0, "the dgl sums: a column's lanes D / 8 apart within a warp");
  const FwdParams& p = bp.fwd;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  GradSmem<D>& sm = *reinterpret_cast<GradSmem<D>*>(smem_raw);
  // S0, dS1 and a bf16 dO are exact bf16 operands; the fp32 ones (U, dU, and
  // an fp32 dO) are split.
  constexpr bool kDoLo = kDoutFp32;

  const int64_t H = p.H;
  const int part = static_cast<int>(blockIdx.x % kBlocksOf<D>);  // the cluster's block rank where kPairOf
  const int vbase = Dv * part;  // the block's first value row
  const int64_t pair = blockIdx.x / kBlocksOf<D>;
  const int64_t h = pair % H;
  const int64_t wslot = pair / H;  // per-slot buffers are indexed from the window's first slot
  const int64_t slot = p.slot_begin + wslot;
  if (slot >= chunk_offset(p, p.N)) {
    return;  // a varlen call's capacity past its live chunks: nothing wrote states or dS there
  }
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int mi = lane / 8, mr = lane % 8;
  const int v0 = 16 * warp;  // the warp's rows of U (within the block's), and first key columns of the sums
  const int64_t n = sequence_of_slot(p, slot);
  const int64_t bos = seq_offset(p, n) + (slot - chunk_offset(p, n)) * C;
  const int len = static_cast<int>(min64(C, seq_offset(p, n + 1) - bos));
  float* dr = bp.d_record + (wslot * H + h) * DR::kFloats;
  const __nv_bfloat16* s0g = static_cast<const __nv_bfloat16*>(bp.states) + ((wslot * H + h) * D + vbase) * D;
  const __nv_bfloat16* dsg = static_cast<const __nv_bfloat16*>(bp.d_states) + ((wslot * H + h) * D + vbase) * D;

  {  // W's and M's planes of the record, verbatim; v; S0
    const unsigned char* rec = reinterpret_cast<const unsigned char*>(p.workspace) + (wslot * H + h) * R::kBytes;
    const uint32_t w = smem_u32(&sm.w[0][0]);
#pragma unroll
    for (int it = 0; it < 2 * R::kPlaneBytes / 16 / kThreads; ++it) {
      const int e = tid + it * kThreads;
      cp_async_16(w + e * 16, rec + R::kW + e * 16);
    }
    if (tid < 2 * R::kAqkPlaneBytes / 16) {
      cp_async_16(smem_u32(&sm.m[0][0]) + tid * 16, rec + R::kM + tid * 16);
    }
    static_assert(C * Dv / 8 == kThreads, "one 16-byte piece of v a thread");
    {
      const int t = tid / (Dv / 8), col = (tid % (Dv / 8)) * 8;
      if (t < len) {
        cp_async_16(smem_u32(&sm.v[t][col]),
                    static_cast<const __nv_bfloat16*>(p.v) + ((bos + t) * H + h) * D + vbase + col);
      } else {
        *reinterpret_cast<uint4*>(&sm.v[t][col]) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    copy_matrix<D>(sm.mat, s0g, tid);
    cp_async_commit();
    copy_matrix<D>(sm.ds1, dsg, tid);
    cp_async_commit();
  }
  float* partner_recv = nullptr;
  if constexpr (kPairOf<D>) {
    pair_start();
    partner_recv = partner_of(sm.recv);
  }
  // dO (bf16 or fp32; zero past the sequence's end) and dU (the dS recurrence's)
  // of the block's value rows as planes.
  {
    constexpr int kIt = C * Dv / 4 / kThreads;
    float4 o[kIt], d[kIt];
#pragma unroll
    for (int it = 0; it < kIt; ++it) {
      const int e = (tid + it * kThreads) * 4, t = e / Dv, col = vbase + e % Dv;
      o[it] = t < len ? load_dout4<kDoutFp32>(bp.grad_out, ((bos + t) * H + h) * D + col)
                      : make_float4(0.f, 0.f, 0.f, 0.f);
      d[it] = *reinterpret_cast<const float4*>(dr + DR::kU0 + t * D + col);
    }
#pragma unroll
    for (int it = 0; it < kIt; ++it) {
      const int e = (tid + it * kThreads) * 4;
      store_split4(sm.dout[0], sm.dout[1], plane_index<Dv>(e / Dv, e % Dv), o[it]);
      store_split4(sm.du[0], sm.du[1], plane_index<Dv>(e / Dv, e % Dv), d[it]);
    }
  }
  cp_async_wait<1>();  // all but dS1
  __syncthreads();

  // U^T = U0^T - S0 W^T for the warp's rows v0.. +16: W [t][k] with the tokens as
  // the n dimension, as in K2, and U0^T = v^T M^T as K2 forms it (v^T by
  // ldmatrix.trans, M [i][j] as M^T's B fragment; v exact, M's hi and lo).
  {
    float u0[2][4];
    {
      const int row = (mi / 2) * 8 + mr, col = (mi % 2) * 8;
      form_u0_tiles(&sm.v[row][v0 + col], &sm.m[0][row * C + col], &sm.m[1][row * C + col], u0);
    }
    float acc_u[2][2][4];  // written first by the kk = 0 products
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t sh[4];
      ldmatrix_x4(sh, plane_piece<D>(sm.mat, v0 + (mi % 2) * 8 + mr, 2 * kk + mi / 2));
      const int row = (mi / 2) * 8 + mr, piece = 2 * kk + mi % 2;
      uint32_t wh[4], wl[4];
      ldmatrix_x4(wh, record_piece(sm.w[0], row, piece));
      ldmatrix_x4(wl, record_piece(sm.w[1], row, piece));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_split<false, true>(acc_u, nt, sh, sh, wh[2 * nt], wh[2 * nt + 1], wl[2 * nt], wl[2 * nt + 1], kk == 0);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 8 * nt + 2 * t4 + (e & 1), v = v0 + g + 8 * (e >> 1);
        store_split(reinterpret_cast<unsigned char*>(sm.u[0]), C * Dv * 2, plane_index<Dv>(t, v),
                    u0[nt][e] - sum_terms(acc_u, nt, e));
      }
    }
  }
  __syncthreads();  // U's planes complete

  // The record gradients [t][k] for key columns k0.. +16 (k0 = v0 + Dv s for
  // the warp's key slices s), summed over the block's value rows: A = dO, dU, U
  // [t][v] (rows t), B = S0, then dS1 [v][k] (k dimension v). First dQs = dO
  // S0 and dW = -dU S0 (where kPairOf, block 0 keeps its own until block 1's come).
  float own_q[kKeySlices][2][4], own_w[kKeySlices][2][4];
#pragma unroll
  for (int ks = 0; ks < kKeySlices; ++ks) {
    const int k0 = v0 + Dv * ks;
    float aq[1 + kDoLo][2][4], aw[2][2][4];  // written first by the kv = 0 products
#pragma unroll
    for (int kv = 0; kv < Dv / 16; ++kv) {
      const int arow = (mi % 2) * 8 + mr, apiece = 2 * kv + mi / 2;
      uint32_t doh[4], dol[4], duh[4], dul[4];
      ldmatrix_x4(doh, plane_piece<Dv>(sm.dout[0], arow, apiece));
      if constexpr (kDoLo) {
        ldmatrix_x4(dol, plane_piece<Dv>(sm.dout[1], arow, apiece));
      }
      ldmatrix_x4(duh, plane_piece<Dv>(sm.du[0], arow, apiece));
      ldmatrix_x4(dul, plane_piece<Dv>(sm.du[1], arow, apiece));
      uint32_t sh[4];
      ldmatrix_x4_trans(sh, plane_piece<D>(sm.mat, 16 * kv + (mi % 2) * 8 + mr, k0 / 8 + mi / 2));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_split<kDoLo, false>(aq, nt, doh, dol, sh[2 * nt], sh[2 * nt + 1], sh[2 * nt], sh[2 * nt + 1], kv == 0);
        mma_split<true, false>(aw, nt, duh, dul, sh[2 * nt], sh[2 * nt + 1], sh[2 * nt], sh[2 * nt + 1], kv == 0);
      }
    }
    slice_sums<false>(aq, own_q[ks]);
    slice_sums<true>(aw, own_w[ks]);
    if (!kPairOf<D>) {
      store_slice<D>(dr + DR::kQs, own_q[ks], k0, g, t4);
      store_slice<D>(dr + DR::kW, own_w[ks], k0, g, t4);
    } else if (part == 1) {
      store_slice<Recv<D>::kPitch>(partner_recv + Recv<D>::kQs, own_q[ks], k0, g, t4);
      store_slice<Recv<D>::kPitch>(partner_recv + Recv<D>::kW, own_w[ks], k0, g, t4);
    }
  }
  float own_a[2][4];
  if (warp == kWarps - 1) {
    // dAqk [i][j] = sum_v dO[i][v] U[j][v]: B (k = v, n = j) is U's plane as it
    // stands. One warp's extra work.
    float aa[2 + kDoLo][2][4];  // written first by the kv = 0 products
#pragma unroll
    for (int kv = 0; kv < Dv / 16; ++kv) {
      const int arow = (mi % 2) * 8 + mr, apiece = 2 * kv + mi / 2;
      const int brow = (mi / 2) * 8 + mr, bpiece = 2 * kv + mi % 2;
      uint32_t doh[4], dol[4], bh[4], bl[4];
      ldmatrix_x4(doh, plane_piece<Dv>(sm.dout[0], arow, apiece));
      if constexpr (kDoLo) {
        ldmatrix_x4(dol, plane_piece<Dv>(sm.dout[1], arow, apiece));
      }
      ldmatrix_x4(bh, plane_piece<Dv>(sm.u[0], brow, bpiece));
      ldmatrix_x4(bl, plane_piece<Dv>(sm.u[1], brow, bpiece));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_split<kDoLo, true>(aa, nt, doh, dol, bh[2 * nt], bh[2 * nt + 1], bl[2 * nt], bl[2 * nt + 1], kv == 0);
      }
    }
    // [i][j], i = g + 8 (e / 2), j = 8 nt + 2 t4 + e % 2; where kPairOf block 1 stores it.
    slice_sums<false>(aa, own_a);
    if (!kPairOf<D> || part == 0) {
      store_slice<C>(kPairOf<D> ? partner_recv + Recv<D>::kAqk : dr + DR::kAqk, own_a, 0, g, t4);
    }
  }
  cp_async_wait<0>();
  // dS1's plane complete. Where kPairOf, the sums sent so far are read only
  // after the pair's one meeting below, which orders every write before it,
  // and no block writes a part of the other's memory that the other reads
  // before then: a cluster barrier here (its memory barrier and its wait for
  // the partner) would order nothing more.
  __syncthreads();

  // dgl, then dKd = U dS1.
  {
    float gsum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    sum_dgl<D>(sm, tid, gsum);
    // Lanes l, l + D / 8, ... hold the same columns (other rows).
#pragma unroll
    for (int off = D / 8; off < 32; off *= 2) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        gsum[i] += __shfl_xor_sync(0xffffffffu, gsum[i], off);
      }
    }
    if (lane < D / 8) {
      *reinterpret_cast<float4*>(&sm.dgl[warp][8 * lane]) = make_float4(gsum[0], gsum[1], gsum[2], gsum[3]);
      *reinterpret_cast<float4*>(&sm.dgl[warp][8 * lane + 4]) = make_float4(gsum[4], gsum[5], gsum[6], gsum[7]);
    }
  }
  __syncthreads();
  float own_k[kKeySlices][2][4];  // dKd, which block 1 keeps where kPairOf until block 0's come
#pragma unroll
  for (int ks = 0; ks < kKeySlices; ++ks) {
    const int k0 = v0 + Dv * ks;
    float ak[2][2][4];  // written first by the kv = 0 products
#pragma unroll
    for (int kv = 0; kv < Dv / 16; ++kv) {
      const int arow = (mi % 2) * 8 + mr, apiece = 2 * kv + mi / 2;
      uint32_t uh[4], ul[4];
      ldmatrix_x4(uh, plane_piece<Dv>(sm.u[0], arow, apiece));
      ldmatrix_x4(ul, plane_piece<Dv>(sm.u[1], arow, apiece));
      uint32_t dh[4];
      ldmatrix_x4_trans(dh, plane_piece<D>(sm.ds1, 16 * kv + (mi % 2) * 8 + mr, k0 / 8 + mi / 2));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_split<true, false>(ak, nt, uh, ul, dh[2 * nt], dh[2 * nt + 1], dh[2 * nt], dh[2 * nt + 1], kv == 0);
      }
    }
    slice_sums<false>(ak, own_k[ks]);
    if (!kPairOf<D>) {
      store_slice<D>(dr + DR::kKd, own_k[ks], k0, g, t4);
    } else if (part == 0) {
      store_slice<Recv<D>::kPitch>(partner_recv + Recv<D>::kKd, own_k[ks], k0, g, t4);
    }
  }
  static_assert(D <= kThreads, "dgl: a thread a key column");
  float own_gl = 0.f;
  if (tid < D) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      own_gl += sm.dgl[w][tid];
    }
    if (!kPairOf<D> || part == 0) {
      (kPairOf<D> ? partner_recv + Recv<D>::kGl : dr + DR::kGl)[tid] = own_gl;
    }
  }
  if constexpr (kPairOf<D>) {
    // Each block's sums from the other in its memory (block 1's dQs and dW in
    // block 0's; block 0's dKd, dAqk and dgl in block 1's), and neither writes
    // the other's again: both may read theirs and exit.
    pair_sync();
    if (part == 0) {
#pragma unroll
      for (int ks = 0; ks < kKeySlices; ++ks) {
        const int k0 = v0 + Dv * ks;
        store_slice<D, Recv<D>::kPitch>(dr + DR::kQs, own_q[ks], k0, g, t4, sm.recv + Recv<D>::kQs);
        store_slice<D, Recv<D>::kPitch>(dr + DR::kW, own_w[ks], k0, g, t4, sm.recv + Recv<D>::kW);
      }
    } else {
#pragma unroll
      for (int ks = 0; ks < kKeySlices; ++ks) {
        store_slice<D, Recv<D>::kPitch>(dr + DR::kKd, own_k[ks], v0 + Dv * ks, g, t4, sm.recv + Recv<D>::kKd);
      }
      if (warp == kWarps - 1) {
        store_slice<C>(dr + DR::kAqk, own_a, 0, g, t4, sm.recv + Recv<D>::kAqk);
      }
      if (tid < D) {
        dr[DR::kGl + tid] = own_gl + sm.recv[Recv<D>::kGl + tid];
      }
    }
  }
}

template <int D, bool kDoutFp32>
void launch_record_grads(const SweepBwdParams& bp, cudaStream_t stream) {
  constexpr size_t kSmem = sizeof(GradSmem<D>);
  static_assert(kSmem <= 227 * 1024, "over the per-block shared memory of sm_90");
  static_assert(kGradBlocksPerSm<D> * (kSmem + 1024) <= 228 * 1024, "the blocks an SM of __launch_bounds__");
  launch_chunk_heads(record_grads_kernel<D, kDoutFp32>, bp, bp.fwd, kBlocksOf<D>, kGradThreads<D>, kSmem, stream);
}

}  // namespace

void launch_record_gradients(const SweepBwdParams& bp, cudaStream_t stream) {
  if (bp.fwd.N == 0 || bp.fwd.slot_end <= bp.fwd.slot_begin || bp.fwd.H == 0) {
    return;
  }
  ChunkedHeadSizes::dispatch(bp.fwd.head_size, [&](auto head_size) {
    constexpr int D = decltype(head_size)::value;
    if (bp.grad_out_fp32) {
      launch_record_grads<D, true>(bp, stream);
    } else {
      launch_record_grads<D, false>(bp, stream);
    }
  });
}

}  // namespace kda::cuda
