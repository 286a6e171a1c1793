// The backward sweep. Per chunk, with the state S0 at its start, its record and
// dO (torch_kda/reference.py chunk_step_backward):
//   U  = U0 - W S0^T,  dU = Aqk^T dO + Kd dS1^T,
//   dQs = dO S0, dW = -dU S0, dKd = U dS1, dAqk = dO U^T, dgl = sum_v S0 * dS1, dU0 = dU,
//   dS0 = dS1 diag(gl) + dO^T Qs - dU^T W.
// Only dS goes from chunk to chunk, and neither it nor dU needs S0: the rows of
// dS (one per value channel) evolve independently given the chunk, as the
// state's do in K2. So two kernels:
//  - the dS recurrence walks each sequence backward with its row groups spread
//    over blocks as in K2 (a warp, or two splitting the key columns, carries 16
//    rows of dS in fp32 mma accumulators), and leaves dU (= dU0) and dS1 for
//    every chunk;
//  - the record gradients, sums over all 128 value rows of one chunk's products,
//    then run one block per (chunk slot, head), all chunks at once: warp w
//    computes U for rows 16w.. and then takes key columns 16w.. of the sums,
//    reading every row of S0 and dS1 from shared memory, so no partial sums
//    cross warps but dgl's, added in a fixed order (deterministic).
// One block per (sequence, head) doing both, as before, kept the GPU mostly idle
// where there are few heads (11 us per chunk, 32 of 132 SMs busy at 32 heads).
// The dS recurrence's products in bf16x3 as in K2 (mma.cuh): dS, dU and dO are
// split into hi/lo there; the record's planes are already split. The record
// gradients take S0 and dS1 as stored, in bf16 (halving the bytes that K2's
// state passes, the dS recurrence and the record gradients move per chunk),
// and split only the fp32 side of each product (dU, U, and dO when it is fp32).
#include <c10/cuda/CUDAException.h>

#include <cstddef>
#include <string>

#include "cuda/device_utils.cuh"
#include "cuda/launch.h"
#include "cuda/mma.cuh"

namespace kda::cuda {
namespace {

constexpr int C = kChunk;
constexpr int D = kHeadDim;
static_assert(C == 16, "the fragments below assume 16-token chunks");

// The record's [16][128] planes before Aqk's hi plane, in order (params.h).
constexpr int kQsHi = 0, kWHi = 1, kWLo = 2, kKdHi = 3, kKdLo = 4;

// One product of A and B, each split (hi, lo) or an exact bf16 (hi alone): the
// terms into separate accumulators, the small ones first (lo * hi, hi * lo,
// then hi * hi), so that consecutive mmas rarely wait on each other. With `zero`
// (a constant once loops are unrolled) the products start the sums.
template <bool kALo, bool kBLo>
__device__ __forceinline__ void mma_split(float (&acc)[1 + kALo + kBLo][2][4], int nt, const uint32_t (&ah)[4],
                                          const uint32_t (&al)[4], uint32_t bh0, uint32_t bh1, uint32_t bl0,
                                          uint32_t bl1, bool zero) {
  if constexpr (kALo) {
    mma_bf16_into(acc[0][nt], al, bh0, bh1, zero);
  }
  if constexpr (kBLo) {
    mma_bf16_into(acc[kALo][nt], ah, bl0, bl1, zero);
  }
  mma_bf16_into(acc[kALo + kBLo][nt], ah, bh0, bh1, zero);
}

template <int kTerms>
__device__ __forceinline__ float sum_terms(const float (&acc)[kTerms][2][4], int nt, int e) {
  if constexpr (kTerms == 1) {
    return acc[0][nt][e];
  } else if constexpr (kTerms == 2) {
    return acc[0][nt][e] + acc[1][nt][e];
  } else {
    return (acc[0][nt][e] + acc[1][nt][e]) + acc[2][nt][e];  // the small terms first, as mma_bf16x3
  }
}

// ---------------------------------------------------------------------------
// The dS recurrence.

// A block is kWarps / kSplit row groups (16 value rows each) of one (sequence,
// head), each row group's 128 key columns split over kSplit warps, as in K2:
// where each SM would run only one or two full-width warps, the split spreads
// a step's products over more of its schedulers. dU^T = dS1 Kd^T is then a sum
// of the warps' partial sums over their key columns, which meet in shared
// memory once a step; the update of dS needs only the warp's own columns.
template <int kWarps, int kSplit, bool kDoutFp32>
struct DsConfig {
  static_assert(kWarps % kSplit == 0 && (kSplit == 1 || kSplit == 2), "whole row groups; a two-way split at most");
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowGroups = kWarps / kSplit;
  static constexpr int kCols = 16 * kRowGroups;  // the block's value channels (rows of dS)
  static constexpr int kNt = 16 / kSplit;        // 8-column n-tiles of dS per warp
  static constexpr int kStages = 3;              // chunks staged ahead, as in K2
  static constexpr int kDoutBytes = kDoutFp32 ? 4 : 2;
  static constexpr int kRowPieces = kCols * kDoutBytes / 16;  // 16-byte pieces of one token's dO
  // Rows of the staged dO 16 bytes longer than the data: the two tokens a lane
  // reads (2t, 2t + 1, t = lane % 4) then sit in different banks.
  static constexpr int kDoutPitch = kCols * kDoutBytes + 16;
  // Per warp, its partial dU^T in fragment order ([n-tile][lane] of float4s).
  static constexpr int kRedFloats = kSplit > 1 ? 2 * 4 * 32 : 0;
};

template <int kCols, int kDoutPitch>
struct __align__(16) DsStage {
  // The record's bf16 part, verbatim: Qs hi, W and Kd hi/lo; Aqk hi; Qs lo; Aqk lo.
  __nv_bfloat16 mat[5][C * D];
  __nv_bfloat16 aqk_hi[C * C];
  __nv_bfloat16 qs_lo[C * D];
  __nv_bfloat16 aqk_lo[C * C];
  float gl[D];
  unsigned char dout[C * kDoutPitch];  // dO [t][block's v], as given; zero past the end
};

template <int kWarps, int kSplit, bool kDoutFp32>
using DsStageOf = DsStage<DsConfig<kWarps, kSplit, kDoutFp32>::kCols, DsConfig<kWarps, kSplit, kDoutFp32>::kDoutPitch>;

template <int kWarps, int kSplit, bool kDoutFp32>
constexpr size_t ds_smem_bytes() {
  using Cfg = DsConfig<kWarps, kSplit, kDoutFp32>;
  return Cfg::kStages * sizeof(DsStageOf<kWarps, kSplit, kDoutFp32>) + kWarps * Cfg::kRedFloats * sizeof(float);
}

template <bool kFp32>
__device__ __forceinline__ float dout_at(const unsigned char* row, int v) {
  if constexpr (kFp32) {
    return reinterpret_cast<const float*>(row)[v];
  } else {
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[v]);
  }
}

// The row group's warps meet here: named barrier 1 + rg over its kSplit warps
// (0 is the block's, __syncthreads). The barrier's number is an immediate in
// each branch: from a register, ptxas reserves all sixteen for the block.
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}

