// K2: the chunk-by-chunk recurrence, on the tensor cores.
//
// The rows of the V-first state (one per value channel) evolve independently
// given a chunk's operands, so a "row group" of kSplit warps owns 16 value rows
// of one (sequence, head) state, each warp D / kSplit of its key columns, as
// fp32 accumulators for the whole sequence. A block's warps belong to one
// (sequence, head) and share the chunk's operands, which the block stages in
// shared memory ahead of use with cp.async. The block shapes (launch.h,
// chosen in heuristics.cpp):
//   4x1w  four full-width warps (kSplit 1), one warpgroup: its state products
//         run on wgmma, the warpgroup's 64 rows at once (wgmma_body; D = 128);
//   2x2   two warps splitting one row group's key columns (split_body);
//   4x4   four warps splitting one row group's key columns (split_body);
//   8x4, 16x4  two and four such row groups sharing the block's stages
//         (split_body; D = 256, where one stage is 44 KB).
// A split row group's partial sums over k meet in shared memory once a chunk,
// which shortens the sequential chain where too few (sequence, head) pairs run
// to fill the GPU.
//
// Per chunk, per row group (v: its 16 rows; c: the 16 tokens), the state's
// products in bf16x3 (mma.cuh), so an fp32 state stays fp32-accurate (a bf16
// state's in bf16 alone: kX3, FwdParams::bf16_products), the output's with the
// record side in bf16 alone (params.h) and, but in the 2x2 shape with bf16x3,
// the state's hi part alone (kQsLo):
//   U^T = v^T M^T - S W^T          (U0 = M v: params.h)
//   O^T = S Qs^T + U^T Aqk^T       -> out (not in the backward's passes)
//   S   = S diag(gl) + U^T Kd
// U^T Kd goes into zeroed accumulators and reaches S by one fp32 FMA: the
// tensor cores' own fp32 additions are reported to truncate, which would pull
// the state towards zero a little every chunk.
#include <c10/cuda/CUDAException.h>

#include <cstddef>
#include <string>

#include "cuda/device_utils.cuh"
#include "cuda/launch.h"
#include "cuda/mma.cuh"
#include "cuda/wgmma.cuh"

