// The backward sweep. Per chunk, with the state S0 at its start, its record and
// dO (torch_kda/reference.py chunk_step_backward):
//   U  = U0 - W S0^T,  dU = Aqk^T dO + Kd dS1^T,
//   dQs = dO S0, dW = -dU S0, dKd = U dS1, dAqk = dO U^T, dgl = sum_v S0 * dS1, dU0 = dU,
//   dS0 = dS1 diag(gl) + dO^T Qs - dU^T W.
// Only dS goes from chunk to chunk, and neither it nor dU needs S0: the rows of
// dS (one per value channel) evolve independently given the chunk, as the
// state's do in K2. So two kernels:
//  - the dS recurrence (this file) walks each sequence backward with its row
//    groups spread over blocks as in K2 (a warp, or two splitting the key
//    columns, carries 16 rows of dS in fp32 mma accumulators), and leaves dU
//    (= dU0) and dS1 for every chunk;
//  - the record gradients (record_gradients.cu), sums over all D value rows
//    of one chunk's products, then run one block per (chunk slot, head), all
//    chunks at once.
// One block per (sequence, head) doing both would keep the GPU mostly idle
// where there are few heads: a latency-bound block per pair, one SM each.
// The dS recurrence's products in bf16x3 as in K2 (mma.cuh): dS, dU and dO are
// split into hi/lo there; the record's planes are already split.
#include <c10/cuda/CUDAException.h>

#include <cstddef>
#include <string>

#include "cuda/backward/split_products.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/launch.h"
#include "cuda/mma.cuh"

