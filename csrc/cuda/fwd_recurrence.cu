// K2: the chunk-by-chunk recurrence, on the tensor cores.
//
// The rows of the V-first state (one per value channel) evolve independently
// given a chunk's operands, so a "row group" of kSplit warps owns 16 value rows
// of one (sequence, head) state, each warp 128 / kSplit of its key columns, as
// fp32 mma accumulators for the whole sequence. With kSplit = 1 a warp never
// waits for another; with kSplit = 4 a step's products are four warps' work and
// the partial sums over k meet in shared memory once per chunk, which shortens
// the sequential chain when there are too few (sequence, head) pairs to fill
// the GPU. A block is kWarps warps of one (sequence, head): they share the
// chunk's operands, which the block stages in shared memory one to three chunks
// ahead with cp.async (kDefaultStages). The launcher sizes blocks to the warps each SM must run.
//
// Per chunk, per row group (v: its 16 rows; c: the 16 tokens), the state's
// products in bf16x3 (mma.cuh), so an fp32 state stays fp32-accurate (a bf16
// state's in bf16 alone: kX3, FwdParams::bf16_products), and the
// output's with the record side in bf16 alone (params.h) and, but in the 2x2
// shape, the state's hi part alone (kQsLo):
//   U^T = v^T M^T - S W^T          (U0 = M v: params.h)
//   O^T = S Qs^T + U^T Aqk^T       -> out (not in the backward's passes)
//   S   = S diag(gl) + U^T Kd
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
constexpr int D = kHeadDim;
// Chunks staged ahead (the ring's length): three hide L2 latency behind a step;
// a block of eight full-width warps (one per SM, by registers) steps slowly
// enough for two. The 2x2 shape (two blocks per SM) measured faster with four
// (K2 0.456 -> 0.422 ms at 8192 x 32 heads, 1.858 -> 1.737 at 32768 x 32; H200)
// and the 4x4 shape slower with six (0.413 -> 0.425 at 8192 x 16, 3.340 ->
// 3.426 at 65536 x 16).
template <int kWarps, int kSplit>
constexpr int kDefaultStages = kWarps == 8 && kSplit == 1 ? 2 : kSplit == 2 ? 4 : 3;
constexpr int kOutPad = 16 + 8;
static_assert(C == 16, "the fragments below assume 16-token chunks");

// The bf16 planes that the forward reads, in record order (params.h), then Aqk's
// hi plane: the first kWsQsLo bytes of a record, copied verbatim.
enum Plane { kQs, kWHi, kWLo, kKdHi, kKdLo, kPlanes };
// With bf16 products (no kX3) a stage holds no lo planes: Qs, W's hi plane,
// then Kd's (8 KB less a stage).
template <bool kX3>
constexpr int kKdHiPlane = kX3 ? kKdHi : 2;
static_assert(kWsW == kPlaneBytes && kWsKd == 3 * kPlaneBytes && kWsAqk == kPlanes * kPlaneBytes &&
                  kWsQsLo == kWsAqk + kAqkPlaneBytes,
              "the record's bf16 part read here is contiguous");

template <int kCols, bool kX3, int kAlign = 16>  // value channels of the block; wgmma's operands want 1024
struct alignas(kAlign) Stage {
  // v's rows 16 bytes longer than the block's channels: the 8 rows of one
  // ldmatrix then start in distinct 16-byte bank groups.
  static constexpr int kVPitch = kCols + 8;
  __nv_bfloat16 mat[kX3 ? kPlanes : kKdHiPlane<false> + 1][C * D];  // swizzled planes (record_index)
  __nv_bfloat16 aqk[C * C];
  __nv_bfloat16 m[2][C * C];          // M hi, lo: [i][j]
  __nv_bfloat16 v[C][kVPitch];        // the chunk's v, the block's channels; zeros past the sequence
  float gl[D];
};