namespace kda::cuda {
namespace {

constexpr int C = kChunk;
constexpr int kOutPad = 16 + 8;
static_assert(C == 16, "the fragments below assume 16-token chunks");

// The bf16 planes that the forward reads, in record order (params.h), then Aqk's
// hi plane: the first kQsLo bytes of a record (RecordLayout), copied verbatim.
enum Plane { kQs, kWHi, kWLo, kKdHi, kKdLo, kPlanes };
// With bf16 products (no kX3) a stage holds no lo planes: Qs, W's hi plane,
// then Kd's (8 KB less a stage).
template <bool kX3>
constexpr int kKdHiPlane = kX3 ? kKdHi : 2;

// D: the head size (K = V); kCols: the block's value channels; wgmma's operands want kAlign 1024.
template <int D, int kCols, bool kX3, int kAlign = 16>
struct alignas(kAlign) Stage {
  static constexpr int kD = D;
  using R = RecordLayout<D>;
  static_assert(R::kW == R::kPlaneBytes && R::kKd == 3 * R::kPlaneBytes && R::kAqk == kPlanes * R::kPlaneBytes &&
                    R::kQsLo == R::kAqk + R::kAqkPlaneBytes,
                "the record's bf16 part read here is contiguous");
  // v's rows 16 bytes longer than the block's channels: the 8 rows of one
  // ldmatrix then start in distinct 16-byte bank groups.
  static constexpr int kVPitch = kCols + 8;
  __nv_bfloat16 mat[kX3 ? kPlanes : kKdHiPlane<false> + 1][C * D];  // swizzled planes (record_index)
  __nv_bfloat16 aqk[C * C];
  __nv_bfloat16 m[2][C * C];          // M hi, lo: [i][j]
  __nv_bfloat16 v[C][kVPitch];        // the chunk's v, the block's channels; zeros past the sequence
  float gl[D];
};

// A block's warps where it holds one row group: the 2x2's two, the 4x4's four,
// the 4x1w's warpgroup.
template <int kSplit>
constexpr int kOneGroupWarps = kSplit == 2 ? 2 : 4;

// A block shape at head size D: kSplit warps to a row group (1: the 4x1w
// warpgroup; 2: 2x2; 4: 4x4, 8x4 and 16x4), kWarps a block. The row groups of
// a block share its stages.
template <int D, int kSplitArg, bool kX3Arg, int kWarpsArg = kOneGroupWarps<kSplitArg>>
struct Config {
  static constexpr int kD = D;
  static constexpr int kSplit = kSplitArg;
  static constexpr bool kX3 = kX3Arg;
  static constexpr bool kWg = kSplit == 1;
  static constexpr int kWarps = kWarpsArg;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowGroups = kWarps / kSplit;
  static constexpr int kCols = 16 * kRowGroups;  // value channels of a block
  static constexpr int kNt = D / 8 / kSplit;     // 8-column n-tiles of state per warp
  // Chunks staged ahead (the ring's length): three hide L2 latency behind a
  // step; the 2x2 (two blocks an SM) runs faster with four, the 4x4 slower
  // with six (docs/performance-notes.md).
  static constexpr int kSt = kSplit == 2 ? 4 : 3;
  using St = Stage<D, kCols, kX3, kWg ? 1024 : 16>;
  // Per warp, the partial sums over its key columns of S W^T and S Qs^T in
  // fragment order ([product][n-tile][lane] of float4s, a lane's four elements).
  static constexpr int kRedFloats = kSplit > 1 ? 2 * 2 * 4 * 32 : 0;
  static constexpr size_t kSmem = kSt * sizeof(St) + kRowGroups * C * kOutPad * sizeof(__nv_bfloat16) +
                                  kWarps * kRedFloats * sizeof(float) + (kWg ? 1024 : 0);  // + the alignment's slack
  static_assert(kSplit == 1 || kSplit == 2 || kSplit == 4, "the three splits");
  static_assert(kWarps % kSplit == 0 && (kSplit > 1 || kWarps == 4), "whole row groups; the 4x1w one warpgroup");
  static_assert(kNt % 2 == 0, "each warp's key columns in whole 16-column k-steps");
  static_assert(D % kCols == 0, "a head's value rows in whole blocks");
};
// Copies bytes [kFrom, kTo) of a record's bf16 part to offset kDst of a
// stage's (mat, aqk), 16 bytes a thread and instruction.
template <int kFrom, int kTo, int kDst, int kThreads>
__device__ __forceinline__ void copy_record_bytes(uint32_t mat, const unsigned char* rec, int tid) {
  static_assert(kFrom % 16 == 0 && kTo % 16 == 0 && kDst % 16 == 0 && kFrom < kTo, "whole 16-byte pieces");
  constexpr int kPieces = (kTo - kFrom) / 16;
  mat += kDst + tid * 16;
  rec += kFrom + tid * 16;
#pragma unroll
  for (int it = 0; it < kPieces / kThreads; ++it) {
    cp_async_16(mat + it * kThreads * 16, rec + it * kThreads * 16);
  }
  constexpr int kRest = kPieces % kThreads, kDone = kPieces / kThreads * kThreads;
  if (kRest != 0 && tid < kRest) {
    cp_async_16(mat + kDone * 16, rec + kDone * 16);
  }
}

// Issues the copies of one chunk into a stage: its record's bf16 part (with
// kX3 all of it, verbatim; else Qs, W's and Kd's hi planes and Aqk, without
// the lo planes that bf16 products do not read), M and gl, and the `len` rows
// of v from `v` on (rows `row_stride` elements apart; the block's channels).
// Every thread's pieces sit at fixed offsets from its first, so the fully
// unrolled loops cost one instruction per 16 bytes.
// kQw: Qs's and W's hi planes interleaved by halves, [half][Qs's 16 rows, then
// W's][64 keys], so that one wgmma of n = 32 takes both products of a k-step
// (the 4x1w shape with bf16 products).
template <int kThreads, bool kQw = false, int D, int kCols, bool kX3, int kAlign>
__device__ __forceinline__ void load_stage(Stage<D, kCols, kX3, kAlign>& st, const unsigned char* rec,
                                           const __nv_bfloat16* v, int64_t row_stride, int len, int tid) {
  using St = Stage<D, kCols, kX3, kAlign>;
  using R = typename St::R;
  const uint32_t mat = smem_u32(&st.mat[0][0]);
  static_assert(!kQw || !kX3, "the interleaved planes are the hi planes of bf16 products");
  static_assert(!kQw || D == 128, "the interleave takes a plane as two 64-column blocks");
  constexpr int kHalf = R::kPlaneBytes / 2;
  if constexpr (kX3) {
    static_assert(offsetof(St, aqk) == R::kAqk && offsetof(St, m) >= R::kQsLo, "mat and aqk are one verbatim copy");
    copy_record_bytes<0, R::kQsLo, 0, kThreads>(mat, rec, tid);
  } else {
    static_assert(R::kW + R::kPlaneBytes == 2 * R::kPlaneBytes && offsetof(St, aqk) == 3 * R::kPlaneBytes,
                  "Qs and W's hi plane are contiguous in both; then Kd's hi plane and Aqk");
    if constexpr (kQw) {
      copy_record_bytes<R::kQs, R::kQs + kHalf, 0, kThreads>(mat, rec, tid);
      copy_record_bytes<R::kW, R::kW + kHalf, kHalf, kThreads>(mat, rec, tid);
      copy_record_bytes<R::kQs + kHalf, R::kQs + R::kPlaneBytes, 2 * kHalf, kThreads>(mat, rec, tid);
      copy_record_bytes<R::kW + kHalf, R::kW + R::kPlaneBytes, 3 * kHalf, kThreads>(mat, rec, tid);
    } else {
      copy_record_bytes<0, R::kW + R::kPlaneBytes, 0, kThreads>(mat, rec, tid);
    }
    copy_record_bytes<R::kKd, R::kKd + R::kPlaneBytes, kKdHiPlane<false> * R::kPlaneBytes, kThreads>(mat, rec, tid);
    copy_record_bytes<R::kAqk, R::kQsLo, offsetof(St, aqk), kThreads>(mat, rec, tid);
  }
  constexpr int kMPieces = 2 * R::kAqkPlaneBytes / 16;
  static_assert(kMPieces <= kThreads, "one piece of M per thread");
  if (tid < kMPieces) {
    cp_async_16(smem_u32(&st.m[0][0]) + tid * 16, rec + R::kM + tid * 16);
  }
  // v: kCols / 8 pieces per row; zeros past the chunk's tokens, and everywhere
  // for a null v (FwdParams::v).
  constexpr int kVPieces = kCols / 8;
#pragma unroll
  for (int it = 0; it < (C * kVPieces + kThreads - 1) / kThreads; ++it) {
    const int e = tid + it * kThreads, r = e / kVPieces, piece = e % kVPieces;
    if (e < C * kVPieces) {
      const bool valid = r < len && v != nullptr;
      cp_async_16_or_zero(smem_u32(&st.v[r][piece * 8]),
                          valid ? static_cast<const void*>(v + r * row_stride + piece * 8) : rec, valid);
    }
  }
  static_assert(D / 4 <= kThreads, "gl: one 16-byte piece a thread");
  if (tid < D / 4) {
    cp_async_16(smem_u32(&st.gl[tid * 4]), rec + R::kGl + tid * 16);
  }
}

__device__ __forceinline__ void load_state_pair(const void* base, int64_t index, bool fp32, float& x, float& y) {
  if (fp32) {
    const float2 v = *reinterpret_cast<const float2*>(static_cast<const float*>(base) + index);
    x = v.x;
    y = v.y;
  } else {
    const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(static_cast<const __nv_bfloat16*>(base) + index);
    x = __low2float(v);
    y = __high2float(v);
  }
}

__device__ __forceinline__ void store_state_pair(void* base, int64_t index, bool fp32, float x, float y) {
  if (fp32) {
    *reinterpret_cast<float2*>(static_cast<float*>(base) + index) = make_float2(x, y);
  } else {
    *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(base) + index) = __floats2bfloat162_rn(x, y);
  }
}


// A thread's lanes, rows and key columns within its block.
struct Lanes {
  int tid, warp, lane, g, t;
  int rg, ks;  // row group; key slice within it
  int vloc;    // the row group's first row within the block
  int j0;      // the warp's first n-tile of key columns
  int mi, mr;  // ldmatrix: lane l addresses row l % 8 of matrix l / 8
};

template <int D, int kSplit, int kKs>
__device__ __forceinline__ Lanes lanes_of_thread() {
  static_assert((kSplit == 4) == (kKs >= 0), "a fixed key slice with four split warps only");
  Lanes w;
  w.tid = threadIdx.x, w.warp = w.tid / 32, w.lane = w.tid % 32;
  w.g = w.lane / 4, w.t = w.lane % 4;
  w.rg = w.warp / kSplit, w.ks = kKs >= 0 ? kKs : w.warp % kSplit;
  w.vloc = w.rg * 16;
  w.j0 = w.ks * (D / 8 / kSplit);
  w.mi = w.lane / 8, w.mr = w.lane % 8;
  return w;
}

// A block's (sequence, head), the sequence's part of this launch's window of
// chunk slots and the ring of stages that its chunks pass through. The
// sequence's state comes from initial_state in the window where it starts and
// goes to final_state in the window where it ends; in between it waits in the
// carry.
// The step's counters are 32-bit (a part has fewer than 2^31 chunks: the host
// bounds the slots) and its addresses advance from step to step: 64-bit
// c % kSt, c * stride and token arithmetic cost ~30 instructions a step, which
// the split shapes' single warp per scheduler pays in full.
template <class Cfg, bool kQw>
struct Block {
  using St = typename Cfg::St;
  static constexpr int D = Cfg::kD;
  const FwdParams& p;
  St* stages;
  int64_t H, h, n;
  int vcol0, v0;     // the block's first value channel; the row group's first value row
  WindowPart part;
  int64_t part_bos;  // the part's first token
  int nch, last_len; // the part's chunks (all full but the last) and the last one's tokens
  // The ring: the next chunk to stage, its stage, its record and v rows.
  int fill = 0, fill_stage = 0;
  const unsigned char* fill_rec;
  const __nv_bfloat16* fill_v;
  int64_t stride;  // from one chunk's record to the next