namespace kda::cuda {
namespace {

// A block is kWarps / kSplit row groups (16 value rows each) of one (sequence,
// head), each row group's D key columns split over kSplit warps, as in K2:
// where each SM would run only one or two full-width warps, the split spreads
// a step's products over more of its schedulers. dU^T = dS1 Kd^T is then a sum
// of the warps' partial sums over their key columns, which meet in shared
// memory once a step; the update of dS needs only the warp's own columns.
template <int D, int kWarps, int kSplit, bool kDoutFp32>
struct DsConfig {
  static_assert(kWarps % kSplit == 0 && (kSplit == 1 || kSplit == 2), "whole row groups; a two-way split at most");
  static constexpr int kD = D;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowGroups = kWarps / kSplit;
  static constexpr int kCols = 16 * kRowGroups;  // the block's value channels (rows of dS)
  static constexpr int kNt = D / 8 / kSplit;     // 8-column n-tiles of dS per warp
  // Chunks staged ahead, as in K2. The split shapes with a bf16 dO take four
  // (two blocks an SM still fit at D = 128), so that more of the loads a step waits on are
  // in flight; the full-width 4x1 measured slower with four.
  static constexpr int kStages = kSplit == 2 && !kDoutFp32 ? 4 : 3;
  // dU^T's key-column products in two accumulator chains (even and odd k-steps)
  // where the warps split the columns: half the dependent mma latency a step,
  // for 136 -> 156-163 registers. The full-width 4x1 would need 254 and
  // measured no faster.
  static constexpr bool kTwoChains = kSplit == 2;
  static constexpr int kDoutBytes = kDoutFp32 ? 4 : 2;
  static constexpr int kRowPieces = kCols * kDoutBytes / 16;  // 16-byte pieces of one token's dO
  // Rows of the staged dO 16 bytes longer than the data: the two tokens a lane
  // reads (2t, 2t + 1, t = lane % 4) then sit in different banks.
  static constexpr int kDoutPitch = kCols * kDoutBytes + 16;
  // Per warp, its partial dU^T in fragment order ([n-tile][lane] of float4s).
  static constexpr int kRedFloats = kSplit > 1 ? 2 * 4 * 32 : 0;
};

template <int D, int kCols, int kDoutPitch>
struct __align__(16) DsStage {
  // The record's bf16 part, verbatim: Qs hi, W and Kd hi/lo; Aqk hi; Qs lo; Aqk lo.
  __nv_bfloat16 mat[5][C * D];
  __nv_bfloat16 aqk_hi[C * C];
  __nv_bfloat16 qs_lo[C * D];
  __nv_bfloat16 aqk_lo[C * C];
  float gl[D];
  unsigned char dout[C * kDoutPitch];  // dO [t][block's v], as given; zero past the end
};

template <class Cfg>
using DsStageOf = DsStage<Cfg::kD, Cfg::kCols, Cfg::kDoutPitch>;

template <class Cfg>
constexpr size_t ds_smem_bytes() {
  return Cfg::kStages * sizeof(DsStageOf<Cfg>) + Cfg::kThreads / 32 * Cfg::kRedFloats * sizeof(float);
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

// dS0 = dS1 diag(gl) + dO^T Qs - dU^T W over the warp's key columns; Qs and
// W [t][k] transposed on the way (tokens are the k dimension). As in K2, the
// products go into zero accumulators and reach dS through one fp32 FMA.
// oh, ol: dO^T as an A operand (ol is zero for a bf16 dO, kDoutLo false, and
// its products are skipped); du: dU^T in fragment order.
template <bool kDoutLo, class St, int kNt>
__device__ __forceinline__ void ds_update(const St& st, const float (&du)[2][4], const uint32_t (&oh)[4],
                                          const uint32_t (&ol)[4], int mi, int mr, int j0, int t4,
                                          float (&ds)[kNt][4]) {
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
    if constexpr (kDoutLo) {
      mma_bf16x3_zero(upd[0], oh, ol, qh[0], qh[1], ql[0], ql[1]);
      mma_bf16x3_zero(upd[1], oh, ol, qh[2], qh[3], ql[2], ql[3]);
    } else {
      mma_bf16_zero(upd[0], oh, ql[0], ql[1]);
      mma_bf16(upd[0], oh, qh[0], qh[1]);
      mma_bf16_zero(upd[1], oh, ql[2], ql[3]);
      mma_bf16(upd[1], oh, qh[2], qh[3]);
    }
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
}

// kEndsOnly: the segments' passes (segments.h, run backward: a window's
// segments as sequences): only each sequence's dS at its start, nothing per
// chunk. The grid's first half gives it from grad_final and dO into
// d_initial; with d_maps, a second half of as many blocks gives it from the
// identity with dO = 0 into d_maps (each segment's map), at the same time.
template <int D, int kWarps, int kSplit, bool kDoutFp32, bool kEndsOnly>
__global__ void __launch_bounds__(kWarps * 32) ds_recurrence_kernel(const SweepBwdParams bp) {
  using Cfg = DsConfig<D, kWarps, kSplit, kDoutFp32>;
  using St = DsStageOf<Cfg>;
  using R = RecordLayout<D>;
  using DR = RecordGradLayout<D>;
  constexpr int kSt = Cfg::kStages, kNt = Cfg::kNt;
  static_assert(offsetof(St, aqk_hi) == R::kAqk && offsetof(St, qs_lo) == R::kQsLo && offsetof(St, aqk_lo) == R::kAqkLo &&
                    offsetof(St, gl) == R::kGl,
                "one verbatim copy of the record's bf16 part");
  const FwdParams& p = bp.fwd;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  St* stages = reinterpret_cast<St*>(smem_raw);
  float4* red = reinterpret_cast<float4*>(smem_raw + kSt * sizeof(St));

  constexpr int kGroups = D / Cfg::kCols;
  const int64_t H = p.H;
  const int64_t pass_blocks = p.N * H * kGroups;
  const bool map_pass = kEndsOnly && blockIdx.x >= pass_blocks;
  const int64_t block = map_pass ? blockIdx.x - pass_blocks : blockIdx.x;
  const int group = block % kGroups;
  const int64_t h = (block / kGroups) % H;
  const int64_t n = sequence_of_block_group(p, block / (kGroups * H));
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
  const unsigned char* gout = map_pass ? nullptr : static_cast<const unsigned char*>(bp.grad_out);

  // Step c (from 0) handles slot hi - 1 - c: the sequence backward. Per-slot
  // buffers are indexed from the window's first slot.
  auto load_stage = [&](St& st, int64_t c) {
    const int64_t slot = hi - 1 - c;
    const unsigned char* rec = records + ((slot - p.slot_begin) * H + h) * R::kBytes;
    // Fully unrolled: every thread's pieces at fixed offsets from its first.
    constexpr int kPieces = R::kGl / 16, kThreads = Cfg::kThreads;
    const uint32_t mat = smem_u32(&st.mat[0][0]) + tid * 16;
    const unsigned char* rec_t = rec + tid * 16;
#pragma unroll
    for (int it = 0; it < (kPieces + kThreads - 1) / kThreads; ++it) {
      if (kPieces % kThreads == 0 || tid + it * kThreads < kPieces) {
        cp_async_16(mat + it * kThreads * 16, rec_t + it * kThreads * 16);
      }
    }
    static_assert(D / 4 <= Cfg::kThreads, "gl: one 16-byte piece a thread");
    if (tid < D / 4) {
      cp_async_16(smem_u32(&st.gl[tid * 4]), rec + R::kGl + tid * 16);
    }
    const int64_t bos = seq_bos + (slot - c_begin) * C;
    constexpr int kDoutPieces = C * Cfg::kRowPieces;
#pragma unroll
    for (int it = 0; it < (kDoutPieces + kThreads - 1) / kThreads; ++it) {
      const int e = tid + it * kThreads;
      if (kDoutPieces % kThreads == 0 || e < kDoutPieces) {
        const int t = e / Cfg::kRowPieces, piece = e % Cfg::kRowPieces;
        const bool valid = !map_pass && bos + t < seq_eos;
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
    if (map_pass) {  // the identity: rows v0 + g (+ 8), columns 8 (j0 + j) + 2 t4 (+ 1)
      const int row = v0 + g, col = 8 * (j0 + j) + 2 * t4;
      ds[j][0] = row == col, ds[j][1] = row == col + 1, ds[j][2] = row + 8 == col, ds[j][3] = row + 8 == col + 1;
    } else if (ds_in != nullptr) {
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
  // parts, stored from inside the products' loop, lengthen the step where the
  // step is the chain. Not through a shared-memory tile and one bulk copy per
  // row (256 bytes at D = 128): the copies' operands are uniform registers, and each copy
  // takes a loop of its own (docs/performance-notes.md).
  const bool odd = t4 & 1;
  auto store_ds1 = [&](int64_t wslot) {
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(bp.d_states) + ((wslot * H + h) * D + v0 + g) * D + 8 * j0 +
                         quad_piece_column(t4);
#pragma unroll
    for (int jj = 0; jj < kNt / 2; ++jj) {
      store_tile_pair_bf16<true>(out + 16 * jj, D, ds[2 * jj], ds[2 * jj + 1], odd);
    }
  };
  if (!kEndsOnly && nchunks > 0) {
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
    float acc_du[3][2][4];   // written first by the kk = 0 products
    float acc_du2[3][2][4];  // kTwoChains: the odd k-steps', written first by kk = 1
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
      const bool odd = Cfg::kTwoChains && kk % 2 == 1;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_split<true, true>(odd ? acc_du2 : acc_du, nt, dh, dl, kh[2 * nt], kh[2 * nt + 1], kl[2 * nt],
                              kl[2 * nt + 1], kk == (odd ? 1 : 0));
      }
    }
    if constexpr (Cfg::kTwoChains) {
#pragma unroll
      for (int t = 0; t < 3; ++t) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            acc_du[t][nt][e] += acc_du2[t][nt][e];
          }
        }
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
          if constexpr (kDoutFp32) {
            mma_split<true, true>(acc_du, nt, oh, ol, ah[2 * nt], ah[2 * nt + 1], al[2 * nt], al[2 * nt + 1], false);
          } else {
            // A bf16 dO has no lo part: its lo * hi term would add exact zeros.
            mma_split<false, true, 1>(acc_du, nt, oh, ol, ah[2 * nt], ah[2 * nt + 1], al[2 * nt], al[2 * nt + 1],
                                      false);
          }
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
    float* dr = bp.d_record + (wslot * H + h) * DR::kFloats;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      if (!kEndsOnly && (kSplit == 1 || nt == ks)) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = 8 * nt + 2 * t4 + (e & 1), v = v0 + g + 8 * (e >> 1);
          dr[DR::kU0 + t * D + v] = du[nt][e];
        }
      }
    }

    ds_update<kDoutFp32>(st, du, oh, ol, mi, mr, j0, t4, ds);
    if (!kEndsOnly && c + 1 < nchunks) {
      store_ds1(wslot - 1);
    }
  }