// kWg: the 4x1 shape's state products on wgmma (the warpgroup's 64 rows at once,
// B straight from the staged planes): the 4x1w shape, bitwise the 4x1's results
// (each product sums the same terms in the same order per accumulator) in 8-12 %
// less K2 time (8192 x 96 heads 0.835 -> 0.747 ms, 8 x 8192 x 32 1.76 -> 1.56;
// H200), so the automatic choice where the 4x1 would run.
template <int kWarps, int kSplit, int kSt, bool kWg, bool kX3>
struct Config {
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowGroups = kWarps / kSplit;
  static constexpr int kCols = 16 * kRowGroups;  // value channels of a block
  static constexpr int kNt = 16 / kSplit;        // 8-column n-tiles of state per warp
  static constexpr int kStagesAhead = kSt;
  using St = Stage<kCols, kX3, kWg ? 1024 : 16>;
  // Per warp, the partial sums over its key columns of S W^T and S Qs^T in
  // fragment order ([product][n-tile][lane] of float4s, a lane's four elements);
  // none when kSplit = 1.
  static constexpr int kRedFloats = kSplit > 1 ? 2 * 2 * 4 * 32 : 0;
  static constexpr size_t kSmem = kStagesAhead * sizeof(St) + kRowGroups * C * kOutPad * sizeof(__nv_bfloat16) +
                                  kWarps * kRedFloats * sizeof(float) + (kWg ? 1024 : 0);  // + the alignment's slack
  static_assert(!kWg || (kWarps == 4 && kSplit == 1), "wgmma: one warpgroup of full-width warps");
  static_assert(kWarps % kSplit == 0 && (kSplit == 1 || kSplit == 2 || kSplit == 4),
                "whole row groups; U0's shares are laid out for two or four warps");
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
template <int kCols, int kThreads, bool kX3, bool kQw = false, int kAlign>
__device__ __forceinline__ void load_stage(Stage<kCols, kX3, kAlign>& st, const unsigned char* rec,
                                           const __nv_bfloat16* v, int64_t row_stride, int len, int tid) {
  using St = Stage<kCols, kX3, kAlign>;
  const uint32_t mat = smem_u32(&st.mat[0][0]);
  static_assert(!kQw || !kX3, "the interleaved planes are the hi planes of bf16 products");
  constexpr int kHalf = kPlaneBytes / 2;
  if constexpr (kX3) {
    static_assert(offsetof(St, aqk) == kWsAqk && offsetof(St, m) >= kWsQsLo, "mat and aqk are one verbatim copy");
    copy_record_bytes<0, kWsQsLo, 0, kThreads>(mat, rec, tid);
  } else {
    static_assert(kWsW + kPlaneBytes == 2 * kPlaneBytes && offsetof(St, aqk) == 3 * kPlaneBytes,
                  "Qs and W's hi plane are contiguous in both; then Kd's hi plane and Aqk");
    if constexpr (kQw) {
      copy_record_bytes<kWsQs, kWsQs + kHalf, 0, kThreads>(mat, rec, tid);
      copy_record_bytes<kWsW, kWsW + kHalf, kHalf, kThreads>(mat, rec, tid);
      copy_record_bytes<kWsQs + kHalf, kWsQs + kPlaneBytes, 2 * kHalf, kThreads>(mat, rec, tid);
      copy_record_bytes<kWsW + kHalf, kWsW + kPlaneBytes, 3 * kHalf, kThreads>(mat, rec, tid);
    } else {
      copy_record_bytes<0, kWsW + kPlaneBytes, 0, kThreads>(mat, rec, tid);
    }
    copy_record_bytes<kWsKd, kWsKd + kPlaneBytes, kKdHiPlane<false> * kPlaneBytes, kThreads>(mat, rec, tid);
    copy_record_bytes<kWsAqk, kWsQsLo, offsetof(St, aqk), kThreads>(mat, rec, tid);
  }
  constexpr int kMPieces = 2 * kAqkPlaneBytes / 16;
  static_assert(kMPieces <= kThreads, "one piece of M per thread");
  if (tid < kMPieces) {
    cp_async_16(smem_u32(&st.m[0][0]) + tid * 16, rec + kWsM + tid * 16);
  }
  // v: kCols / 8 pieces per row.
  constexpr int kVPieces = kCols / 8;
#pragma unroll
  for (int it = 0; it < (C * kVPieces + kThreads - 1) / kThreads; ++it) {
    const int e = tid + it * kThreads, r = e / kVPieces, piece = e % kVPieces;
    if (e < C * kVPieces) {
      const bool valid = r < len;
      cp_async_16_or_zero(smem_u32(&st.v[r][piece * 8]), valid ? v + r * row_stride + piece * 8 : v, valid);
    }
  }
  if (tid < D / 4) {
    cp_async_16(smem_u32(&st.gl[tid * 4]), rec + kWsGl + tid * 16);
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

// kOut: the forward, which writes out. Without it (the backward's passes) only
// the states move, and the state at each chunk's start is stored where
// p.chunk_states says.
// kKs: with four split warps, the warp's key slice within its row group, a
// constant in each warp's code (recurrence_kernel below runs one copy of the
// body per slice), so that what depends on the slice (which partial sum is the
// warp's own, which n-tile of U0 and which quarter of out it takes) costs no
// select of its own: K2 -3 % at 8192 and 65536 tokens x 16 heads (H200). -1 elsewhere
// (the slice from the warp index): the 2x2 shape measured 6-8 % slower
// specialised (8192 and 32768 x 32 heads).
// kX3: the state's products in bf16x3 (an fp32 state); else each operand in
// bf16 alone (FwdParams::bf16_products: a bf16 state).
// kLate: the wgmma warpgroup issues each step's copies after its first
// products instead of right after the barrier (refill_now, late_refill_pays).
template <int kWarps, int kSplit, int kSt, bool kOut, bool kWg, bool kX3, int kKs, bool kLate>
__device__ __forceinline__ void recurrence_body(const FwdParams& p) {
  using Cfg = Config<kWarps, kSplit, kSt, kWg, kX3>;
  using St = typename Cfg::St;
  constexpr int kNt = Cfg::kNt, kKk = kNt / 2;
  // S Qs^T with the state's lo part too, or with its hi part alone (the output
  // is rounded to bf16; the state's own products keep bf16x3): 4x1 120 instead
  // of 136 mma a warp and step, 4x4 31 instead of 35. Measured per shape in one
  // run (H200, K2 ms): 4x1 0.942 -> 0.877 at 8192 x 96 heads, 4x4 (with U0
  // spread, below) 0.312 -> 0.306 at 8192 x 16, but 2x2 0.374 -> 0.416 at 8192
  // x 32, which keeps it; 8x1 and 2x1 (forced only) follow 4x1 unmeasured.
  constexpr bool kQsLo = kSplit == 2 && kX3;
  // The wgmma warpgroup with bf16 products takes S [Qs; W]^T as one n = 32
  // product a k-step (load_stage's kQw) instead of two of n = 16: K2 -4 to
  // -10 % on the H200 (0.471 -> 0.436 ms at 8192 x 96 heads, 1.258 -> 1.180 at
  // 8 x 8192 x 32), half the wgmma instructions for the same products.
  constexpr bool kQw = kWg && !kX3;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw;
  if constexpr (kWg) {
    smem += (1024u - (smem_u32(smem_raw) & 1023u)) & 1023u;  // the stages 1024-byte aligned (kSmem has the slack)
  }
  St* stages = reinterpret_cast<St*>(smem);
  auto* out_tile = reinterpret_cast<__nv_bfloat16(*)[C][kOutPad]>(smem + kSt * sizeof(St));
  float* red = reinterpret_cast<float*>(smem + kSt * sizeof(St) + Cfg::kRowGroups * sizeof(*out_tile));

  constexpr int kGroups = D / Cfg::kCols;
  const int64_t H = p.H;
  const int group = blockIdx.x % kGroups;
  const int64_t h = (blockIdx.x / kGroups) % H;
  const int64_t n = sequence_of_block_group(p, blockIdx.x / (kGroups * H));
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int rg = warp / kSplit, ks = kKs >= 0 ? kKs : warp % kSplit;  // row group; key slice within it
  static_assert((kSplit == 4) == (kKs >= 0), "a fixed key slice with four split warps only");
  constexpr int kOwn4 = kSplit == 4 ? kKs / 2 : 0;  // four split warps: the warp's n-tile of U0
  const int vcol0 = group * Cfg::kCols;              // the block's first value channel
  const int vloc = rg * 16;                          // the row group's first row within the block
  const int v0 = vcol0 + vloc;
  const int j0 = ks * kNt;                           // the warp's first n-tile of key columns
  // ldmatrix: lane l addresses row l % 8 of matrix l / 8.
  const int mi = lane / 8, mr = lane % 8;

  const int64_t seq_bos = seq_offset(p, n), seq_eos = seq_offset(p, n + 1);
  // The sequence's part of this launch's window of slots. Its state comes from
  // initial_state in the window where the sequence starts and goes to
  // final_state in the window where it ends; in between it waits in the carry.
  const WindowPart part = window_part(p, n);
  const bool starts_here = part.starts_here, ends_here = part.ends_here;
  const int64_t c_begin = part.c_begin, lo = part.lo, nchunks = part.chunks();
  if (nchunks == 0 && !starts_here) {
    return;  // the whole block: nothing of this sequence here
  }
  // Record of chunk c of this window's part: first + c * stride.
  const unsigned char* first =
      reinterpret_cast<const unsigned char*>(p.workspace) + ((lo - p.slot_begin) * H + h) * kWsChunkBytes;
  const int64_t stride = H * kWsChunkBytes;
  const int64_t part_bos = seq_bos + (lo - c_begin) * C;  // the part's first token
  // Chunk c goes into stage c % kSt. The step's counters are 32-bit (a part
  // has fewer than 2^31 chunks: the host bounds the slots) and its addresses
  // advance from step to step: the 64-bit c % 3, c * stride and token
  // arithmetic cost ~30 instructions a step, which the split shapes' single
  // warp per scheduler pays in full. Every chunk of a part but its last is full.
  const int nch = static_cast<int>(nchunks);
  const int last_len = nch > 0 ? static_cast<int>(min64(C, seq_eos - (part_bos + int64_t{nch - 1} * C))) : 0;
  const __nv_bfloat16* fill_v = static_cast<const __nv_bfloat16*>(p.v) + (part_bos * H + h) * D + vcol0;
  const unsigned char* fill_rec = first;
  int fill = 0, fill_stage = 0;  // the next chunk to stage, and its stage
  auto refill = [&]() {
    load_stage<Cfg::kCols, Cfg::kThreads, kX3, kQw>(stages[fill_stage], fill_rec, fill_v, H * D,
                                                  fill == nch - 1 ? last_len : C, tid);
    fill_rec += stride;
    fill_v += C * H * D;
    ++fill;
    fill_stage = fill_stage + 1 == kSt ? 0 : fill_stage + 1;
  };
#pragma unroll
  for (int s = 0; s < kSt - 1; ++s) {
    if (s < nch) {
      refill();
    }
    cp_async_commit();
  }

  // s[j][e]: state rows v0 + g (e = 0, 1) and v0 + g + 8 (e = 2, 3), key
  // columns 8(j0 + j) + 2t (e even) and + 1 (e odd); [n, h, v, k] layout.
  const int64_t row_g = ((n * H + h) * D + v0 + g) * D;
  const int64_t row_g8 = row_g + 8 * D;
  const void* state_in = starts_here ? p.initial_state : p.carry;
  const bool in_fp32 = starts_here ? p.state_fp32 : true;
  float s[kNt][4];
#pragma unroll
  for (int j = 0; j < kNt; ++j) {
    const int k0 = 8 * (j0 + j) + 2 * t;
    if (state_in != nullptr) {
      load_state_pair(state_in, row_g + k0, in_fp32, s[j][0], s[j][1]);
      load_state_pair(state_in, row_g8 + k0, in_fp32, s[j][2], s[j][3]);
    } else {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    }
  }

  // The state as the A operand of a step's products, k-step kk (n-tiles 2kk and
  // 2kk + 1) split into bf16 hi and lo. Full-width warps split each k-step as
  // soon as the previous step's update has written it: its ~24 dependent
  // instructions then fill the gaps between the update's products instead of
  // standing between the next step's (K2 at 8192 x 64 heads, one four-warp
  // block per SM: 0.756 -> 0.570 ms; 8192 x 96: 1.048 -> 0.931). Split warps
  // update only a few k-steps, behind which the splits would lengthen the
  // step's chain before the barrier: they split at the step's start (measured
  // 0.375 against 0.425 ms at 8192 x 16, 3.03 against 3.43 at 65536 x 16).
  // The wgmma warpgroup (4x1w) splits every k-step after its update's wait.
  constexpr bool kSplitEarly = kSplit == 1;
  static_assert(!kLate || kWg, "the later copies are the wgmma warpgroup's (refill_now)");
  uint32_t a_hi[kKk][4], a_lo[kKk][4];
  auto split_state = [&](int kk) {
    if constexpr (kX3) {
      split_pack(s[2 * kk][0], s[2 * kk][1], a_hi[kk][0], a_lo[kk][0]);
      split_pack(s[2 * kk][2], s[2 * kk][3], a_hi[kk][1], a_lo[kk][1]);
      split_pack(s[2 * kk + 1][0], s[2 * kk + 1][1], a_hi[kk][2], a_lo[kk][2]);
      split_pack(s[2 * kk + 1][2], s[2 * kk + 1][3], a_hi[kk][3], a_lo[kk][3]);
    } else {
      a_hi[kk][0] = pack_bf16x2_rn(s[2 * kk][0], s[2 * kk][1]);
      a_hi[kk][1] = pack_bf16x2_rn(s[2 * kk][2], s[2 * kk][3]);
      a_hi[kk][2] = pack_bf16x2_rn(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a_hi[kk][3] = pack_bf16x2_rn(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
  };
  if constexpr (kSplitEarly) {
#pragma unroll
    for (int kk = 0; kk < kKk; ++kk) {
      split_state(kk);
    }
  }

  // Lane l writes token row l / 2 of a chunk's out, half l % 2 of the row group's
  // 16 values; with four split warps, lane l < 8 token 8 (ks / 2) + l, half ks % 2.
  const int out_token = kSplit == 4 ? 8 * kOwn4 + lane % 8 : lane / 2;
  const int out_half = kSplit == 4 ? kKs % 2 : lane % 2;
  __nv_bfloat16* out_chunk =
      kOut ? static_cast<__nv_bfloat16*>(p.out) + ((part_bos + out_token) * H + h) * D + v0 + 8 * out_half : nullptr;
  int stage = 0;  // c % kSt
  for (int c = 0; c < nch; ++c) {
    // One barrier a step: it shows chunk c's stage to every warp and tells that
    // every warp has left step c - 1, whose stage (the one refilled next), partial
    // sums and out tile entries are then free (each warp reads back only the
    // out tile entries it wrote).
    cp_async_wait<kSt - 2>();
    __syncthreads();
    // The next chunk's copies: here, or with kLate (the 4x1w forward where its
    // blocks fill every SM three times over: late_refill_pays) beside U0's
    // products, while the step's first wgmma runs. There the steps wait on
    // DRAM's throughput and the later copies spread out: K2 -8 to -13 % at
    // 8 x 8192 x 32 heads (1.111-1.176 -> 1.026 ms), -5 to -9 % at 8 x 1024 x 32,
    // within 1 % at 8 x 1024 x 64 and 96, 64 x 512 x 32 and the mixed varlen
    // case; but +16 % at one block an SM (8192 x 64: 0.287 -> 0.334), and the
    // 2x2's after its first k-step +13 % at 65536 x 16 (1.67 -> 1.88; H200).
    auto refill_now = [&]() {
      if (fill < nch) {
        refill();
      }
      cp_async_commit();
    };
    if constexpr (!kLate) {
      refill_now();
    }
    // For the backward (its passes, or the forward of kda._fwd_checkpointed):
    // the state at this chunk's start, bf16, two n-tiles per 8-byte store
    // (quad_piece): whole 32-byte sectors, where 4-byte stores wrote each in
    // halves (K2's passes 1.112 -> 0.647 ms at 8192 x 64 heads, 2.460 -> 1.753
    // at 32768 x 32; H200). The record gradients take it in bf16.
    if (p.chunk_states != nullptr) {
      __nv_bfloat16* cs = static_cast<__nv_bfloat16*>(p.chunk_states) +
                          (((lo + c - p.slot_begin) * H + h) * D + v0 + g) * D + 8 * j0 + quad_piece_column(t);
#pragma unroll
      for (int jj = 0; jj < kNt / 2; ++jj) {
        store_tile_pair_bf16<false>(cs + 16 * jj, D, s[2 * jj], s[2 * jj + 1], t & 1);
      }
    }
    const St& st = stages[stage];
    stage = stage + 1 == kSt ? 0 : stage + 1;

    // S W^T and S Qs^T over the warp's key columns, 16 at a time; each term of
    // the split products has its own accumulators, so that consecutive mmas
    // rarely wait on each other.
    // The fragments of k-step kk + 1 are loaded before kk's products: the
    // asm statements keep source order, and a load issued right before its
    // products leaves each k-step waiting on shared memory (measured: K2 at one
    // four-warp block per SM, 8192 tokens x 64 heads, 0.603 -> 0.756 ms when the
    // compiler stopped hoisting them by itself).
    float acc_w[3][2][4], acc_o[2][2][4];  // written first by the kk = 0 products (but see acc_w[2])
    // v^T, the row group's 16 rows x the 16 tokens, as an A operand:
    // ldmatrix.trans turns v's rows (tokens) into the k dimension (v is exact in bf16).
    auto load_v_fragment = [&](uint32_t (&va)[4]) {
      ldmatrix_x4_trans(va, &st.v[(mi / 2) * 8 + mr][vloc + (mi % 2) * 8]);
    };
    // U0^T = v^T M^T (full-width warps; M as Aqk below).
    auto form_u0 = [&](float (&dst)[2][4]) {
      const int row = (mi / 2) * 8 + mr, col = (mi % 2) * 8;
      form_u0_tiles(&st.v[row][vloc + col], &st.m[0][row * C + col], &st.m[1][row * C + col], dst);
    };
    float u0[2][4];  // U0^T (full-width warps)
    if constexpr (!kWg) {
      // The mma.sync shapes' W and Qs fragments (the wgmma warpgroup reads them from the stage).
      uint32_t wh[2][4], wl[2][4], qh[2][4];
      auto load_wq = [&](int kk, int b) {
        // Matrices: tokens 0-7 | 8-15 (n-tiles) x key columns 16K.. | 16K+8.. (K = j0 / 2 + kk)
        const int row = (mi / 2) * 8 + mr, piece = j0 + 2 * kk + mi % 2;
        ldmatrix_x4(wh[b], record_piece(st.mat[kWHi], row, piece));
        if constexpr (kX3) {
          ldmatrix_x4(wl[b], record_piece(st.mat[kWLo], row, piece));
        }
        if constexpr (kOut) {
          ldmatrix_x4(qh[b], record_piece(st.mat[kQs], row, piece));
        }
      };
      load_wq(0, 0);
      // Split shapes: acc_w[2] (the hi * hi terms of S W^T) starts from a share of
      // -U0^T, so that the row group's partial sums add up to -U^T. As the first
      // link of a chain of products, U0 is then formed at the step's start beside
      // the other products; formed where it is used, after the partial sums'
      // barrier, it stood in the step's chain (2x2 shape: K2 0.39 -> 0.46 ms at
      // 8192 x 32 heads). Each warp takes a part of it (four warps: one n-tile
      // and one of M's two planes each; two: both n-tiles with plane ks): its
      // mmas spread over the warps instead of falling on the first (K2 0.397 ->
      // 0.374 ms at 8192 x 32 heads, 2x2, with one n-tile a warp then; 0.313 ->
      // 0.306 at 8192 x 16, 4x4, each with Qs's products as kept above). The
      // full-width warps form it after their products (measured 2-7 % faster than
      // at the start there).
      if constexpr (kSplit > 1) {
        uint32_t va[4];
        load_v_fragment(va);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          va[r] ^= 0x80008000u;  // -v (exact)
        }
        if constexpr (kSplit == 4) {
          const int mrow = (kOwn4 * 8 + mr) * C + ((lane / 8) % 2) * 8;  // B fragment of n-tile kOwn4
          uint32_t mb[2];
          ldmatrix_x2(mb, &st.m[kKs % 2][mrow]);
          mma_bf16_zero(acc_w[2][kOwn4], va, mb[0], mb[1]);
        } else {
          // Two warps: warp ks both n-tiles with M's plane ks (hi, lo), which
          // needs no select of which accumulators start from the share.
          uint32_t mb[4];
          ldmatrix_x4(mb, &st.m[ks][((mi / 2) * 8 + mr) * C + (mi % 2) * 8]);
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
        if constexpr (!kSplitEarly) {
          split_state(kk);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          if constexpr (kX3) {
            mma_bf16_into(acc_w[0][nt], a_lo[kk], wh[b][2 * nt], wh[b][2 * nt + 1], kk == 0);
            mma_bf16_into(acc_w[1][nt], a_hi[kk], wl[b][2 * nt], wl[b][2 * nt + 1], kk == 0);
          }
          // acc_w[2] starts from U0's share where the warp took one (above).
          const bool zero_w2 = kSplit == 4 ? kk == 0 && nt != kOwn4 : kSplit == 1 && kk == 0;
          mma_bf16_into(acc_w[2][nt], a_hi[kk], wh[b][2 * nt], wh[b][2 * nt + 1], zero_w2);
          if constexpr (kOut && kQsLo) {
            mma_bf16_into(acc_o[0][nt], a_lo[kk], qh[b][2 * nt], qh[b][2 * nt + 1], kk == 0);
          }
          if constexpr (kOut) {
            mma_bf16_into(acc_o[1][nt], a_hi[kk], qh[b][2 * nt], qh[b][2 * nt + 1], kk == 0);
          }
        }
      }
    } else {
      // The warpgroup's products: per k-step (16 keys) the warps' A fragments
      // and the planes' k-step as B, K-major, in half kk / 4 of each plane at
      // byte 32 (kk % 4) of its 128-byte rows (params.h); U0's mma.sync
      // products run while they do.
      const Sw128Desc k_major = sw128_desc(smem_u32(&st.mat[0][0]), 16, 1024);
      auto b_desc = [&](int plane, int kk) {
        return sw128_desc_at(k_major, plane * kPlaneBytes + (kk / 4) * (C * 128) + (kk % 4) * 32);
      };
      // kQw: k-step kk of [Qs; W] at half kk / 4 of the interleaved planes.
      auto qw_desc = [&](int rows, int kk) {
        return sw128_desc_at(k_major, (kk / 4) * kPlaneBytes + rows * 128 + (kk % 4) * 32);
      };
      float acc_qw[4][4];  // kQw with out: n-tiles 0-1 S Qs^T, 2-3 S W^T
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kKk; ++kk) {
        if constexpr (kQw && kOut) {
          wgmma_m64n32k16(acc_qw, a_hi[kk], qw_desc(0, kk), kk > 0);
        } else if constexpr (kQw) {
          wgmma_m64n16k16(acc_w[2], a_hi[kk], qw_desc(C, kk), kk > 0);
        } else {
          if constexpr (kX3) {
            wgmma_m64n16k16(acc_w[0], a_lo[kk], b_desc(kWHi, kk), kk > 0);
            wgmma_m64n16k16(acc_w[1], a_hi[kk], b_desc(kWLo, kk), kk > 0);
          }
          wgmma_m64n16k16(acc_w[2], a_hi[kk], b_desc(kWHi, kk), kk > 0);
          if constexpr (kOut && kQsLo) {
            wgmma_m64n16k16(acc_o[0], a_lo[kk], b_desc(kQs, kk), kk > 0);
          }
          if constexpr (kOut) {
            wgmma_m64n16k16(acc_o[1], a_hi[kk], b_desc(kQs, kk), kk > 0);
          }
        }
      }
      wgmma_commit();
      form_u0(u0);
      if constexpr (kLate) {
        refill_now();
      }
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
          if constexpr (kOut && kQsLo) {
            fence_operand(acc_o[0][nt][e]);
          }
        }
      }
    }
    // Kd's first fragments (the state update's), ahead of the reduction and U.
    uint32_t kh[2][4], kl[2][4];
    auto load_kd = [&](int jj, int b) {
      // Matrices: tokens 0-7 | 8-15 (k dimension) x key columns 8(j0+2jj).. | +8.. (n-tiles)
      const int row = (mi % 2) * 8 + mr, piece = j0 + 2 * jj + mi / 2;
      ldmatrix_x4_trans(kh[b], record_piece(st.mat[kKdHiPlane<kX3>], row, piece));
      if constexpr (kX3) {
        ldmatrix_x4_trans(kl[b], record_piece(st.mat[kKdLo], row, piece));
      }
    };
    if constexpr (!kWg) {
      load_kd(0, 0);
    }
    float sw[2][4], so[2][4];  // the small terms first, as mma_bf16x3 sums them
    float o_own[4];            // two split warps: the warp's n-tile ks of S Qs^T, both parts added
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sw[nt][e] = kX3 ? (acc_w[0][nt][e] + acc_w[1][nt][e]) + acc_w[2][nt][e] : acc_w[2][nt][e];
        so[nt][e] = !kOut ? 0.f : kQsLo ? acc_o[0][nt][e] + acc_o[1][nt][e] : acc_o[1][nt][e];
      }
    }
    if constexpr (kSplit > 1) {
      // The row group's warps add their partial sums: every warp needs all of
      // S W^T (for U), the warps that write out need their n-tile of S Qs^T (four
      // split warps: their quarter). A lane's four values of an n-tile travel as
      // one 16-byte vector (lanes 16 bytes apart: no bank conflicts; for the four
      // split warps' quarters S Qs^T as two planes of 8-byte halves, below), a
      // warp's own part stays in its registers, and the parts are added in warp
      // order (deterministic; two as own + other, the same bits).
      float4* mine = reinterpret_cast<float4*>(red) + warp * (Cfg::kRedFloats / 4);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mine[(0 * 2 + nt) * 32 + lane] = make_float4(sw[nt][0], sw[nt][1], sw[nt][2], sw[nt][3]);
        if constexpr (kOut) {
          if constexpr (kSplit == 4) {
            // As two planes of float2s (the quarters' halves), which the quarters
            // read 8 contiguous bytes a lane: without bank conflicts.
            float2* mine2 = reinterpret_cast<float2*>(mine) + (1 * 2 + nt) * 64 + lane;
            mine2[0] = make_float2(so[nt][0], so[nt][1]);
            mine2[32] = make_float2(so[nt][2], so[nt][3]);
          } else {
            mine[(1 * 2 + nt) * 32 + lane] = make_float4(so[nt][0], so[nt][1], so[nt][2], so[nt][3]);
          }
        }
      }
      __syncthreads();
      const float4* group_red = reinterpret_cast<const float4*>(red) + rg * kSplit * (Cfg::kRedFloats / 4);
      if constexpr (kSplit == 2) {
        // Two parts: own + other is the same sum in either order (IEEE addition
        // commutes), so no select of which part comes first; the warp's n-tile
        // of out is n-tile ks. With U0's share by plane (above) the bf16 step
        // loop 355 -> 315 SASS instructions, K2 -5 to -8 % (1.807 -> 1.662 ms
        // at 65536 x 16 heads, 1.117 -> 1.060 at 32768 x 32; H200).
        const float4* other = group_red + (ks ^ 1) * (Cfg::kRedFloats / 4);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float4 x = other[nt * 32 + lane];
          sw[nt][0] += x.x, sw[nt][1] += x.y, sw[nt][2] += x.z, sw[nt][3] += x.w;
        }
        if constexpr (kOut) {
          const float4 y = other[(2 + ks) * 32 + lane];
          const float yv[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            o_own[e] = (ks == 1 ? so[1][e] : so[0][e]) + yv[e];
          }
        }
      } else {
        // Four parts, added in warp order (deterministic).
        auto part = [&](int w, int nt, const float (&own)[4]) {
          return w == ks ? make_float4(own[0], own[1], own[2], own[3])
                         : group_red[w * (Cfg::kRedFloats / 4) + nt * 32 + lane];
        };
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          float4 w_sum = part(0, nt, sw[nt]);
#pragma unroll
          for (int w = 1; w < kSplit; ++w) {
            const float4 x = part(w, nt, sw[nt]);
            w_sum = make_float4(w_sum.x + x.x, w_sum.y + x.y, w_sum.z + x.z, w_sum.w + x.w);
          }
          sw[nt][0] = w_sum.x, sw[nt][1] = w_sum.y, sw[nt][2] = w_sum.z, sw[nt][3] = w_sum.w;
        }
      }
      if constexpr (kOut && kSplit == 4) {
        // Four warps write a quarter of out each: n-tile ks / 2, value rows
        // g + 8 (ks % 2), the fragment's elements 2 (ks % 2) and + 1.
        constexpr int nto = kKs / 2, r = kKs % 2;
        const float2* red2 = reinterpret_cast<const float2*>(group_red);
        auto quarter = [&](int w) {
          return w == ks ? make_float2(so[nto][2 * r], so[nto][2 * r + 1])
                         : red2[w * (Cfg::kRedFloats / 2) + (1 * 2 + nto) * 64 + r * 32 + lane];
        };
        float2 q = quarter(0);
#pragma unroll
        for (int w = 1; w < kSplit; ++w) {
          const float2 x = quarter(w);
          q = make_float2(q.x + x.x, q.y + x.y);
        }
        so[nto][2 * r] = q.x, so[nto][2 * r + 1] = q.y;
      }
    }

    // U^T = U0^T - S W^T (split shapes: -sw); as an A operand its two n-tiles
    // are the 16 tokens.
    if constexpr (kSplit == 1 && !kWg) {
      form_u0(u0);
    }
    float u[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        u[nt][e] = kSplit == 1 ? u0[nt][e] - sw[nt][e] : -sw[nt][e];
      }
    }
    uint32_t ua_hi[4], ua_lo[4];
    if constexpr (kX3) {
      split_pack(u[0][0], u[0][1], ua_hi[0], ua_lo[0]);
      split_pack(u[0][2], u[0][3], ua_hi[1], ua_lo[1]);
      split_pack(u[1][0], u[1][1], ua_hi[2], ua_lo[2]);
      split_pack(u[1][2], u[1][3], ua_hi[3], ua_lo[3]);
    } else {
      ua_hi[0] = pack_bf16x2_rn(u[0][0], u[0][1]);
      ua_hi[1] = pack_bf16x2_rn(u[0][2], u[0][3]);
      ua_hi[2] = pack_bf16x2_rn(u[1][0], u[1][1]);
      ua_hi[3] = pack_bf16x2_rn(u[1][2], u[1][3]);
    }
    // U's lo part times Aqk (the output's product), with kX3.
    auto aqk_lo_term = [&](float (&d)[4], uint32_t b0, uint32_t b1) {
      if constexpr (kX3) {
        mma_bf16(d, ua_lo, b0, b1);
      }
    };

    // O^T += U^T Aqk^T for the warp's part of out (Aqk stored [i][j] is Aqk^T's
    // B fragment as it stands); out leaves through the row group's tile in
    // 16-byte stores. Full-width warps take both token n-tiles, two split warps
    // one n-tile each, four a quarter each (n-tile ks / 2, value rows g + 8 (ks %
    // 2)); split warps take it after the state update's products, which then
    // start the step's last stretch without waiting behind the output's.
    const int len = c == nch - 1 ? last_len : C;
    auto& tile = out_tile[rg];
    auto write_out = [&]() {
      const int row = (mi / 2) * 8 + mr, col = (mi % 2) * 8;
      uint32_t ah[4];
      ldmatrix_x4(ah, &st.aqk[row * C + col]);
      if constexpr (kSplit == 1) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          aqk_lo_term(so[nt], ah[2 * nt], ah[2 * nt + 1]);
          mma_bf16(so[nt], ua_hi, ah[2 * nt], ah[2 * nt + 1]);
          const int i0 = 8 * nt + 2 * t;
          tile[i0][g] = __float2bfloat16_rn(so[nt][0]);
          tile[i0 + 1][g] = __float2bfloat16_rn(so[nt][1]);
          tile[i0][g + 8] = __float2bfloat16_rn(so[nt][2]);
          tile[i0 + 1][g + 8] = __float2bfloat16_rn(so[nt][3]);
        }
      } else if constexpr (kSplit == 4) {  // the warp's quarter (see the partial sums)
        constexpr int nto = kKs / 2, r = kKs % 2;
        aqk_lo_term(so[nto], ah[2 * nto], ah[2 * nto + 1]);
        mma_bf16(so[nto], ua_hi, ah[2 * nto], ah[2 * nto + 1]);
        const int i0 = 8 * nto + 2 * t;
        tile[i0][g + 8 * r] = __float2bfloat16_rn(so[nto][2 * r]);
        tile[i0 + 1][g + 8 * r] = __float2bfloat16_rn(so[nto][2 * r + 1]);
        __syncwarp();
        // Lanes 0-7: token 8 nto + lane, the quarter's 8 values (out_chunk).
        if (lane < 8 && 8 * nto + lane < len) {
          *reinterpret_cast<uint4*>(out_chunk) = *reinterpret_cast<const uint4*>(&tile[8 * nto + lane][8 * r]);
        }
        return;
      } else {
        const bool second = ks % 2 == 1;  // the warp's n-tile: ks % 2
        float (&o)[4] = o_own;  // both parts of S Qs^T's n-tile ks (the partial sums)
        const uint32_t b0 = second ? ah[2] : ah[0], b1 = second ? ah[3] : ah[1];
        aqk_lo_term(o, b0, b1);
        mma_bf16(o, ua_hi, b0, b1);
        if (ks < 2) {
          const int i0 = 8 * (ks % 2) + 2 * t;
          tile[i0][g] = __float2bfloat16_rn(o[0]);
          tile[i0 + 1][g] = __float2bfloat16_rn(o[1]);
          tile[i0][g + 8] = __float2bfloat16_rn(o[2]);
          tile[i0 + 1][g + 8] = __float2bfloat16_rn(o[3]);
        }
      }
      __syncwarp();
      const int i = lane / 2, half = lane % 2;  // token row i and half of the 16 values
      if ((i / 8) % kSplit == ks && i < len) {
        *reinterpret_cast<uint4*>(out_chunk) = *reinterpret_cast<const uint4*>(&tile[i][8 * half]);
      }
    };
    if constexpr (kOut && kSplit == 1) {
      write_out();
    }

    // S <- S diag(gl) + U^T Kd; ldmatrix.trans turns Kd's rows (tokens) into the
    // k dimension. The products go into zero accumulators and reach the state
    // through one fp32 FMA: the tensor cores' own fp32 additions are reported to
    // truncate, which would pull the state towards zero a little every chunk.
    if constexpr (!kWg) {
#pragma unroll
      for (int jj = 0; jj < kNt / 2; ++jj) {
        const int b = jj % 2;
        if (jj + 1 < kNt / 2) {
          load_kd(jj + 1, 1 - b);
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
          const float2 decay = *reinterpret_cast<const float2*>(&st.gl[8 * (j0 + j) + 2 * t]);
          s[j][0] = fmaf(s[j][0], decay.x, upd[h2][0]);
          s[j][1] = fmaf(s[j][1], decay.y, upd[h2][1]);
          s[j][2] = fmaf(s[j][2], decay.x, upd[h2][2]);
          s[j][3] = fmaf(s[j][3], decay.y, upd[h2][3]);
        }
        if constexpr (kSplitEarly) {
          split_state(jj);  // k-step jj of the next chunk's products
        }
      }
    } else {
      // U^T Kd for the warpgroup's 64 rows and all 128 keys: Kd (k = the 16
      // tokens, n = the keys) MN-major, its two 64-key halves LBO apart, its
      // two 8-token row groups SBO apart.
      const Sw128Desc mn_major = sw128_desc(smem_u32(&st.mat[0][0]), C * 128, 1024);
      const uint64_t kd_hi = sw128_desc_at(mn_major, kKdHiPlane<kX3> * kPlaneBytes);
      float upd[kNt][4];
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
      for (int j = 0; j < kNt; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          fence_operand(upd[j][e]);
        }
        const float2 decay = *reinterpret_cast<const float2*>(&st.gl[8 * j + 2 * t]);
        s[j][0] = fmaf(s[j][0], decay.x, upd[j][0]);
        s[j][1] = fmaf(s[j][1], decay.y, upd[j][1]);
        s[j][2] = fmaf(s[j][2], decay.x, upd[j][2]);
        s[j][3] = fmaf(s[j][3], decay.y, upd[j][3]);
      }