template <int kSplit, int kRowGroups>
__device__ __forceinline__ void row_group_barrier(int rg) {
  static_assert(kRowGroups <= 4, "four row groups at most");
  constexpr int kThreads = 32 * kSplit;
  if (kRowGroups == 1 || rg == 0) {
    named_barrier<1, kThreads>();
  } else if (kRowGroups == 2 || rg == 1) {
    named_barrier<2, kThreads>();
  } else if (rg == 2) {
    named_barrier<3, kThreads>();
  } else {
    named_barrier<4, kThreads>();
  }
}

template <int kWarps, int kSplit, bool kDoutFp32>
__global__ void __launch_bounds__(kWarps * 32) ds_recurrence_kernel(const SweepBwdParams bp) {
  using Cfg = DsConfig<kWarps, kSplit, kDoutFp32>;
  using St = DsStageOf<kWarps, kSplit, kDoutFp32>;
  constexpr int kSt = Cfg::kStages, kNt = Cfg::kNt;
  static_assert(offsetof(St, aqk_hi) == kWsAqk && offsetof(St, qs_lo) == kWsQsLo && offsetof(St, aqk_lo) == kWsAqkLo &&
                    offsetof(St, gl) == kWsGl,
                "one verbatim copy of the record's bf16 part");
  const FwdParams& p = bp.fwd;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  St* stages = reinterpret_cast<St*>(smem_raw);
  float4* red = reinterpret_cast<float4*>(smem_raw + kSt * sizeof(St));

  constexpr int kGroups = D / Cfg::kCols;
  const int64_t H = p.H;
  const int group = blockIdx.x % kGroups;
  const int64_t h = (blockIdx.x / kGroups) % H;
  const int64_t n = sequence_of_block_group(p, blockIdx.x / (kGroups * H));
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int mi = lane / 8, mr = lane % 8;  // ldmatrix: lane l addresses row l % 8 of matrix l / 8
  const int rg = warp / kSplit, ks = warp % kSplit;  // row group; key slice within it
  const int vcol0 = group * Cfg::kCols;    // the block's first value channel
  const int vloc = 16 * rg;                // the row group's first row within the block
  const int v0 = vcol0 + vloc;
  const int j0 = ks * kNt;                 // the warp's first n-tile of key columns

  const int64_t seq_bos = seq_offset(p, n), seq_eos = seq_offset(p, n + 1);
  // The sequence's part of this window [lo, hi), as in K2: its dS starts from
  // grad_final in the window where it ends, and goes to d_initial in the window
  // where it starts.
  const WindowPart part = window_part(p, n);
  const bool starts_here = part.starts_here, ends_here = part.ends_here;
  const int64_t c_begin = part.c_begin, hi = part.hi, nchunks = part.chunks();
  if (nchunks == 0 && !starts_here) {
    return;  // the whole block: nothing of this sequence here
  }
  const unsigned char* records = reinterpret_cast<const unsigned char*>(p.workspace);
  const unsigned char* gout = static_cast<const unsigned char*>(bp.grad_out);

  // Step c (from 0) handles slot hi - 1 - c: the sequence backward. Per-slot
  // buffers are indexed from the window's first slot.
  auto load_stage = [&](St& st, int64_t c) {
    const int64_t slot = hi - 1 - c;
    const unsigned char* rec = records + ((slot - p.slot_begin) * H + h) * kWsChunkBytes;
    // Fully unrolled: every thread's pieces at fixed offsets from its first.
    constexpr int kPieces = kWsGl / 16, kThreads = Cfg::kThreads;
    const uint32_t mat = smem_u32(&st.mat[0][0]) + tid * 16;
    const unsigned char* rec_t = rec + tid * 16;
#pragma unroll
    for (int it = 0; it < (kPieces + kThreads - 1) / kThreads; ++it) {
      if (kPieces % kThreads == 0 || tid + it * kThreads < kPieces) {
        cp_async_16(mat + it * kThreads * 16, rec_t + it * kThreads * 16);
      }
    }
    if (tid < D / 4) {
      cp_async_16(smem_u32(&st.gl[tid * 4]), rec + kWsGl + tid * 16);
    }
    const int64_t bos = seq_bos + (slot - c_begin) * C;
    constexpr int kDoutPieces = C * Cfg::kRowPieces;
#pragma unroll
    for (int it = 0; it < (kDoutPieces + kThreads - 1) / kThreads; ++it) {
      const int e = tid + it * kThreads;
      if (kDoutPieces % kThreads == 0 || e < kDoutPieces) {
        const int t = e / Cfg::kRowPieces, piece = e % Cfg::kRowPieces;
        const bool valid = bos + t < seq_eos;
        const unsigned char* src =
            valid ? gout + (((bos + t) * H + h) * D + vcol0) * Cfg::kDoutBytes + piece * 16 : gout;
        cp_async_16_or_zero(smem_u32(st.dout + t * Cfg::kDoutPitch + piece * 16), src, valid);
      }
    }
  };
#pragma unroll
  for (int s = 0; s < kSt - 1; ++s) {
    if (s < nchunks) {
      load_stage(stages[s], s);
    }
    cp_async_commit();
  }

  // ds[j][e]: dS rows v0 + g (e = 0, 1) and v0 + g + 8 (e = 2, 3), key columns
  // 8(j0 + j) + 2t4 (e even) and + 1 (e odd).
  const int64_t state_base = (n * H + h) * D * D;
  const float* ds_in = ends_here ? bp.grad_final : bp.d_carry;
  float ds[kNt][4];
#pragma unroll
  for (int j = 0; j < kNt; ++j) {
    const int64_t i0 = state_base + (v0 + g) * D + 8 * (j0 + j) + 2 * t4;
    if (ds_in != nullptr) {
      const float2 a = *reinterpret_cast<const float2*>(ds_in + i0);
      const float2 b = *reinterpret_cast<const float2*>(ds_in + i0 + 8 * D);
      ds[j][0] = a.x, ds[j][1] = a.y, ds[j][2] = b.x, ds[j][3] = b.y;
    } else {
      ds[j][0] = ds[j][1] = ds[j][2] = ds[j][3] = 0.f;
    }
  }

  // dS1, the gradient of a chunk's end state, for the record gradients, in
  // bf16: stored for step c + 1 once step c has made it, two n-tiles per 8-byte
  // store (quad_piece). The conversion is
  // satfinite (the same bf16 values, but for an infinity) so that ptxas cannot
  // merge it with the next step's splits of the same values, which then stay
  // live across the barrier (255 registers and spills); the splits' own hi
  // parts, stored from inside the products' loop, slowed the step where the
  // step is the chain (8192 x 64 heads: the dS recurrence 0.997 -> 1.213 ms).
  // (Through a shared-memory tile and one bulk copy per 256-byte row instead,
  // the dS recurrence was 15-20 % slower at 8192 and 32768 x 32 heads and 12 %
  // faster at 8192 x 64: the copies' operands are uniform registers, and each
  // copy took a loop of its own.)
  const bool odd = t4 & 1;
  auto store_ds1 = [&](int64_t wslot) {
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(bp.d_states) + ((wslot * H + h) * D + v0 + g) * D + 8 * j0 +
                         quad_piece_column(t4);
#pragma unroll
    for (int jj = 0; jj < kNt / 2; ++jj) {
      store_tile_pair_bf16<true>(out + 16 * jj, D, ds[2 * jj], ds[2 * jj + 1], odd);
    }
  };
  if (nchunks > 0) {
    store_ds1(hi - 1 - p.slot_begin);
  }

  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t slot = hi - 1 - c, wslot = slot - p.slot_begin;
    // One barrier a step (as K2): chunk c's stage is complete and every warp
    // has left step c - 1, whose stage is the one refilled here (and whose
    // partial sums have then been read).
    cp_async_wait<kSt - 2>();
    __syncthreads();
    if (c + kSt - 1 < nchunks) {
      load_stage(stages[(c + kSt - 1) % kSt], c + kSt - 1);
    }
    cp_async_commit();
    const St& st = stages[c % kSt];

    // dO^T as an A operand (rows: the row group's value channels; k: the tokens).
    uint32_t oh[4], ol[4];
    {
      const unsigned char* r0 = st.dout + (2 * t4) * Cfg::kDoutPitch;
      const unsigned char* r8 = r0 + 8 * Cfg::kDoutPitch;
      const int va = vloc + g, vb = vloc + g + 8;
      split_pack(dout_at<kDoutFp32>(r0, va), dout_at<kDoutFp32>(r0 + Cfg::kDoutPitch, va), oh[0], ol[0]);
      split_pack(dout_at<kDoutFp32>(r0, vb), dout_at<kDoutFp32>(r0 + Cfg::kDoutPitch, vb), oh[1], ol[1]);
      split_pack(dout_at<kDoutFp32>(r8, va), dout_at<kDoutFp32>(r8 + Cfg::kDoutPitch, va), oh[2], ol[2]);
      split_pack(dout_at<kDoutFp32>(r8, vb), dout_at<kDoutFp32>(r8 + Cfg::kDoutPitch, vb), oh[3], ol[3]);
    }

    // dU^T = dS1 Kd^T + dO^T Aqk for the row group's rows; Kd [t][k] with the
    // tokens as the n dimension, as W in K2; Aqk [i][t] as the B operand (k = i),
    // transposed. Split warps: dS1 Kd^T over the warp's key columns, and of
    // dO^T Aqk n-tile ks alone, so that the parts add up to dU^T.
    float acc_du[3][2][4];  // written first by the kk = 0 products
#pragma unroll
    for (int kk = 0; kk < kNt / 2; ++kk) {
      uint32_t dh[4], dl[4];
      split_pack(ds[2 * kk][0], ds[2 * kk][1], dh[0], dl[0]);
      split_pack(ds[2 * kk][2], ds[2 * kk][3], dh[1], dl[1]);
      split_pack(ds[2 * kk + 1][0], ds[2 * kk + 1][1], dh[2], dl[2]);
      split_pack(ds[2 * kk + 1][2], ds[2 * kk + 1][3], dh[3], dl[3]);
      const int row = (mi / 2) * 8 + mr, piece = j0 + 2 * kk + mi % 2;
      uint32_t kh[4], kl[4];
      ldmatrix_x4(kh, record_piece(st.mat[kKdHi], row, piece));
      ldmatrix_x4(kl, record_piece(st.mat[kKdLo], row, piece));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_split<true, true>(acc_du, nt, dh, dl, kh[2 * nt], kh[2 * nt + 1], kl[2 * nt], kl[2 * nt + 1], kk == 0);
      }
    }
    {
      const int arow = (mi % 2) * 8 + mr, acol = (mi / 2) * 8;
      uint32_t ah[4], al[4];
      ldmatrix_x4_trans(ah, &st.aqk_hi[arow * C + acol]);
      ldmatrix_x4_trans(al, &st.aqk_lo[arow * C + acol]);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        if (kSplit == 1 || nt == ks) {
          mma_split<true, true>(acc_du, nt, oh, ol, ah[2 * nt], ah[2 * nt + 1], al[2 * nt], al[2 * nt + 1], false);
        }
      }
    }
    // du[nt][e]: rows v0 + g (+ 8 for e >= 2), tokens 8nt + 2t4 (+ 1 for odd e); dU0 = dU.
    float du[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        du[nt][e] = sum_terms(acc_du, nt, e);
      }
    }
    if constexpr (kSplit > 1) {
      // The two warps' parts, each added to the other's: the same sum (and bits) in both.
      float4* mine = red + warp * (Cfg::kRedFloats / 4);
      const float4* other = red + (warp ^ 1) * (Cfg::kRedFloats / 4);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mine[nt * 32 + lane] = make_float4(du[nt][0], du[nt][1], du[nt][2], du[nt][3]);
      }
      row_group_barrier<kSplit, Cfg::kRowGroups>(rg);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float4 x = other[nt * 32 + lane];
        du[nt][0] += x.x, du[nt][1] += x.y, du[nt][2] += x.z, du[nt][3] += x.w;
      }
    }
    float* dr = bp.d_record + (wslot * H + h) * kDRecFloats;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      if (kSplit == 1 || nt == ks) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = 8 * nt + 2 * t4 + (e & 1), v = v0 + g + 8 * (e >> 1);
          dr[kDRecU0 + t * D + v] = du[nt][e];
        }
      }
    }

    // dS0 = dS1 diag(gl) + dO^T Qs - dU^T W over the warp's key columns; Qs and
    // W [t][k] transposed on the way (tokens are the k dimension). As in K2, the
    // products go into zero accumulators and reach dS through one fp32 FMA.
    uint32_t nh[4], nl[4];  // -dU^T as an A operand: its two n-tiles are the 16 tokens
    split_pack(-du[0][0], -du[0][1], nh[0], nl[0]);
    split_pack(-du[0][2], -du[0][3], nh[1], nl[1]);
    split_pack(-du[1][0], -du[1][1], nh[2], nl[2]);
    split_pack(-du[1][2], -du[1][3], nh[3], nl[3]);