  __device__ __forceinline__ Block(const FwdParams& params, St* st, const Lanes& w) : p(params), stages(st) {
    constexpr int kGroups = D / Cfg::kCols;
    H = p.H;
    const int group = blockIdx.x % kGroups;
    h = (blockIdx.x / kGroups) % H;
    n = sequence_of_block_group(p, blockIdx.x / (kGroups * H));
    vcol0 = group * Cfg::kCols;
    v0 = vcol0 + w.vloc;
    const int64_t seq_bos = seq_offset(p, n), seq_eos = seq_offset(p, n + 1);
    part = window_part(p, n);
    const int64_t lo = part.lo;
    stride = H * St::R::kBytes;
    fill_rec = reinterpret_cast<const unsigned char*>(p.workspace) + ((lo - p.slot_begin) * H + h) * St::R::kBytes;
    part_bos = seq_bos + (lo - part.c_begin) * C;
    nch = static_cast<int>(part.chunks());
    last_len = nch > 0 ? static_cast<int>(min64(C, seq_eos - (part_bos + int64_t{nch - 1} * C))) : 0;
    fill_v = p.v != nullptr ? static_cast<const __nv_bfloat16*>(p.v) + (part_bos * H + h) * D + vcol0 : nullptr;
  }

  // Nothing of this sequence in this window: the whole block returns.
  __device__ __forceinline__ bool idle() const { return nch == 0 && !part.starts_here; }

  // Chunk `fill` goes into stage fill % kSt.
  __device__ __forceinline__ void refill(int tid) {
    load_stage<Cfg::kThreads, kQw>(stages[fill_stage], fill_rec, fill_v, H * D, fill == nch - 1 ? last_len : C, tid);
    fill_rec += stride;
    fill_v = fill_v != nullptr ? fill_v + C * H * D : nullptr;
    ++fill;
    fill_stage = fill_stage + 1 == Cfg::kSt ? 0 : fill_stage + 1;
  }

  // The first kSt - 1 chunks, before the first step.
  __device__ __forceinline__ void start_ring(int tid) {
#pragma unroll
    for (int s = 0; s < Cfg::kSt - 1; ++s) {
      if (s < nch) {
        refill(tid);
      }
      cp_async_commit();
    }
  }

  // A step's copies: the next chunk's, if any, as one commit group.
  __device__ __forceinline__ void refill_next(int tid) {
    if (fill < nch) {
      refill(tid);
    }
    cp_async_commit();
  }

  // s[j][e]: state rows v0 + g (e = 0, 1) and v0 + g + 8 (e = 2, 3), key
  // columns 8(j0 + j) + 2t (e even) and + 1 (e odd); [n, h, v, k] layout.
  __device__ __forceinline__ int64_t state_row(const Lanes& w) const { return ((n * H + h) * D + v0 + w.g) * D; }

  __device__ __forceinline__ void load_state(const Lanes& w, float (&s)[Cfg::kNt][4]) const {
    const int64_t row_g = state_row(w), row_g8 = row_g + 8 * D;
    const void* state_in = part.starts_here ? p.initial_state : p.carry;
    const bool in_fp32 = part.starts_here ? p.state_fp32 : true;
#pragma unroll
    for (int j = 0; j < Cfg::kNt; ++j) {
      const int k0 = 8 * (w.j0 + j) + 2 * w.t;
      if (state_in != nullptr) {
        load_state_pair(state_in, row_g + k0, in_fp32, s[j][0], s[j][1]);
        load_state_pair(state_in, row_g8 + k0, in_fp32, s[j][2], s[j][3]);
      } else {
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      }
    }
  }

  __device__ __forceinline__ void store_state(const Lanes& w, const float (&s)[Cfg::kNt][4]) const {
    const int64_t row_g = state_row(w), row_g8 = row_g + 8 * D;
    void* state_out = part.ends_here ? p.final_state : p.carry;
    const bool out_fp32 = part.ends_here ? p.state_fp32 : true;
    if (state_out != nullptr) {
#pragma unroll
      for (int j = 0; j < Cfg::kNt; ++j) {
        const int k0 = 8 * (w.j0 + j) + 2 * w.t;
        store_state_pair(state_out, row_g + k0, out_fp32, s[j][0], s[j][1]);
        store_state_pair(state_out, row_g8 + k0, out_fp32, s[j][2], s[j][3]);
      }
    }
  }

