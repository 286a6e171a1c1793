// The backward sweep: one block of eight warps per (sequence, head) walks the
// sequence's chunks backward, carrying dS (the gradient of the chunk-start
// state), and leaves per chunk the gradients of its record (params.h kDRec*)
// for K1's backward (bwd_prepare.cu). Per chunk, with the state S0 at its
// start, its record and dO (torch_kda/reference.py chunk_step_backward):
//   U  = U0 - W S0^T,  dU = Aqk^T dO + Kd dS1^T,
//   dQs = dO S0, dW = -dU S0, dKd = U dS1, dAqk = dO U^T, dgl = sum_v S0 * dS1, dU0 = dU,
//   dS0 = dS1 diag(gl) + dO^T Qs - dU^T W.
// The rows of dS (one per value channel) evolve independently given the chunk,
// as the state's do in K2, so warp w carries rows 16w.. +16 of dS in fp32 mma
// accumulators and computes U, dU and dS0 for them. The record gradients are
// sums over all 128 value rows: for those, warp w takes key columns 16w.. +16
// instead, reading every row of S0 and dS1 from shared memory, so no partial
// sums cross warps (but dgl's, added in a fixed order) and every sum has one
// order (deterministic).
// Products in bf16x3 as in K2 (mma.cuh): S0 (fp32) and dO (bf16 or fp32) are split
// into hi/lo planes here; the record's planes are already split.
#include <c10/cuda/CUDAException.h>

#include <string>

#include "cuda/device_utils.cuh"
#include "cuda/launch.h"
#include "cuda/mma.cuh"

namespace kda::cuda {
namespace {

constexpr int C = kChunk;
constexpr int D = kHeadDim;
constexpr int kWarps = D / 16;
constexpr int kThreads = 32 * kWarps;
static_assert(C == 16, "the fragments below assume 16-token chunks");

// The record's planes in order (params.h): Qs, W, Kd (hi, lo each), then Aqk's two.
constexpr int kQsHi = 0, kQsLo = 1, kWHi = 2, kWLo = 3, kKdHi = 4, kKdLo = 5;

struct __align__(16) SweepSmem {
  __nv_bfloat16 s0[2][D * D];    // S0 [v][k], hi and lo, swizzled 128-wide rows (plane_index)
  __nv_bfloat16 ds[2][D * D];    // dS1 [v][k], hi and lo
  unsigned char rec[kWsChunkBytes];  // the chunk's record, verbatim
  __nv_bfloat16 dout[2][C * D];  // dO [t][v], hi and lo
  __nv_bfloat16 u[2][C * D];     // U [t][v]
  __nv_bfloat16 du[2][C * D];    // dU [t][v]
  float dgl[kWarps][D];          // per warp: the sum over its 16 rows of S0 * dS1
};

// Four consecutive values of one row into the hi and lo planes at idx (a multiple of 4).
__device__ __forceinline__ void store_split4(__nv_bfloat16* hi, __nv_bfloat16* lo, int idx, float4 x) {
  uint32_t h0, l0, h1, l1;
  split_pack(x.x, x.y, h0, l0);
  split_pack(x.z, x.w, h1, l1);
  *reinterpret_cast<uint2*>(hi + idx) = make_uint2(h0, h1);
  *reinterpret_cast<uint2*>(lo + idx) = make_uint2(l0, l1);
}

__device__ __forceinline__ float plane_pair_value(const __nv_bfloat16* hi, const __nv_bfloat16* lo, int idx,
                                                  float& y) {
  const float2 h = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(hi + idx));
  const float2 l = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(lo + idx));
  y = h.y + l.y;
  return h.x + l.x;
}

template <int kTerms, int kNt>
__device__ __forceinline__ float sum3(const float (&acc)[kTerms][kNt][4], int nt, int e) {
  return (acc[0][nt][e] + acc[1][nt][e]) + acc[2][nt][e];  // the small terms first, as mma_bf16x3
}

// The three bf16x3 terms into separate accumulators, so that consecutive mmas
// rarely wait on each other.
__device__ __forceinline__ void mma3(float (&acc)[3][2][4], int nt, const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                     uint32_t bh0, uint32_t bh1, uint32_t bl0, uint32_t bl1) {
  mma_bf16(acc[0][nt], al, bh0, bh1);
  mma_bf16(acc[1][nt], ah, bl0, bl1);
  mma_bf16(acc[2][nt], ah, bh0, bh1);
}

// Four consecutive values of dO from bf16 or fp32; a compile-time choice, so
// that the loads of a chunk's S0 and dO all issue before the first use.
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