#pragma unroll
    for (int jj = 0; jj < kNt / 2; ++jj) {
      const int row = (mi % 2) * 8 + mr, piece = j0 + 2 * jj + mi / 2;
      uint32_t qh[4], ql[4], wh[4], wl[4];
      ldmatrix_x4_trans(qh, record_piece(st.mat[kQsHi], row, piece));
      ldmatrix_x4_trans(ql, record_piece(st.qs_lo, row, piece));
      ldmatrix_x4_trans(wh, record_piece(st.mat[kWHi], row, piece));
      ldmatrix_x4_trans(wl, record_piece(st.mat[kWLo], row, piece));
      float upd[2][4];
      mma_bf16x3_zero(upd[0], oh, ol, qh[0], qh[1], ql[0], ql[1]);
      mma_bf16x3_zero(upd[1], oh, ol, qh[2], qh[3], ql[2], ql[3]);
      mma_bf16x3(upd[0], nh, nl, wh[0], wh[1], wl[0], wl[1]);
      mma_bf16x3(upd[1], nh, nl, wh[2], wh[3], wl[2], wl[3]);
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int j = 2 * jj + h2;
        const float2 decay = *reinterpret_cast<const float2*>(&st.gl[8 * (j0 + j) + 2 * t4]);
        ds[j][0] = fmaf(ds[j][0], decay.x, upd[h2][0]);
        ds[j][1] = fmaf(ds[j][1], decay.y, upd[h2][1]);
        ds[j][2] = fmaf(ds[j][2], decay.x, upd[h2][2]);
        ds[j][3] = fmaf(ds[j][3], decay.y, upd[h2][3]);
      }
    }
    if (c + 1 < nchunks) {
      store_ds1(wslot - 1);
    }
  }

  float* ds_out = starts_here ? bp.d_initial : bp.d_carry;
  if (ds_out != nullptr) {
#pragma unroll
    for (int j = 0; j < kNt; ++j) {
      const int64_t i0 = state_base + (v0 + g) * D + 8 * (j0 + j) + 2 * t4;
      *reinterpret_cast<float2*>(ds_out + i0) = make_float2(ds[j][0], ds[j][1]);
      *reinterpret_cast<float2*>(ds_out + i0 + 8 * D) = make_float2(ds[j][2], ds[j][3]);
    }
  }
}