  // For the backward (its passes, or the forward of kda._fwd_checkpointed):
  // the state at chunk c's start, bf16, two n-tiles per 8-byte store
  // (quad_piece), so that a quad writes whole 32-byte sectors.
  __device__ __forceinline__ void store_chunk_start(const Lanes& w, int c, const float (&s)[Cfg::kNt][4]) const {
    if (p.chunk_states != nullptr) {
      __nv_bfloat16* cs = static_cast<__nv_bfloat16*>(p.chunk_states) +
                          (((part.lo + c - p.slot_begin) * H + h) * D + v0 + w.g) * D + 8 * w.j0 +
                          quad_piece_column(w.t);
#pragma unroll
      for (int jj = 0; jj < Cfg::kNt / 2; ++jj) {
        store_tile_pair_bf16<false>(cs + 16 * jj, D, s[2 * jj], s[2 * jj + 1], w.t & 1);
      }
    }
  }
};

// The state as the A operand of a step's products: k-step kk (n-tiles 2kk and
// 2kk + 1) split into bf16 hi and lo (kX3), or rounded to bf16.
template <bool kX3, int kNt>
__device__ __forceinline__ void split_state(const float (&s)[kNt][4], int kk, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
  if constexpr (kX3) {
    split_pack(s[2 * kk][0], s[2 * kk][1], hi[0], lo[0]);
    split_pack(s[2 * kk][2], s[2 * kk][3], hi[1], lo[1]);
    split_pack(s[2 * kk + 1][0], s[2 * kk + 1][1], hi[2], lo[2]);
    split_pack(s[2 * kk + 1][2], s[2 * kk + 1][3], hi[3], lo[3]);
  } else {
    hi[0] = pack_bf16x2_rn(s[2 * kk][0], s[2 * kk][1]);
    hi[1] = pack_bf16x2_rn(s[2 * kk][2], s[2 * kk][3]);
    hi[2] = pack_bf16x2_rn(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    hi[3] = pack_bf16x2_rn(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

// U^T as the A operand of the output's and the update's products: its two
// n-tiles are the 16 tokens.
template <bool kX3>
__device__ __forceinline__ void split_u(const float (&u)[2][4], uint32_t (&hi)[4], uint32_t (&lo)[4]) {
  if constexpr (kX3) {
    split_pack(u[0][0], u[0][1], hi[0], lo[0]);
    split_pack(u[0][2], u[0][3], hi[1], lo[1]);
    split_pack(u[1][0], u[1][1], hi[2], lo[2]);
    split_pack(u[1][2], u[1][3], hi[3], lo[3]);
  } else {
    hi[0] = pack_bf16x2_rn(u[0][0], u[0][1]);
    hi[1] = pack_bf16x2_rn(u[0][2], u[0][3]);
    hi[2] = pack_bf16x2_rn(u[1][0], u[1][1]);
    hi[3] = pack_bf16x2_rn(u[1][2], u[1][3]);
  }
}

// S W^T (sw) and S Qs^T (so) from their terms' accumulators, the small terms
// first, as mma_bf16x3 sums them.
template <bool kOut, bool kX3, bool kQsLo>
__device__ __forceinline__ void sum_terms(const float (&acc_w)[3][2][4], const float (&acc_o)[2][2][4],
                                          float (&sw)[2][4], float (&so)[2][4]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sw[nt][e] = kX3 ? (acc_w[0][nt][e] + acc_w[1][nt][e]) + acc_w[2][nt][e] : acc_w[2][nt][e];
      so[nt][e] = !kOut ? 0.f : kQsLo ? acc_o[0][nt][e] + acc_o[1][nt][e] : acc_o[1][nt][e];
    }
  }
}

// U0^T = v^T M^T for the row group's 16 rows (M as Aqk below).
template <class St>
__device__ __forceinline__ void form_u0(const St& st, const Lanes& w, float (&dst)[2][4]) {
  const int row = (w.mi / 2) * 8 + w.mr, col = (w.mi % 2) * 8;
  form_u0_tiles(&st.v[row][w.vloc + col], &st.m[0][row * C + col], &st.m[1][row * C + col], dst);
}

// Kd's fragments of key columns 8(j0 + 2jj).. (the update's B operand):
// ldmatrix.trans turns Kd's rows (tokens) into the k dimension.
template <bool kX3, class St>
__device__ __forceinline__ void load_kd(const St& st, const Lanes& w, int jj, uint32_t (&kh)[4], uint32_t (&kl)[4]) {
  // Matrices: tokens 0-7 | 8-15 (k dimension) x key columns 8(j0+2jj).. | +8.. (n-tiles)
  const int row = (w.mi % 2) * 8 + w.mr, piece = w.j0 + 2 * jj + w.mi / 2;
  ldmatrix_x4_trans(kh, record_piece(st.mat[kKdHiPlane<kX3>], row, piece));
  if constexpr (kX3) {
    ldmatrix_x4_trans(kl, record_piece(st.mat[kKdLo], row, piece));
  }
}

// ---------------------------------------------------------------------------
// The 4x1w warpgroup: per k-step (16 keys) the warps' A fragments of the state
// and the planes' k-step as B, K-major, in half kk / 4 of each plane at byte
// 32 (kk % 4) of its 128-byte rows (params.h).
// kQw (bf16 products): Qs's and W's hi planes interleaved (load_stage), so
// that one n = 32 product takes both of a k-step, half the instructions.
template <bool kOut, bool kX3, class St, int kSteps>
__device__ __forceinline__ void wgmma_issue_products(const St& st, const uint32_t (&a_hi)[kSteps][4],
                                                     const uint32_t (&a_lo)[kSteps][4], float (&acc_w)[3][2][4],
                                                     float (&acc_o)[2][2][4], float (&acc_qw)[4][4]) {
  constexpr bool kQw = !kX3;
  constexpr int kPlaneBytes = St::R::kPlaneBytes;
  const Sw128Desc k_major = sw128_desc(smem_u32(&st.mat[0][0]), 16, 1024);
  auto b_desc = [&](int plane, int kk) {
    return sw128_desc_at(k_major, plane * kPlaneBytes + (kk / 4) * (C * 128) + (kk % 4) * 32);
  };
  // kQw: k-step kk of [Qs; W] at half kk / 4 of the interleaved planes, each
  // half a pair of 64-column blocks (load_stage).
  constexpr int kBlockPairBytes = 2 * C * 128;
  auto qw_desc = [&](int rows, int kk) {
    return sw128_desc_at(k_major, (kk / 4) * kBlockPairBytes + rows * 128 + (kk % 4) * 32);
  };
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    if constexpr (kQw && kOut) {
      wgmma_m64n32k16(acc_qw, a_hi[kk], qw_desc(0, kk), kk > 0);
    } else if constexpr (kQw) {
      wgmma_m64n16k16(acc_w[2], a_hi[kk], qw_desc(C, kk), kk > 0);
    } else {
      wgmma_m64n16k16(acc_w[0], a_lo[kk], b_desc(kWHi, kk), kk > 0);
      wgmma_m64n16k16(acc_w[1], a_hi[kk], b_desc(kWLo, kk), kk > 0);
      wgmma_m64n16k16(acc_w[2], a_hi[kk], b_desc(kWHi, kk), kk > 0);
      if constexpr (kOut) {
        wgmma_m64n16k16(acc_o[1], a_hi[kk], b_desc(kQs, kk), kk > 0);
      }
    }
  }
  wgmma_commit();
}

// Waits for wgmma_issue_products and takes its accumulators.
template <bool kOut, bool kX3>
__device__ __forceinline__ void wgmma_collect_products(float (&acc_w)[3][2][4], float (&acc_o)[2][2][4],
                                                       float (&acc_qw)[4][4]) {
  constexpr bool kQw = !kX3;
  wgmma_wait<0>();
  if constexpr (kQw && kOut) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        fence_operand(acc_qw[nt][e]);
        fence_operand(acc_qw[2 + nt][e]);
        acc_o[1][nt][e] = acc_qw[nt][e];
        acc_w[2][nt][e] = acc_qw[2 + nt][e];
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (kX3) {
        fence_operand(acc_w[0][nt][e]);
        fence_operand(acc_w[1][nt][e]);
      }
      fence_operand(acc_w[2][nt][e]);
      if constexpr (kOut) {
        fence_operand(acc_o[1][nt][e]);
      }
    }
  }
}

// S <- S diag(gl) + U^T Kd for the warpgroup's 64 rows and all 128 keys: Kd
// (k = the 16 tokens, n = the keys) MN-major, its two 64-key halves LBO apart,
// its two 8-token row groups SBO apart.
template <bool kX3, class St>
__device__ __forceinline__ void wgmma_update_state(const St& st, const Lanes& w, const uint32_t (&ua_hi)[4],
                                                   const uint32_t (&ua_lo)[4], float (&s)[16][4]) {
  static_assert(St::kD == 128, "the update is one m64n128 product a term: another size takes its own n");
  constexpr int kPlaneBytes = St::R::kPlaneBytes;
  const Sw128Desc mn_major = sw128_desc(smem_u32(&st.mat[0][0]), C * 128, 1024);
  const uint64_t kd_hi = sw128_desc_at(mn_major, kKdHiPlane<kX3> * kPlaneBytes);
  float upd[16][4];
  wgmma_fence();
  if constexpr (kX3) {
    const uint64_t kd_lo = sw128_desc_at(mn_major, kKdLo * kPlaneBytes);
    wgmma_m64n128k16_mn(upd, ua_lo, kd_hi, false);
    wgmma_m64n128k16_mn(upd, ua_hi, kd_lo, true);
  }
  wgmma_m64n128k16_mn(upd, ua_hi, kd_hi, kX3);
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      fence_operand(upd[j][e]);
    }
    const float2 decay = *reinterpret_cast<const float2*>(&st.gl[8 * j + 2 * w.t]);
    s[j][0] = fmaf(s[j][0], decay.x, upd[j][0]);
    s[j][1] = fmaf(s[j][1], decay.y, upd[j][1]);
    s[j][2] = fmaf(s[j][2], decay.x, upd[j][2]);
    s[j][3] = fmaf(s[j][3], decay.y, upd[j][3]);
  }
}