  float* ds_out = map_pass ? bp.d_maps : starts_here ? bp.d_initial : bp.d_carry;
  if (ds_out != nullptr) {
#pragma unroll
    for (int j = 0; j < kNt; ++j) {
      const int64_t i0 = state_base + (v0 + g) * D + 8 * (j0 + j) + 2 * t4;
      *reinterpret_cast<float2*>(ds_out + i0) = make_float2(ds[j][0], ds[j][1]);
      *reinterpret_cast<float2*>(ds_out + i0 + 8 * D) = make_float2(ds[j][2], ds[j][3]);
    }
  }
}

template <int D, int kWarps, int kSplit, bool kDoutFp32, bool kEndsOnly>
void launch_ds(const SweepBwdParams& bp, cudaStream_t stream) {
  using Cfg = DsConfig<D, kWarps, kSplit, kDoutFp32>;
  constexpr size_t kSmem = ds_smem_bytes<Cfg>();
  static_assert(kSmem <= 227 * 1024, "over the per-block shared memory of sm_90");
  auto* kernel = ds_recurrence_kernel<D, kWarps, kSplit, kDoutFp32, kEndsOnly>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  const int64_t blocks = bp.fwd.N * bp.fwd.H * (D / Cfg::kCols) * (kEndsOnly && bp.d_maps != nullptr ? 2 : 1);
  TORCH_CHECK(blocks <= INT32_MAX, "kda.bwd: ", std::to_string(bp.fwd.N), " sequences x ",
              std::to_string(bp.fwd.H), " heads is more blocks than one launch takes");
  kernel<<<static_cast<unsigned int>(blocks), Cfg::kThreads, kSmem, stream>>>(bp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int D, bool kDoutFp32, bool kEndsOnly>
void launch_ds_for(const SweepBwdParams& bp, cudaStream_t stream, DsBlock block) {
  switch (block) {
    case DsBlock::k4x1:
      if constexpr (has_kernels(DsBlock::k4x1, D)) {
        return launch_ds<D, 4, 1, kDoutFp32, kEndsOnly>(bp, stream);
      }
      break;
    case DsBlock::k4x2:
      if constexpr (has_kernels(DsBlock::k4x2, D)) {
        return launch_ds<D, 4, 2, kDoutFp32, kEndsOnly>(bp, stream);
      }
      break;
    case DsBlock::k2x2:
      if constexpr (has_kernels(DsBlock::k2x2, D)) {
        return launch_ds<D, 2, 2, kDoutFp32, kEndsOnly>(bp, stream);
      }
      break;
    case DsBlock::k8x2:  // four split row groups sharing a block's stages: eight warps of 255 registers
      if constexpr (has_kernels(DsBlock::k8x2, D)) {
        return launch_ds<D, 8, 2, kDoutFp32, kEndsOnly>(bp, stream);
      }
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "the dS recurrence: no kernels of the block shape at head size ", std::to_string(D));
}

}  // namespace

void launch_ds_recurrence(const SweepBwdParams& bp, cudaStream_t stream, DsBlock block, bool ends_only) {
  if (bp.fwd.N == 0 || bp.fwd.H == 0) {
    return;
  }
  ChunkedHeadSizes::dispatch(bp.fwd.head_size, [&](auto head_size) {
    constexpr int D = decltype(head_size)::value;
    if (ends_only) {
      if (bp.grad_out_fp32) {
        launch_ds_for<D, true, true>(bp, stream, block);
      } else {
        launch_ds_for<D, false, true>(bp, stream, block);
      }
    } else if (bp.grad_out_fp32) {
      launch_ds_for<D, true, false>(bp, stream, block);
    } else {
      launch_ds_for<D, false, false>(bp, stream, block);
    }
  });
}

}  // namespace kda::cuda