#pragma unroll
      for (int kk = 0; kk < kKk; ++kk) {
        split_state(kk);
      }
    }
    if constexpr (kOut && kSplit > 1) {
      write_out();
    }
    if constexpr (kOut) {
      out_chunk += C * H * D;
    }
  }

  void* state_out = ends_here ? p.final_state : p.carry;
  const bool out_fp32 = ends_here ? p.state_fp32 : true;
  if (state_out != nullptr) {
#pragma unroll
    for (int j = 0; j < kNt; ++j) {
      const int k0 = 8 * (j0 + j) + 2 * t;
      store_state_pair(state_out, row_g + k0, out_fp32, s[j][0], s[j][1]);
      store_state_pair(state_out, row_g8 + k0, out_fp32, s[j][2], s[j][3]);
    }
  }
}

template <int kWarps, int kSplit, int kSt, bool kOut, bool kWg, bool kX3, bool kLate>
__global__ void __launch_bounds__(kWarps * 32) recurrence_kernel(const FwdParams p) {
  if constexpr (kSplit != 4) {
    recurrence_body<kWarps, kSplit, kSt, kOut, kWg, kX3, -1, kLate>(p);
  } else {
    // The branch is uniform per warp, not per block: it relies on bar.sync
    // counting warps, and every copy meets the same barriers in the same order
    // (one per step, and the partial sums').
    switch ((threadIdx.x / 32) % kSplit) {
      case 0:
        recurrence_body<kWarps, kSplit, kSt, kOut, kWg, kX3, 0, kLate>(p);
        break;
      case 1:
        recurrence_body<kWarps, kSplit, kSt, kOut, kWg, kX3, 1, kLate>(p);
        break;
      case 2:
        recurrence_body<kWarps, kSplit, kSt, kOut, kWg, kX3, 2, kLate>(p);
        break;
      default:
        recurrence_body<kWarps, kSplit, kSt, kOut, kWg, kX3, 3, kLate>(p);
        break;
    }
  }
}