// O^T = S Qs^T + U^T Aqk^T for a full-width warp's 16 rows (Aqk stored [i][j]
// is Aqk^T's B fragment as it stands); out leaves through the row group's
// tile in 16-byte stores, lane l token l / 2, half l % 2 of the 16 values.
template <bool kX3, class St>
__device__ __forceinline__ void write_out_full(const St& st, __nv_bfloat16 (&tile)[C][kOutPad], const Lanes& w,
                                               const uint32_t (&ua_hi)[4], const uint32_t (&ua_lo)[4],
                                               float (&so)[2][4], __nv_bfloat16* out_chunk, int len) {
  const int row = (w.mi / 2) * 8 + w.mr, col = (w.mi % 2) * 8;
  uint32_t ah[4];
  ldmatrix_x4(ah, &st.aqk[row * C + col]);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    if constexpr (kX3) {
      mma_bf16(so[nt], ua_lo, ah[2 * nt], ah[2 * nt + 1]);
    }
    mma_bf16(so[nt], ua_hi, ah[2 * nt], ah[2 * nt + 1]);
    const int i0 = 8 * nt + 2 * w.t;
    tile[i0][w.g] = __float2bfloat16_rn(so[nt][0]);
    tile[i0 + 1][w.g] = __float2bfloat16_rn(so[nt][1]);
    tile[i0][w.g + 8] = __float2bfloat16_rn(so[nt][2]);
    tile[i0 + 1][w.g + 8] = __float2bfloat16_rn(so[nt][3]);
  }
  __syncwarp();
  const int i = w.lane / 2, half = w.lane % 2;
  if (i < len) {
    *reinterpret_cast<uint4*>(out_chunk) = *reinterpret_cast<const uint4*>(&tile[i][8 * half]);
  }
}

// kOut: the forward, which writes out. Without it (the backward's passes) only
// the states move, and the state at each chunk's start is stored where
// p.chunk_states says.
// kLate: each step's copies issued after its first products instead of right
// after the barrier, where the blocks fill every SM three times over
// (heuristics.cpp): the steps then wait on DRAM's throughput and the later
// copies spread out.
template <int D, bool kOut, bool kX3, bool kLate>
__device__ __forceinline__ void wgmma_body(const FwdParams& p) {
  using Cfg = Config<D, 1, kX3>;
  constexpr int kSteps = D / 16;
  using St = typename Cfg::St;
  static_assert(!kLate || kOut, "the later copies serve the forward");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw;
  smem += (1024u - (smem_u32(smem_raw) & 1023u)) & 1023u;  // the stages 1024-byte aligned (kSmem has the slack)
  St* stages = reinterpret_cast<St*>(smem);
  auto* out_tile = reinterpret_cast<__nv_bfloat16(*)[C][kOutPad]>(smem + Cfg::kSt * sizeof(St));

  const Lanes w = lanes_of_thread<D, 1, -1>();
  Block<Cfg, !kX3> b(p, stages, w);
  if (b.idle()) {
    return;
  }
  b.start_ring(w.tid);
  float s[Cfg::kNt][4];
  b.load_state(w, s);
  // The state's A fragments, each k-step split as soon as the update has
  // written it: its dependent instructions then fill the gaps between the
  // update's products instead of standing between the next step's.
  uint32_t a_hi[kSteps][4], a_lo[kSteps][4];
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    split_state<kX3>(s, kk, a_hi[kk], a_lo[kk]);
  }
  __nv_bfloat16* out_chunk =
      kOut ? static_cast<__nv_bfloat16*>(p.out) + ((b.part_bos + w.lane / 2) * b.H + b.h) * D + b.v0 + 8 * (w.lane % 2)
           : nullptr;
  int stage = 0;  // c % kSt
  for (int c = 0; c < b.nch; ++c) {
    // One barrier a step: it shows chunk c's stage to every warp and tells that
    // every warp has left step c - 1, whose stage (the one refilled next) and
    // out tile entries are then free (each warp reads back only what it wrote).
    cp_async_wait<Cfg::kSt - 2>();
    __syncthreads();
    if constexpr (!kLate) {
      b.refill_next(w.tid);
    }
    b.store_chunk_start(w, c, s);
    const St& st = stages[stage];
    stage = stage + 1 == Cfg::kSt ? 0 : stage + 1;

    // S W^T and S Qs^T; U0's mma.sync products run while they do.
    float acc_w[3][2][4], acc_o[2][2][4], acc_qw[4][4], u0[2][4];
    wgmma_issue_products<kOut, kX3>(st, a_hi, a_lo, acc_w, acc_o, acc_qw);
    form_u0(st, w, u0);
    if constexpr (kLate) {
      b.refill_next(w.tid);
    }
    wgmma_collect_products<kOut, kX3>(acc_w, acc_o, acc_qw);
    float sw[2][4], so[2][4];
    sum_terms<kOut, kX3, false>(acc_w, acc_o, sw, so);

    float u[2][4];  // U^T = U0^T - S W^T
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        u[nt][e] = u0[nt][e] - sw[nt][e];
      }
    }
    uint32_t ua_hi[4], ua_lo[4];
    split_u<kX3>(u, ua_hi, ua_lo);
    if constexpr (kOut) {
      write_out_full<kX3>(st, out_tile[w.rg], w, ua_hi, ua_lo, so, out_chunk, c == b.nch - 1 ? b.last_len : C);
    }
    wgmma_update_state<kX3>(st, w, ua_hi, ua_lo, s);
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      split_state<kX3>(s, kk, a_hi[kk], a_lo[kk]);
    }
    if constexpr (kOut) {
      out_chunk += C * b.H * D;
    }
  }
  b.store_state(w, s);
}

// ---------------------------------------------------------------------------
// The split shapes (2x2, 4x4, 8x4, 16x4): each warp takes D / kSplit key
// columns of one row group, on mma.sync.
// kKs: with four split warps, the warp's key slice within its row group, a
// constant in each warp's code (recurrence_kernel runs one copy of the body
// per slice), so that what depends on the slice (which partial sum is the
// warp's own, which n-tile of U0 and which quarter of out it takes) costs no
// select of its own; -1 with two (the slice from the warp index: the 2x2
// runs slower specialised).
// kQsLo: S Qs^T with the state's lo part too (the 2x2 with bf16x3, which runs
// slower without it); elsewhere its hi part alone, as the output is rounded to
// bf16.
template <int kSplit, int kKs>
constexpr int kOwn4 = kSplit == 4 ? kKs / 2 : 0;  // four split warps: the warp's n-tile of U0