template <int kWarps, int kSplit, bool kDoutFp32>
void launch_ds(const SweepBwdParams& bp, cudaStream_t stream) {
  using Cfg = DsConfig<kWarps, kSplit, kDoutFp32>;
  constexpr size_t kSmem = ds_smem_bytes<kWarps, kSplit, kDoutFp32>();
  static_assert(kSmem <= 227 * 1024, "over the per-block shared memory of sm_90");
  auto* kernel = ds_recurrence_kernel<kWarps, kSplit, kDoutFp32>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  const int64_t blocks = bp.fwd.N * bp.fwd.H * (D / Cfg::kCols);
  TORCH_CHECK(blocks <= INT32_MAX, "kda.bwd: ", std::to_string(bp.fwd.N), " sequences x ",
              std::to_string(bp.fwd.H), " heads is more blocks than one launch takes");
  kernel<<<static_cast<unsigned int>(blocks), Cfg::kThreads, kSmem, stream>>>(bp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool kDoutFp32>
void launch_ds_for(const SweepBwdParams& bp, cudaStream_t stream, DsBlock block) {
  // By the full-width row groups each SM would run (as K2, fwd_recurrence.cu):
  // four-warp blocks of them where there are more than two, else the key columns
  // split over two warps, in four-warp blocks (two row groups) where there are
  // two, two-warp blocks where there is one. Measured (H200, fwd + bwd ms): 4x2
  // 3.656 against 2x1 3.982 at 8192 x 32 heads, 14.24 against 15.18 at 32768 x
  // 32, and 2x2 3.756 and 14.22 there; 8x2 6.422 against 4x1 6.415 at 8192 x 64,
  // 4x2 9.999 against 4x1 10.055 at 8192 x 96 and 24.15 against 23.86 at 8 x
  // 8192 x 32, so the full-width blocks stay where more than two row groups run.
  if (block == DsBlock::kAuto) {
    const int64_t warps_per_sm = recurrence_warps_per_sm(bp.fwd);
    block = warps_per_sm > 2 ? DsBlock::k4x1 : warps_per_sm > 1 ? DsBlock::k4x2 : DsBlock::k2x2;
  }
  switch (block) {
    case DsBlock::k1x1:
      launch_ds<1, 1, kDoutFp32>(bp, stream);
      break;
    case DsBlock::k2x1:
      launch_ds<2, 1, kDoutFp32>(bp, stream);
      break;
    case DsBlock::k2x2:
      launch_ds<2, 2, kDoutFp32>(bp, stream);
      break;
    case DsBlock::k4x2:
      launch_ds<4, 2, kDoutFp32>(bp, stream);
      break;
    case DsBlock::k8x2:
      launch_ds<8, 2, kDoutFp32>(bp, stream);
      break;
    default:
      launch_ds<4, 1, kDoutFp32>(bp, stream);
      break;
  }
}

// ---------------------------------------------------------------------------
// The record gradients: one block of eight warps per (chunk slot, head).
//
// S0 and dS1 (bf16, as stored) each have a plane, and of the record only W and
// M are loaded, with v, for U = M v - W S0^T: 105 KB of shared memory, two
// blocks per SM. Every load is issued
// at the block's start, dS1's in a copy group of its own that the products
// reading S0 do not wait for (the kernel moves ~118 KB per chunk and head; with
// dS1 loaded after those products, into S0's plane, it waited on memory for
// 5.4 of its 13 cycles per instruction at 8192 x 96 heads, DRAM at 61 %).

constexpr int kGradWarps = D / 16;
constexpr int kGradThreads = 32 * kGradWarps;

struct __align__(16) GradSmem {
  __nv_bfloat16 mat[D * D];      // S0 [v][k], as stored; swizzled 128-wide rows (plane_index)
  __nv_bfloat16 ds1[D * D];      // dS1 [v][k], the same way
  __nv_bfloat16 w[2][C * D];     // the record's W planes, verbatim
  __nv_bfloat16 v[C][D + 8];     // v [t][v] (zero past the sequence's end), for U0 = M v
  __nv_bfloat16 m[2][C * C];     // the record's M planes, verbatim
  __nv_bfloat16 dout[2][C * D];  // dO [t][v], hi and lo (lo read only for an fp32 dO)
  __nv_bfloat16 u[2][C * D];     // U [t][v]
  __nv_bfloat16 du[2][C * D];    // dU [t][v]
  float dgl[kGradWarps][D];      // per warp: the sum over its rows of S0 * dS1
};
static_assert(kWsW % 16 == 0 && kWsM % 16 == 0 && offsetof(GradSmem, v) % 16 == 0 && offsetof(GradSmem, m) % 16 == 0,
              "16-byte copies");

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

// Piece e (8 consecutive values) of a stored [128][128] matrix: row e / 16, columns 8 (e % 16)..
__device__ __forceinline__ int matrix_piece_index(int e) {
  return plane_index(e / 16, 8 * (e % 16));
}

// S0 or dS1 into its plane, verbatim (cp.async, in the caller's commit group).
__device__ __forceinline__ void copy_matrix(__nv_bfloat16* plane, const __nv_bfloat16* src, int tid) {
  const uint32_t base = smem_u32(plane);
#pragma unroll
  for (int it = 0; it < D * D / 8 / kGradThreads; ++it) {
    const int e = tid + it * kGradThreads;
    cp_async_16(base + matrix_piece_index(e) * 2, src + e * 8);
  }
}

// dgl = sum_v S0 * dS1 (fp32, from the bf16 values), the part of thread tid:
// key columns 8 (tid % 16).. +8 of rows tid / 16 + 16 it.
__device__ __forceinline__ void sum_dgl(const GradSmem& sm, int tid, float (&gsum)[8]) {
  auto bf16_pair = [](uint32_t x) { return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x)); };
#pragma unroll
  for (int it = 0; it < D * D / 8 / kGradThreads; ++it) {
    const int idx = matrix_piece_index(tid + it * kGradThreads);
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

// The warp's slice of a record gradient, tokens [16] x key columns v0.. +16,
// from its split accumulators (C fragments), into the row-major [16][128] at dst.
template <bool kNegate, int kTerms>
__device__ __forceinline__ void store_slice(float* dst, const float (&acc)[kTerms][2][4], int v0, int g, int t4) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int k = v0 + 8 * nt + 2 * t4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = g + 8 * half, e = 2 * half;
      const float x = sum_terms(acc, nt, e), y = sum_terms(acc, nt, e + 1);
      *reinterpret_cast<float2*>(dst + t * D + k) = kNegate ? make_float2(-x, -y) : make_float2(x, y);
    }
  }
}