template <bool kDoutFp32>
__global__ void __launch_bounds__(kThreads, 1) sweep_backward_kernel(const SweepBwdParams bp) {
  const FwdParams& p = bp.fwd;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SweepSmem& sm = *reinterpret_cast<SweepSmem*>(smem_raw);
  const __nv_bfloat16* planes = reinterpret_cast<const __nv_bfloat16*>(sm.rec);
  const __nv_bfloat16* aqk_hi = reinterpret_cast<const __nv_bfloat16*>(sm.rec + kWsAqk);
  const __nv_bfloat16* aqk_lo = aqk_hi + C * C;
  const float* u0 = reinterpret_cast<const float*>(sm.rec + kWsU0);
  const float* gl = reinterpret_cast<const float*>(sm.rec + kWsGl);

  const int64_t H = p.H;
  const int64_t h = blockIdx.x % H;
  const int64_t n = blockIdx.x / H;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int mi = lane / 8, mr = lane % 8;  // ldmatrix: lane l addresses row l % 8 of matrix l / 8
  const int v0 = 16 * warp;                // the warp's dS rows, and key columns of the record gradients

  const int64_t seq_bos = seq_offset(p, n), seq_eos = seq_offset(p, n + 1);
  const int64_t c_begin = chunk_offset(p, n);
  const int64_t c_end = min64(chunk_offset(p, n + 1), p.num_slots);
  const int64_t state_base = (n * H + h) * D * D;
  const unsigned char* records = reinterpret_cast<const unsigned char*>(p.workspace);

  auto load_record = [&](int64_t slot) {
    const unsigned char* rec = records + (slot * H + h) * kWsChunkBytes;
    const uint32_t dst = smem_u32(sm.rec);
    for (int e = tid; e < kWsChunkBytes / 16; e += kThreads) {
      cp_async_16(dst + e * 16, rec + e * 16);
    }
    cp_async_commit();
  };
  if (c_end > c_begin) {
    load_record(c_end - 1);
  }

  // ds[j][e]: dS rows v0 + g (e = 0, 1) and v0 + g + 8 (e = 2, 3), key columns
  // 8j + 2t4 (e even) and + 1 (e odd).
  float ds[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const int64_t i0 = state_base + (v0 + g) * D + 8 * j + 2 * t4;
    if (bp.grad_final != nullptr) {
      const float2 a = *reinterpret_cast<const float2*>(bp.grad_final + i0);
      const float2 b = *reinterpret_cast<const float2*>(bp.grad_final + i0 + 8 * D);
      ds[j][0] = a.x, ds[j][1] = a.y, ds[j][2] = b.x, ds[j][3] = b.y;
    } else {
      ds[j][0] = ds[j][1] = ds[j][2] = ds[j][3] = 0.f;
    }
  }

  for (int64_t slot = c_end - 1; slot >= c_begin; --slot) {
    const int64_t bos = seq_bos + (slot - c_begin) * C;
    const int len = static_cast<int>(min64(C, seq_eos - bos));

    // S0 (fp32) and dO (bf16 or fp32; zero past the sequence's end) from global, as hi/lo planes.
    {
      const float* s0g = bp.states + (slot * H + h) * D * D;
      float4 x[D * D / 4 / kThreads];
#pragma unroll
      for (int it = 0; it < D * D / 4 / kThreads; ++it) {
        x[it] = *reinterpret_cast<const float4*>(s0g + (tid + it * kThreads) * 4);
      }
      float4 o[C * D / 4 / kThreads];
#pragma unroll
      for (int it = 0; it < C * D / 4 / kThreads; ++it) {
        const int e = (tid + it * kThreads) * 4, t = e / D;
        o[it] = t < len ? load_dout4<kDoutFp32>(bp.grad_out, ((bos + t) * H + h) * D + e % D)
                        : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int it = 0; it < D * D / 4 / kThreads; ++it) {
        const int e = (tid + it * kThreads) * 4;
        store_split4(sm.s0[0], sm.s0[1], plane_index(e / D, e % D), x[it]);
      }
#pragma unroll
      for (int it = 0; it < C * D / 4 / kThreads; ++it) {
        const int e = (tid + it * kThreads) * 4;
        store_split4(sm.dout[0], sm.dout[1], plane_index(e / D, e % D), o[it]);
      }
    }
    cp_async_wait<0>();
    __syncthreads();

    // U^T = U0^T - S0 W^T and dU^T = dS1 Kd^T + dO^T Aqk for the warp's rows.
    float acc_u[3][2][4] = {}, acc_du[3][2][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t sh[4], sl[4], dh[4], dl[4];
      {
        const int row = v0 + (mi % 2) * 8 + mr, piece = 2 * kk + mi / 2;
        ldmatrix_x4(sh, plane_piece(sm.s0[0], row, piece));
        ldmatrix_x4(sl, plane_piece(sm.s0[1], row, piece));
      }
      split_pack(ds[2 * kk][0], ds[2 * kk][1], dh[0], dl[0]);
      split_pack(ds[2 * kk][2], ds[2 * kk][3], dh[1], dl[1]);
      split_pack(ds[2 * kk + 1][0], ds[2 * kk + 1][1], dh[2], dl[2]);
      split_pack(ds[2 * kk + 1][2], ds[2 * kk + 1][3], dh[3], dl[3]);
      // W and Kd [t][k]: tokens as the n dimension, as in K2.
      const int row = (mi / 2) * 8 + mr, piece = 2 * kk + mi % 2;
      uint32_t wh[4], wl[4], kh[4], kl[4];
      ldmatrix_x4(wh, plane_piece(planes + kWHi * C * D, row, piece));
      ldmatrix_x4(wl, plane_piece(planes + kWLo * C * D, row, piece));
      ldmatrix_x4(kh, plane_piece(planes + kKdHi * C * D, row, piece));
      ldmatrix_x4(kl, plane_piece(planes + kKdLo * C * D, row, piece));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma3(acc_u, nt, sh, sl, wh[2 * nt], wh[2 * nt + 1], wl[2 * nt], wl[2 * nt + 1]);
        mma3(acc_du, nt, dh, dl, kh[2 * nt], kh[2 * nt + 1], kl[2 * nt], kl[2 * nt + 1]);
      }
    }
    // dO^T (rows v, tokens) from the [t][v] planes, transposed on the way; Aqk
    // [i][t] as the B operand (k = i), transposed likewise.
    uint32_t oh[4], ol[4];
    {
      const int row = (mi / 2) * 8 + mr, piece = v0 / 8 + mi % 2;
      ldmatrix_x4_trans(oh, plane_piece(sm.dout[0], row, piece));
      ldmatrix_x4_trans(ol, plane_piece(sm.dout[1], row, piece));
      const int arow = (mi % 2) * 8 + mr, acol = (mi / 2) * 8;
      uint32_t ah[4], al[4];
      ldmatrix_x4_trans(ah, aqk_hi + arow * C + acol);
      ldmatrix_x4_trans(al, aqk_lo + arow * C + acol);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma3(acc_du, nt, oh, ol, ah[2 * nt], ah[2 * nt + 1], al[2 * nt], al[2 * nt + 1]);
      }
    }
    // u[nt][e], du[nt][e]: rows v0 + g (+ 8 for e >= 2), tokens 8nt + 2t4 (+ 1 for odd e).
    float u[2][4], du[2][4];
    float* dr = bp.d_record + (slot * H + h) * kDRecFloats;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 8 * nt + 2 * t4 + (e & 1), v = v0 + g + 8 * (e >> 1);
        u[nt][e] = u0[t * D + v] - sum3(acc_u, nt, e);
        du[nt][e] = sum3(acc_du, nt, e);
        store_split(reinterpret_cast<unsigned char*>(sm.u[0]), kPlaneBytes, plane_index(t, v), u[nt][e]);
        store_split(reinterpret_cast<unsigned char*>(sm.du[0]), kPlaneBytes, plane_index(t, v), du[nt][e]);
        dr[kDRecU0 + t * D + v] = du[nt][e];
      }
    }

    // dS1 into the planes (for dKd) and the warp's part of dgl, before dS moves on.
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int k = 8 * j + 2 * t4;
      const int i0 = plane_index(v0 + g, k), i1 = plane_index(v0 + g + 8, k);
      uint32_t hi, lo;
      split_pack(ds[j][0], ds[j][1], hi, lo);
      *reinterpret_cast<uint32_t*>(&sm.ds[0][i0]) = hi;
      *reinterpret_cast<uint32_t*>(&sm.ds[1][i0]) = lo;
      split_pack(ds[j][2], ds[j][3], hi, lo);
      *reinterpret_cast<uint32_t*>(&sm.ds[0][i1]) = hi;
      *reinterpret_cast<uint32_t*>(&sm.ds[1][i1]) = lo;
      float s01, s11;
      const float s00 = plane_pair_value(sm.s0[0], sm.s0[1], i0, s01);
      const float s10 = plane_pair_value(sm.s0[0], sm.s0[1], i1, s11);
      float a = s00 * ds[j][0] + s10 * ds[j][2];
      float b = s01 * ds[j][1] + s11 * ds[j][3];
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, off);
        b += __shfl_xor_sync(0xffffffffu, b, off);
      }
      if (g == 0) {
        sm.dgl[warp][k] = a;
        sm.dgl[warp][k + 1] = b;
      }
    }

    // dS0 = dS1 diag(gl) + dO^T Qs - dU^T W; Qs and W [t][k] transposed on the
    // way (tokens are the k dimension). As in K2, the products go into zeroed
    // accumulators and reach dS through one fp32 FMA.
    {
      uint32_t nh[4], nl[4];  // -dU^T as an A operand: its two n-tiles are the 16 tokens
      split_pack(-du[0][0], -du[0][1], nh[0], nl[0]);
      split_pack(-du[0][2], -du[0][3], nh[1], nl[1]);
      split_pack(-du[1][0], -du[1][1], nh[2], nl[2]);
      split_pack(-du[1][2], -du[1][3], nh[3], nl[3]);
#pragma unroll
      for (int jj = 0; jj < D / 16; ++jj) {
        const int row = (mi % 2) * 8 + mr, piece = 2 * jj + mi / 2;
        uint32_t qh[4], ql[4], wh[4], wl[4];
        ldmatrix_x4_trans(qh, plane_piece(planes + kQsHi * C * D, row, piece));
        ldmatrix_x4_trans(ql, plane_piece(planes + kQsLo * C * D, row, piece));
        ldmatrix_x4_trans(wh, plane_piece(planes + kWHi * C * D, row, piece));
        ldmatrix_x4_trans(wl, plane_piece(planes + kWLo * C * D, row, piece));
        float upd[2][4] = {};
        mma_bf16x3(upd[0], oh, ol, qh[0], qh[1], ql[0], ql[1]);
        mma_bf16x3(upd[1], oh, ol, qh[2], qh[3], ql[2], ql[3]);
        mma_bf16x3(upd[0], nh, nl, wh[0], wh[1], wl[0], wl[1]);
        mma_bf16x3(upd[1], nh, nl, wh[2], wh[3], wl[2], wl[3]);
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int j = 2 * jj + h2;
          const float2 decay = *reinterpret_cast<const float2*>(&gl[8 * j + 2 * t4]);
          ds[j][0] = fmaf(ds[j][0], decay.x, upd[h2][0]);
          ds[j][1] = fmaf(ds[j][1], decay.y, upd[h2][1]);
          ds[j][2] = fmaf(ds[j][2], decay.x, upd[h2][2]);
          ds[j][3] = fmaf(ds[j][3], decay.y, upd[h2][3]);
        }
      }
    }
    __syncthreads();  // U, dU, dS1 planes and dgl parts complete; the record is read

    if (slot > c_begin) {
      load_record(slot - 1);  // lands while the record gradients below are computed
    }

    // The record gradients [t][k] for key columns v0.. +16, summed over all value
    // rows: A = dO, dU, U [t][v] (rows t), B = S0, dS1 [v][k] (k dimension v).
    float aq[3][2][4] = {}, aw[3][2][4] = {}, ak[3][2][4] = {};