// S W^T and S Qs^T over the warp's key columns, 16 at a time, each term of the
// split products in its own accumulators so that consecutive mmas rarely wait
// on each other. The state's A fragments are split at the step's start (the
// few k-steps of a split warp would lengthen the step's chain before the
// barrier if split behind the update). Each k-step's fragments are loaded
// before the previous one's products: the asm statements keep source order,
// and a load right before its products leaves each k-step waiting on shared
// memory.
// acc_w[2] (the hi * hi terms of S W^T) starts from a share of -U0^T, so that
// the row group's partial sums add up to -U^T: each warp forms a part of U0
// (four warps: one n-tile and one of M's planes each; two: both n-tiles with
// plane ks) at the step's start, beside the other products, off the step's
// chain.
template <int kSplit, int kKs, bool kOut, bool kX3, class St, int kNt>
__device__ __forceinline__ void split_products(const St& st, const Lanes& w, const float (&s)[kNt][4],
                                               uint32_t (&a_hi)[kNt / 2][4], uint32_t (&a_lo)[kNt / 2][4],
                                               float (&acc_w)[3][2][4], float (&acc_o)[2][2][4]) {
  constexpr int kKk = kNt / 2;
  constexpr bool kQsLo = kSplit == 2 && kX3;
  constexpr int own4 = kOwn4<kSplit, kKs>;
  uint32_t wh[2][4], wl[2][4], qh[2][4];
  auto load_wq = [&](int kk, int b) {
    // Matrices: tokens 0-7 | 8-15 (n-tiles) x key columns 16K.. | 16K+8.. (K = j0 / 2 + kk)
    const int row = (w.mi / 2) * 8 + w.mr, piece = w.j0 + 2 * kk + w.mi % 2;
    ldmatrix_x4(wh[b], record_piece(st.mat[kWHi], row, piece));
    if constexpr (kX3) {
      ldmatrix_x4(wl[b], record_piece(st.mat[kWLo], row, piece));
    }
    if constexpr (kOut) {
      ldmatrix_x4(qh[b], record_piece(st.mat[kQs], row, piece));
    }
  };
  load_wq(0, 0);
  {
    // -v^T, the row group's 16 rows x the 16 tokens, as an A operand:
    // ldmatrix.trans turns v's rows (tokens) into the k dimension (v is exact in bf16).
    uint32_t va[4];
    ldmatrix_x4_trans(va, &st.v[(w.mi / 2) * 8 + w.mr][w.vloc + (w.mi % 2) * 8]);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      va[r] ^= 0x80008000u;  // -v (exact)
    }
    if constexpr (kSplit == 4) {
      const int mrow = (own4 * 8 + w.mr) * C + ((w.lane / 8) % 2) * 8;  // B fragment of n-tile own4
      uint32_t mb[2];
      ldmatrix_x2(mb, &st.m[kKs % 2][mrow]);
      mma_bf16_zero(acc_w[2][own4], va, mb[0], mb[1]);
    } else {
      uint32_t mb[4];
      ldmatrix_x4(mb, &st.m[w.ks][((w.mi / 2) * 8 + w.mr) * C + (w.mi % 2) * 8]);
      mma_bf16_zero(acc_w[2][0], va, mb[0], mb[1]);
      mma_bf16_zero(acc_w[2][1], va, mb[2], mb[3]);
    }
  }
#pragma unroll
  for (int kk = 0; kk < kKk; ++kk) {
    const int b = kk % 2;
    if (kk + 1 < kKk) {
      load_wq(kk + 1, 1 - b);
    }
    split_state<kX3>(s, kk, a_hi[kk], a_lo[kk]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      if constexpr (kX3) {
        mma_bf16_into(acc_w[0][nt], a_lo[kk], wh[b][2 * nt], wh[b][2 * nt + 1], kk == 0);
        mma_bf16_into(acc_w[1][nt], a_hi[kk], wl[b][2 * nt], wl[b][2 * nt + 1], kk == 0);
      }
      // acc_w[2] starts from U0's share where the warp took one (above).
      const bool zero_w2 = kSplit == 4 && kk == 0 && nt != own4;
      mma_bf16_into(acc_w[2][nt], a_hi[kk], wh[b][2 * nt], wh[b][2 * nt + 1], zero_w2);
      if constexpr (kOut && kQsLo) {
        mma_bf16_into(acc_o[0][nt], a_lo[kk], qh[b][2 * nt], qh[b][2 * nt + 1], kk == 0);
      }
      if constexpr (kOut) {
        mma_bf16_into(acc_o[1][nt], a_hi[kk], qh[b][2 * nt], qh[b][2 * nt + 1], kk == 0);
      }
    }
  }
}

// The row group's warps add their partial sums: every warp needs all of
// S W^T (for U), the warps that write out need their n-tile of S Qs^T (four
// split warps: their quarter). A lane's four values of an n-tile travel as
// one 16-byte vector (lanes 16 bytes apart: no bank conflicts; the four split
// warps' S Qs^T as two planes of 8-byte halves, which the quarters read 8
// contiguous bytes a lane), a warp's own part stays in its registers, and the
// parts are added in warp order (deterministic; two as own + other, the same
// bits, as IEEE addition commutes).
// o_own (two split warps): the warp's n-tile ks of S Qs^T, both parts added.
template <class Cfg, int kKs, bool kOut>
__device__ __forceinline__ void add_partial_sums(float* red, const Lanes& w, float (&sw)[2][4], float (&so)[2][4],
                                                 float (&o_own)[4]) {
  constexpr int kSplit = Cfg::kSplit;
  float4* mine = reinterpret_cast<float4*>(red) + w.warp * (Cfg::kRedFloats / 4);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    mine[(0 * 2 + nt) * 32 + w.lane] = make_float4(sw[nt][0], sw[nt][1], sw[nt][2], sw[nt][3]);
    if constexpr (kOut) {
      if constexpr (kSplit == 4) {
        float2* mine2 = reinterpret_cast<float2*>(mine) + (1 * 2 + nt) * 64 + w.lane;
        mine2[0] = make_float2(so[nt][0], so[nt][1]);
        mine2[32] = make_float2(so[nt][2], so[nt][3]);
      } else {
        mine[(1 * 2 + nt) * 32 + w.lane] = make_float4(so[nt][0], so[nt][1], so[nt][2], so[nt][3]);
      }
    }
  }
  __syncthreads();
  const float4* group_red = reinterpret_cast<const float4*>(red) + w.rg * kSplit * (Cfg::kRedFloats / 4);
  if constexpr (kSplit == 2) {
    const float4* other = group_red + (w.ks ^ 1) * (Cfg::kRedFloats / 4);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float4 x = other[nt * 32 + w.lane];
      sw[nt][0] += x.x, sw[nt][1] += x.y, sw[nt][2] += x.z, sw[nt][3] += x.w;
    }
    if constexpr (kOut) {
      const float4 y = other[(2 + w.ks) * 32 + w.lane];
      const float yv[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        o_own[e] = (w.ks == 1 ? so[1][e] : so[0][e]) + yv[e];
      }
    }
  } else {
    auto part = [&](int wp, int nt, const float (&own)[4]) {
      return wp == w.ks ? make_float4(own[0], own[1], own[2], own[3])
                        : group_red[wp * (Cfg::kRedFloats / 4) + nt * 32 + w.lane];
    };
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float4 w_sum = part(0, nt, sw[nt]);
#pragma unroll
      for (int wp = 1; wp < kSplit; ++wp) {
        const float4 x = part(wp, nt, sw[nt]);
        w_sum = make_float4(w_sum.x + x.x, w_sum.y + x.y, w_sum.z + x.z, w_sum.w + x.w);
      }
      sw[nt][0] = w_sum.x, sw[nt][1] = w_sum.y, sw[nt][2] = w_sum.z, sw[nt][3] = w_sum.w;
    }
    if constexpr (kOut) {
      // The warp's quarter of out: n-tile ks / 2, value rows g + 8 (ks % 2),
      // the fragment's elements 2 (ks % 2) and + 1.
      constexpr int nto = kKs / 2, r = kKs % 2;
      const float2* red2 = reinterpret_cast<const float2*>(group_red);
      auto quarter = [&](int wp) {
        return wp == w.ks ? make_float2(so[nto][2 * r], so[nto][2 * r + 1])
                          : red2[wp * (Cfg::kRedFloats / 2) + (1 * 2 + nto) * 64 + r * 32 + w.lane];
      };
      float2 q = quarter(0);
#pragma unroll
      for (int wp = 1; wp < kSplit; ++wp) {
        const float2 x = quarter(wp);
        q = make_float2(q.x + x.x, q.y + x.y);
      }
      so[nto][2 * r] = q.x, so[nto][2 * r + 1] = q.y;
    }
  }
}