template <int kWarps, int kSplit, int kSt, bool kOut, bool kWg, bool kX3, bool kLate = false>
void launch_kernel(const FwdParams& p, cudaStream_t stream) {
  using Cfg = Config<kWarps, kSplit, kSt, kWg, kX3>;
  static_assert(Cfg::kSmem <= 227 * 1024, "over the per-block shared memory of sm_90");
  auto* kernel = recurrence_kernel<kWarps, kSplit, kSt, kOut, kWg, kX3, kLate>;
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Cfg::kSmem)));
  const int64_t blocks = p.N * p.H * (D / Cfg::kCols);
  TORCH_CHECK(blocks <= INT32_MAX, "kda.fwd: ", std::to_string(p.N), " sequences x ", std::to_string(p.H),
              " heads is more blocks than one launch takes");
  kernel<<<static_cast<unsigned int>(blocks), Cfg::kThreads, Cfg::kSmem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether the 4x1w forward issues a step's copies late (recurrence_body's
// refill_now): where its blocks (two a (sequence, head)) fill every SM three
// times over.
bool late_refill_pays(const FwdParams& p) {
  return p.N * p.H * (D / 64) >= int64_t{3} * p.num_sms;
}

// The kernel for the state's dtype (bf16 or bf16x3 products).
template <int kWarps, int kSplit, int kSt, bool kOut, bool kWg, bool kLate = false>
void launch_for_products(const FwdParams& p, cudaStream_t stream) {
  if (p.bf16_products) {
    launch_kernel<kWarps, kSplit, kSt, kOut, kWg, false, kLate>(p, stream);
  } else {
    launch_kernel<kWarps, kSplit, kSt, kOut, kWg, true, kLate>(p, stream);
  }
}