template <bool kDoutFp32>
__global__ void __launch_bounds__(kGradThreads, 2) record_grads_kernel(const SweepBwdParams bp) {
  const FwdParams& p = bp.fwd;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  GradSmem& sm = *reinterpret_cast<GradSmem*>(smem_raw);
  // S0, dS1 and a bf16 dO are exact bf16 operands; the fp32 ones (U, dU, and
  // an fp32 dO) are split.
  constexpr bool kDoLo = kDoutFp32;

  const int64_t H = p.H;
  const int64_t h = blockIdx.x % H;
  const int64_t wslot = blockIdx.x / H;  // per-slot buffers are indexed from the window's first slot
  const int64_t slot = p.slot_begin + wslot;
  if (slot >= chunk_offset(p, p.N)) {
    return;  // a varlen call's capacity past its live chunks: nothing wrote states or dS there
  }
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int mi = lane / 8, mr = lane % 8;
  const int v0 = 16 * warp;  // the warp's rows of U, and key columns of the record gradients
  const int64_t n = sequence_of_slot(p, slot);
  const int64_t bos = seq_offset(p, n) + (slot - chunk_offset(p, n)) * C;
  const int len = static_cast<int>(min64(C, seq_offset(p, n + 1) - bos));
  float* dr = bp.d_record + (wslot * H + h) * kDRecFloats;
  const __nv_bfloat16* s0g = static_cast<const __nv_bfloat16*>(bp.states) + (wslot * H + h) * D * D;
  const __nv_bfloat16* dsg = static_cast<const __nv_bfloat16*>(bp.d_states) + (wslot * H + h) * D * D;

  {  // W's and M's planes of the record, verbatim; v; S0
    const unsigned char* rec = reinterpret_cast<const unsigned char*>(p.workspace) + (wslot * H + h) * kWsChunkBytes;
    const uint32_t w = smem_u32(&sm.w[0][0]);
#pragma unroll
    for (int it = 0; it < 2 * kPlaneBytes / 16 / kGradThreads; ++it) {
      const int e = tid + it * kGradThreads;
      cp_async_16(w + e * 16, rec + kWsW + e * 16);
    }
    if (tid < 2 * kAqkPlaneBytes / 16) {
      cp_async_16(smem_u32(&sm.m[0][0]) + tid * 16, rec + kWsM + tid * 16);
    }
    static_assert(C * D / 8 == kGradThreads, "one 16-byte piece of v a thread");
    {
      const int t = tid / (D / 8), col = (tid % (D / 8)) * 8;
      if (t < len) {
        cp_async_16(smem_u32(&sm.v[t][col]), static_cast<const __nv_bfloat16*>(p.v) + ((bos + t) * H + h) * D + col);
      } else {
        *reinterpret_cast<uint4*>(&sm.v[t][col]) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    copy_matrix(sm.mat, s0g, tid);
    cp_async_commit();
    copy_matrix(sm.ds1, dsg, tid);
    cp_async_commit();
  }
  // dO (bf16 or fp32; zero past the sequence's end) and dU (the dS recurrence's) as planes.
  {
    constexpr int kIt = C * D / 4 / kGradThreads;
    float4 o[kIt], d[kIt];
#pragma unroll
    for (int it = 0; it < kIt; ++it) {
      const int e = (tid + it * kGradThreads) * 4, t = e / D;
      o[it] = t < len ? load_dout4<kDoutFp32>(bp.grad_out, ((bos + t) * H + h) * D + e % D)
                      : make_float4(0.f, 0.f, 0.f, 0.f);
      d[it] = *reinterpret_cast<const float4*>(dr + kDRecU0 + e);
    }
#pragma unroll
    for (int it = 0; it < kIt; ++it) {
      const int e = (tid + it * kGradThreads) * 4;
      store_split4(sm.dout[0], sm.dout[1], plane_index(e / D, e % D), o[it]);
      store_split4(sm.du[0], sm.du[1], plane_index(e / D, e % D), d[it]);
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
      ldmatrix_x4(sh, plane_piece(sm.mat, v0 + (mi % 2) * 8 + mr, 2 * kk + mi / 2));
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
        store_split(reinterpret_cast<unsigned char*>(sm.u[0]), kPlaneBytes, plane_index(t, v),
                    u0[nt][e] - sum_terms(acc_u, nt, e));
      }
    }
  }
  __syncthreads();  // U's planes complete

  // The record gradients [t][k] for key columns v0.. +16, summed over all value
  // rows: A = dO, dU, U [t][v] (rows t), B = S0, then dS1 [v][k] (k dimension v).
  // First dQs = dO S0 and dW = -dU S0.
  {
    float aq[1 + kDoLo][2][4], aw[2][2][4];  // written first by the kv = 0 products
#pragma unroll
    for (int kv = 0; kv < D / 16; ++kv) {
      const int arow = (mi % 2) * 8 + mr, apiece = 2 * kv + mi / 2;
      uint32_t doh[4], dol[4], duh[4], dul[4];
      ldmatrix_x4(doh, plane_piece(sm.dout[0], arow, apiece));
      if constexpr (kDoLo) {
        ldmatrix_x4(dol, plane_piece(sm.dout[1], arow, apiece));
      }
      ldmatrix_x4(duh, plane_piece(sm.du[0], arow, apiece));
      ldmatrix_x4(dul, plane_piece(sm.du[1], arow, apiece));
      uint32_t sh[4];
      ldmatrix_x4_trans(sh, plane_piece(sm.mat, 16 * kv + (mi % 2) * 8 + mr, v0 / 8 + mi / 2));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_split<kDoLo, false>(aq, nt, doh, dol, sh[2 * nt], sh[2 * nt + 1], sh[2 * nt], sh[2 * nt + 1], kv == 0);
        mma_split<true, false>(aw, nt, duh, dul, sh[2 * nt], sh[2 * nt + 1], sh[2 * nt], sh[2 * nt + 1], kv == 0);
      }
    }
    store_slice<false>(dr + kDRecQs, aq, v0, g, t4);
    store_slice<true>(dr + kDRecW, aw, v0, g, t4);
  }
  if (warp == kGradWarps - 1) {
    // dAqk [i][j] = sum_v dO[i][v] U[j][v]: B (k = v, n = j) is U's plane as it
    // stands. One warp's extra work.
    float aa[2 + kDoLo][2][4];  // written first by the kv = 0 products
#pragma unroll
    for (int kv = 0; kv < D / 16; ++kv) {
      const int arow = (mi % 2) * 8 + mr, apiece = 2 * kv + mi / 2;
      const int brow = (mi / 2) * 8 + mr, bpiece = 2 * kv + mi % 2;
      uint32_t doh[4], dol[4], bh[4], bl[4];
      ldmatrix_x4(doh, plane_piece(sm.dout[0], arow, apiece));
      if constexpr (kDoLo) {
        ldmatrix_x4(dol, plane_piece(sm.dout[1], arow, apiece));
      }
      ldmatrix_x4(bh, plane_piece(sm.u[0], brow, bpiece));
      ldmatrix_x4(bl, plane_piece(sm.u[1], brow, bpiece));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_split<kDoLo, true>(aa, nt, doh, dol, bh[2 * nt], bh[2 * nt + 1], bl[2 * nt], bl[2 * nt + 1], kv == 0);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int j = 8 * nt + 2 * t4;
      *reinterpret_cast<float2*>(dr + kDRecAqk + g * C + j) = make_float2(sum_terms(aa, nt, 0), sum_terms(aa, nt, 1));
      *reinterpret_cast<float2*>(dr + kDRecAqk + (g + 8) * C + j) =
          make_float2(sum_terms(aa, nt, 2), sum_terms(aa, nt, 3));
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // dS1's plane complete

  // dgl, then dKd = U dS1.
  {
    float gsum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    sum_dgl(sm, tid, gsum);
    // Lanes l and l + 16 hold the same columns (other rows).
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      gsum[i] += __shfl_xor_sync(0xffffffffu, gsum[i], 16);
    }
    if (lane < 16) {
      *reinterpret_cast<float4*>(&sm.dgl[warp][8 * lane]) = make_float4(gsum[0], gsum[1], gsum[2], gsum[3]);
      *reinterpret_cast<float4*>(&sm.dgl[warp][8 * lane + 4]) = make_float4(gsum[4], gsum[5], gsum[6], gsum[7]);
    }
  }
  __syncthreads();
  {
    float ak[2][2][4];  // written first by the kv = 0 products
#pragma unroll
    for (int kv = 0; kv < D / 16; ++kv) {
      const int arow = (mi % 2) * 8 + mr, apiece = 2 * kv + mi / 2;
      uint32_t uh[4], ul[4];
      ldmatrix_x4(uh, plane_piece(sm.u[0], arow, apiece));
      ldmatrix_x4(ul, plane_piece(sm.u[1], arow, apiece));
      uint32_t dh[4];
      ldmatrix_x4_trans(dh, plane_piece(sm.ds1, 16 * kv + (mi % 2) * 8 + mr, v0 / 8 + mi / 2));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_split<true, false>(ak, nt, uh, ul, dh[2 * nt], dh[2 * nt + 1], dh[2 * nt], dh[2 * nt + 1], kv == 0);
      }
    }
    store_slice<false>(dr + kDRecKd, ak, v0, g, t4);
  }
  if (tid < D) {
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < kGradWarps; ++w) {
      a += sm.dgl[w][tid];
    }
    dr[kDRecGl + tid] = a;
  }
}