// S <- S diag(gl) + U^T Kd over the warp's key columns; kh, kl hold k-step 0's
// fragments on entry (loaded ahead of the partial sums' barrier).
template <bool kX3, class St, int kNt>
__device__ __forceinline__ void split_update_state(const St& st, const Lanes& w, const uint32_t (&ua_hi)[4],
                                                   const uint32_t (&ua_lo)[4], uint32_t (&kh)[2][4],
                                                   uint32_t (&kl)[2][4], float (&s)[kNt][4]) {
#pragma unroll
  for (int jj = 0; jj < kNt / 2; ++jj) {
    const int b = jj % 2;
    if (jj + 1 < kNt / 2) {
      load_kd<kX3>(st, w, jj + 1, kh[1 - b], kl[1 - b]);
    }
    float upd[2][4];
    if constexpr (kX3) {
      mma_bf16x3_zero(upd[0], ua_hi, ua_lo, kh[b][0], kh[b][1], kl[b][0], kl[b][1]);
      mma_bf16x3_zero(upd[1], ua_hi, ua_lo, kh[b][2], kh[b][3], kl[b][2], kl[b][3]);
    } else {
      mma_bf16_zero(upd[0], ua_hi, kh[b][0], kh[b][1]);
      mma_bf16_zero(upd[1], ua_hi, kh[b][2], kh[b][3]);
    }
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int j = 2 * jj + h2;
      const float2 decay = *reinterpret_cast<const float2*>(&st.gl[8 * (w.j0 + j) + 2 * w.t]);
      s[j][0] = fmaf(s[j][0], decay.x, upd[h2][0]);
      s[j][1] = fmaf(s[j][1], decay.y, upd[h2][1]);
      s[j][2] = fmaf(s[j][2], decay.x, upd[h2][2]);
      s[j][3] = fmaf(s[j][3], decay.y, upd[h2][3]);
    }
  }
}

// O^T += U^T Aqk^T for a split warp's part of out, taken after the state
// update's products, which then start the step's last stretch without waiting
// behind the output's: two split warps one n-tile each (so: o_own), four a
// quarter each (n-tile ks / 2, value rows g + 8 (ks % 2)).
template <int kSplit, int kKs, bool kX3, class St>
__device__ __forceinline__ void write_out_split(const St& st, __nv_bfloat16 (&tile)[C][kOutPad], const Lanes& w,
                                                const uint32_t (&ua_hi)[4], const uint32_t (&ua_lo)[4],
                                                float (&so)[2][4], float (&o_own)[4], __nv_bfloat16* out_chunk,
                                                int len) {
  const int row = (w.mi / 2) * 8 + w.mr, col = (w.mi % 2) * 8;
  uint32_t ah[4];
  ldmatrix_x4(ah, &st.aqk[row * C + col]);
  if constexpr (kSplit == 4) {
    constexpr int nto = kKs / 2, r = kKs % 2;
    if constexpr (kX3) {
      mma_bf16(so[nto], ua_lo, ah[2 * nto], ah[2 * nto + 1]);
    }
    mma_bf16(so[nto], ua_hi, ah[2 * nto], ah[2 * nto + 1]);
    const int i0 = 8 * nto + 2 * w.t;
    tile[i0][w.g + 8 * r] = __float2bfloat16_rn(so[nto][2 * r]);
    tile[i0 + 1][w.g + 8 * r] = __float2bfloat16_rn(so[nto][2 * r + 1]);
    __syncwarp();
    // Lanes 0-7: token 8 nto + lane, the quarter's 8 values (out_chunk).
    if (w.lane < 8 && 8 * nto + w.lane < len) {
      *reinterpret_cast<uint4*>(out_chunk) = *reinterpret_cast<const uint4*>(&tile[8 * nto + w.lane][8 * r]);
    }
  } else {
    const bool second = w.ks % 2 == 1;  // the warp's n-tile: ks % 2
    float (&o)[4] = o_own;
    const uint32_t b0 = second ? ah[2] : ah[0], b1 = second ? ah[3] : ah[1];
    if constexpr (kX3) {
      mma_bf16(o, ua_lo, b0, b1);
    }
    mma_bf16(o, ua_hi, b0, b1);
    if (w.ks < 2) {
      const int i0 = 8 * (w.ks % 2) + 2 * w.t;
      tile[i0][w.g] = __float2bfloat16_rn(o[0]);
      tile[i0 + 1][w.g] = __float2bfloat16_rn(o[1]);
      tile[i0][w.g + 8] = __float2bfloat16_rn(o[2]);
      tile[i0 + 1][w.g + 8] = __float2bfloat16_rn(o[3]);
    }
    __syncwarp();
    const int i = w.lane / 2, half = w.lane % 2;  // token row i and half of the 16 values
    if ((i / 8) % kSplit == w.ks && i < len) {
      *reinterpret_cast<uint4*>(out_chunk) = *reinterpret_cast<const uint4*>(&tile[i][8 * half]);
    }
  }
}