#pragma unroll 2  // fully unrolled it spills twice as much (255 registers either way)
    for (int kv = 0; kv < D / 16; ++kv) {
      const int arow = (mi % 2) * 8 + mr, apiece = 2 * kv + mi / 2;
      uint32_t doh[4], dol[4], duh[4], dul[4], uh[4], ul[4];
      ldmatrix_x4(doh, plane_piece(sm.dout[0], arow, apiece));
      ldmatrix_x4(dol, plane_piece(sm.dout[1], arow, apiece));
      ldmatrix_x4(duh, plane_piece(sm.du[0], arow, apiece));
      ldmatrix_x4(dul, plane_piece(sm.du[1], arow, apiece));
      ldmatrix_x4(uh, plane_piece(sm.u[0], arow, apiece));
      ldmatrix_x4(ul, plane_piece(sm.u[1], arow, apiece));
      const int brow = 16 * kv + (mi % 2) * 8 + mr, bpiece = v0 / 8 + mi / 2;
      uint32_t sh[4], sl[4], dh[4], dl[4];
      ldmatrix_x4_trans(sh, plane_piece(sm.s0[0], brow, bpiece));
      ldmatrix_x4_trans(sl, plane_piece(sm.s0[1], brow, bpiece));
      ldmatrix_x4_trans(dh, plane_piece(sm.ds[0], brow, bpiece));
      ldmatrix_x4_trans(dl, plane_piece(sm.ds[1], brow, bpiece));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma3(aq, nt, doh, dol, sh[2 * nt], sh[2 * nt + 1], sl[2 * nt], sl[2 * nt + 1]);
        mma3(aw, nt, duh, dul, sh[2 * nt], sh[2 * nt + 1], sl[2 * nt], sl[2 * nt + 1]);
        mma3(ak, nt, uh, ul, dh[2 * nt], dh[2 * nt + 1], dl[2 * nt], dl[2 * nt + 1]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int k = v0 + 8 * nt + 2 * t4;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int t = g + 8 * half, e = 2 * half;
        *reinterpret_cast<float2*>(dr + kDRecQs + t * D + k) = make_float2(sum3(aq, nt, e), sum3(aq, nt, e + 1));
        *reinterpret_cast<float2*>(dr + kDRecW + t * D + k) = make_float2(-sum3(aw, nt, e), -sum3(aw, nt, e + 1));
        *reinterpret_cast<float2*>(dr + kDRecKd + t * D + k) = make_float2(sum3(ak, nt, e), sum3(ak, nt, e + 1));
      }
    }
    if (warp == kWarps - 1) {
      // dAqk [i][j] = sum_v dO[i][v] U[j][v]: B (k = v, n = j) is U's plane as it
      // stands. One warp's extra work; the others sum dgl meanwhile.
      float aa[3][2][4] = {};
#pragma unroll
      for (int kv = 0; kv < D / 16; ++kv) {
        const int arow = (mi % 2) * 8 + mr, apiece = 2 * kv + mi / 2;
        const int brow = (mi / 2) * 8 + mr, bpiece = 2 * kv + mi % 2;
        uint32_t doh[4], dol[4], bh[4], bl[4];
        ldmatrix_x4(doh, plane_piece(sm.dout[0], arow, apiece));
        ldmatrix_x4(dol, plane_piece(sm.dout[1], arow, apiece));
        ldmatrix_x4(bh, plane_piece(sm.u[0], brow, bpiece));
        ldmatrix_x4(bl, plane_piece(sm.u[1], brow, bpiece));
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          mma3(aa, nt, doh, dol, bh[2 * nt], bh[2 * nt + 1], bl[2 * nt], bl[2 * nt + 1]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int j = 8 * nt + 2 * t4;
        *reinterpret_cast<float2*>(dr + kDRecAqk + g * C + j) = make_float2(sum3(aa, nt, 0), sum3(aa, nt, 1));
        *reinterpret_cast<float2*>(dr + kDRecAqk + (g + 8) * C + j) = make_float2(sum3(aa, nt, 2), sum3(aa, nt, 3));
      }
    }
    if (tid < D) {
      float a = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        a += sm.dgl[w][tid];
      }
      dr[kDRecGl + tid] = a;
    }
    __syncthreads();  // the next chunk rewrites the S0, dO, dS1, U and dU planes and dgl
  }

  if (bp.d_initial != nullptr) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int64_t i0 = state_base + (v0 + g) * D + 8 * j + 2 * t4;
      *reinterpret_cast<float2*>(bp.d_initial + i0) = make_float2(ds[j][0], ds[j][1]);
      *reinterpret_cast<float2*>(bp.d_initial + i0 + 8 * D) = make_float2(ds[j][2], ds[j][3]);
    }
  }
}

}  // namespace

void launch_sweep_backward(const SweepBwdParams& bp, cudaStream_t stream) {
  if (bp.fwd.N == 0 || bp.fwd.H == 0) {
    return;
  }
  constexpr size_t kSmem = sizeof(SweepSmem);
  static_assert(kSmem <= 227 * 1024, "over the per-block shared memory of sm_90");
  auto* kernel = bp.grad_out_fp32 ? sweep_backward_kernel<true> : sweep_backward_kernel<false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  const int64_t blocks = bp.fwd.N * bp.fwd.H;
  TORCH_CHECK(blocks <= INT32_MAX, "kda.bwd: ", std::to_string(bp.fwd.N), " sequences x ",
              std::to_string(bp.fwd.H), " heads is more blocks than one launch takes");
  kernel<<<static_cast<unsigned int>(blocks), kThreads, kSmem, stream>>>(bp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kda::cuda