template <int kWarps, int kSplit, bool kWg = false>
void launch(const FwdParams& p, cudaStream_t stream) {
  constexpr int kSt = kDefaultStages<kWarps, kSplit>;
  if (p.out == nullptr) {
    launch_for_products<kWarps, kSplit, kSt, false, kWg>(p, stream);
    return;
  }
  if constexpr (kWg) {
    if (late_refill_pays(p)) {
      launch_for_products<kWarps, kSplit, kSt, true, kWg, true>(p, stream);
      return;
    }
  }
  launch_for_products<kWarps, kSplit, kSt, true, kWg>(p, stream);
}

}  // namespace

void launch_recurrence(const FwdParams& p, cudaStream_t stream, RecurrenceBlock block) {
  if (p.N == 0 || p.H == 0) {
    return;
  }
  // A step takes as long as the busiest SM needs for it. Full-width warps (one
  // per 16 value rows of a head) go four to a block, two blocks per SM by
  // registers: measured faster than eight-warp blocks, which share a staged
  // chunk twice as widely (K2 1.110 -> 1.053 ms at 8192 x 96, 0.868 -> 0.815 at
  // 8 x 1024 x 96, 2.360 -> 2.189 at 8 x 8192 x 32; H200), and than two-warp
  // blocks (1.024 -> 1.198 at 8192 x 96). Where each SM would run only two
  // full-width warps, each row group's key columns are split over two warps
  // (K2 0.571 -> 0.464 ms at 8192 x 32, 2.318 -> 1.893 at 32768 x 32; a four-way
  // split measured slower there, 0.597 vs 0.555); at one per SM, over four
  // (0.409 ms at 8192 x 16, where the two-way split took 0.440). The full-width
  // blocks take their state products on wgmma (4x1w, see Config). With bf16
  // products (a bf16 state) the steps are a third shorter and the two-way split
  // is faster at one warp per SM too (K2 1.947 -> 1.805 ms at 65536 x 16
  // heads, 0.247 -> 0.230 at 8192 x 16; H200).
  if (block == RecurrenceBlock::kAuto) {
    const int64_t warps_per_sm = recurrence_warps_per_sm(p);
    block = warps_per_sm > 2                       ? RecurrenceBlock::k4x1w
            : warps_per_sm > 1 || p.bf16_products ? RecurrenceBlock::k2x2
                                                   : RecurrenceBlock::k4x4;
  }
  switch (block) {
    case RecurrenceBlock::k8x1:
      launch<8, 1>(p, stream);
      break;
    case RecurrenceBlock::k4x1:
      launch<4, 1>(p, stream);
      break;
    case RecurrenceBlock::k4x1w:
      launch<4, 1, true>(p, stream);
      break;
    case RecurrenceBlock::k2x1:
      launch<2, 1>(p, stream);
      break;
    case RecurrenceBlock::k2x2:
      launch<2, 2>(p, stream);
      break;
    default:
      launch<4, 4>(p, stream);
      break;
  }
}

}  // namespace kda::cuda