template <int D, int kSplit, int kWarps, int kKs, bool kOut, bool kX3>
__device__ __forceinline__ void split_body(const FwdParams& p) {
  using Cfg = Config<D, kSplit, kX3, kWarps>;
  using St = typename Cfg::St;
  constexpr int kNt = Cfg::kNt;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  St* stages = reinterpret_cast<St*>(smem_raw);
  auto* out_tile = reinterpret_cast<__nv_bfloat16(*)[C][kOutPad]>(smem_raw + Cfg::kSt * sizeof(St));
  float* red = reinterpret_cast<float*>(smem_raw + Cfg::kSt * sizeof(St) + Cfg::kRowGroups * sizeof(*out_tile));

  const Lanes w = lanes_of_thread<D, kSplit, kKs>();
  Block<Cfg, false> b(p, stages, w);
  if (b.idle()) {
    return;
  }
  b.start_ring(w.tid);
  float s[kNt][4];
  b.load_state(w, s);
  uint32_t a_hi[kNt / 2][4], a_lo[kNt / 2][4];
  // Lane l writes token row l / 2 of a chunk's out, half l % 2 of the row group's
  // 16 values; with four split warps, lane l < 8 token 8 (ks / 2) + l, half ks % 2.
  const int out_token = kSplit == 4 ? 8 * kOwn4<kSplit, kKs> + w.lane % 8 : w.lane / 2;
  const int out_half = kSplit == 4 ? kKs % 2 : w.lane % 2;
  __nv_bfloat16* out_chunk =
      kOut ? static_cast<__nv_bfloat16*>(p.out) + ((b.part_bos + out_token) * b.H + b.h) * D + b.v0 + 8 * out_half
           : nullptr;
  int stage = 0;  // c % kSt
  for (int c = 0; c < b.nch; ++c) {
    // One barrier a step, as in wgmma_body (the partial sums of step c - 1 are
    // free after it too).
    cp_async_wait<Cfg::kSt - 2>();
    __syncthreads();
    b.refill_next(w.tid);
    b.store_chunk_start(w, c, s);
    const St& st = stages[stage];
    stage = stage + 1 == Cfg::kSt ? 0 : stage + 1;

    float acc_w[3][2][4], acc_o[2][2][4];  // written first by the kk = 0 products (but see acc_w[2])
    split_products<kSplit, kKs, kOut, kX3>(st, w, s, a_hi, a_lo, acc_w, acc_o);
    uint32_t kh[2][4], kl[2][4];
    load_kd<kX3>(st, w, 0, kh[0], kl[0]);  // ahead of the partial sums' barrier
    float sw[2][4], so[2][4], o_own[4];
    sum_terms<kOut, kX3, kSplit == 2 && kX3>(acc_w, acc_o, sw, so);
    add_partial_sums<Cfg, kKs, kOut>(red, w, sw, so, o_own);

    float u[2][4];  // U^T = -(the partial sums, which started from -U0^T)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        u[nt][e] = -sw[nt][e];
      }
    }
    uint32_t ua_hi[4], ua_lo[4];
    split_u<kX3>(u, ua_hi, ua_lo);
    split_update_state<kX3>(st, w, ua_hi, ua_lo, kh, kl, s);
    if constexpr (kOut) {
      write_out_split<kSplit, kKs, kX3>(st, out_tile[w.rg], w, ua_hi, ua_lo, so, o_own, out_chunk,
                                         c == b.nch - 1 ? b.last_len : C);
      out_chunk += C * b.H * D;
    }
  }
  b.store_state(w, s);
}

template <int D, int kSplit, int kWarps, bool kOut, bool kX3, bool kLate>
__global__ void __launch_bounds__(Config<D, kSplit, kX3, kWarps>::kThreads) recurrence_kernel(const FwdParams p) {
  if constexpr (kSplit == 1) {
    wgmma_body<D, kOut, kX3, kLate>(p);
  } else if constexpr (kSplit == 2) {
    split_body<D, 2, kWarps, -1, kOut, kX3>(p);
  } else {
    // The branch is uniform per warp, not per block: it relies on bar.sync
    // counting warps, and every copy meets the same barriers in the same order
    // (one per step, and the partial sums').
    switch ((threadIdx.x / 32) % 4) {
      case 0:
        split_body<D, 4, kWarps, 0, kOut, kX3>(p);
        break;
      case 1:
        split_body<D, 4, kWarps, 1, kOut, kX3>(p);
        break;
      case 2:
        split_body<D, 4, kWarps, 2, kOut, kX3>(p);
        break;
      default:
        split_body<D, 4, kWarps, 3, kOut, kX3>(p);
        break;
    }
  }
}

template <int D, int kSplit, int kWarps, bool kOut, bool kX3, bool kLate>
void launch_kernel(const FwdParams& p, cudaStream_t stream) {
  using Cfg = Config<D, kSplit, kX3, kWarps>;
  static_assert(Cfg::kSmem <= 227 * 1024, "over the per-block shared memory of sm_90");
  auto* kernel = recurrence_kernel<D, kSplit, kWarps, kOut, kX3, kLate>;
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Cfg::kSmem)));
  const int64_t blocks = p.N * p.H * (D / Cfg::kCols);
  TORCH_CHECK(blocks <= INT32_MAX, "kda.fwd: ", std::to_string(p.N), " sequences x ", std::to_string(p.H),
              " heads is more blocks than one launch takes");
  kernel<<<static_cast<unsigned int>(blocks), Cfg::kThreads, Cfg::kSmem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The kernel for the state's dtype (bf16 or bf16x3 products).
template <int D, int kSplit, int kWarps, bool kOut, bool kLate = false>
void launch_for_products(const FwdParams& p, cudaStream_t stream) {
  if (p.bf16_products) {
    launch_kernel<D, kSplit, kWarps, kOut, false, kLate>(p, stream);
  } else {
    launch_kernel<D, kSplit, kWarps, kOut, true, kLate>(p, stream);
  }
}

template <int D, int kSplit, int kWarps = kOneGroupWarps<kSplit>>
void launch(const FwdParams& p, cudaStream_t stream, bool late_refill) {
  if (p.out == nullptr) {
    launch_for_products<D, kSplit, kWarps, false>(p, stream);
  } else if (kSplit == 1 && late_refill) {
    launch_for_products<D, kSplit, kWarps, true, kSplit == 1>(p, stream);
  } else {
    launch_for_products<D, kSplit, kWarps, true>(p, stream);
  }
}

}  // namespace

void launch_recurrence(const FwdParams& p, cudaStream_t stream, const RecurrenceShape& shape) {
  if (p.N == 0 || p.H == 0) {
    return;
  }
  ChunkedHeadSizes::dispatch(p.head_size, [&](auto head_size) {
    constexpr int D = decltype(head_size)::value;
    using B = RecurrenceBlock;
    switch (shape.block) {
      case B::k4x1w:
        if constexpr (has_kernels(B::k4x1w, D)) {
          return launch<D, 1>(p, stream, shape.late_refill);
        }
        break;
      case B::k2x2:
        if constexpr (has_kernels(B::k2x2, D)) {
          return launch<D, 2>(p, stream, false);
        }
        break;
      case B::k4x4:
        if constexpr (has_kernels(B::k4x4, D)) {
          return launch<D, 4>(p, stream, false);
        }
        break;
      case B::k8x4:
        if constexpr (has_kernels(B::k8x4, D)) {
          return launch<D, 4, 8>(p, stream, false);
        }
        break;
      case B::k16x4:
        if constexpr (has_kernels(B::k16x4, D)) {
          return launch<D, 4, 16>(p, stream, false);
        }
        break;
    }
    TORCH_INTERNAL_ASSERT(false, "K2: no kernels of the block shape at head size ", std::to_string(D));
  });
}

}  // namespace kda::cuda