template <bool kDoutFp32>
void launch_record_grads(const SweepBwdParams& bp, int64_t blocks, cudaStream_t stream) {
  constexpr size_t kSmem = sizeof(GradSmem);
  static_assert(kSmem <= 227 * 1024, "over the per-block shared memory of sm_90");
  static_assert(2 * (kSmem + 1024) <= 228 * 1024, "two blocks per SM");
  auto* kernel = record_grads_kernel<kDoutFp32>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  kernel<<<static_cast<unsigned int>(blocks), kGradThreads, kSmem, stream>>>(bp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_sweep_backward(const SweepBwdParams& bp, cudaStream_t stream, DsBlock block) {
  if (bp.fwd.N == 0 || bp.fwd.H == 0) {
    return;
  }
  if (bp.grad_out_fp32) {
    launch_ds_for<true>(bp, stream, block);
  } else {
    launch_ds_for<false>(bp, stream, block);
  }
  const int64_t blocks = (bp.fwd.slot_end - bp.fwd.slot_begin) * bp.fwd.H;
  if (blocks == 0) {
    return;
  }
  TORCH_CHECK(blocks <= INT32_MAX, "kda.bwd: ", std::to_string(bp.fwd.slot_end - bp.fwd.slot_begin), " chunks x ",
              std::to_string(bp.fwd.H), " heads is more blocks than one launch takes");
  if (bp.grad_out_fp32) {
    launch_record_grads<true>(bp, blocks, stream);
  } else {
    launch_record_grads<false>(bp, blocks, stream);
  }
}

}  // namespace kda::cuda
