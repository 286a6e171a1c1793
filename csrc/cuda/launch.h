// Launchers of the CUDA kernels (each defined in its own .cu file under this
// folder: forward/, backward/, boundaries.cu). They enqueue on the given stream, in the shapes that the caller
// chose (heuristics.h).
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda/params.h"

namespace kda::cuda {

// The one place where a launcher turns FwdParams::head_size into the template
// argument D of its kernels' instances: Sizes::dispatch calls launch with
// std::integral_constant<int, D> for the size it lists. A new head size is an
// entry of a list here and the instances it brings. The chunked kernels,
// forward (K1, K2's split shapes, the segment scan) and backward (K1's backward
// records, the dS recurrence, the record gradients, K1's backward), serve 64,
// 128 and 256; K2's 4x1w, the dS recurrence's 4x1 and the decode kernel 128
// (heads of other sizes up to 128 run zero-padded there: padded_heads.h).
template <int... Sizes>
struct HeadSizes {
  static constexpr bool contains(int head_size) { return ((head_size == Sizes) || ...); }
  template <class Launch>
  static void dispatch(int head_size, Launch&& launch) {
    const bool served = ((head_size == Sizes && (launch(std::integral_constant<int, Sizes>{}), true)) || ...);
    TORCH_INTERNAL_ASSERT(served, "no CUDA kernels for head size ", std::to_string(head_size));
  }
};
using ChunkedHeadSizes = HeadSizes<kNarrowHead, kHeadDim, kMaxHeadSize>;

// Varlen only, before K1: seq[0..N] and chunks[0..N] (params.h) from
// cu_seqlens (int32 or int64, N + 1 entries, on the device), and order[0..N)
// (FwdParams::seq_order).
void launch_boundaries(const void* cu_seqlens, bool cu_int32, int64_t N, int64_t tokens, int64_t* seq,
                       int64_t* chunks, int64_t* order, cudaStream_t stream);

// Rows of bf16 tensors [tokens, width] to clear where no chunk covers a token.
struct ZeroRows {
  static constexpr int kMax = 5;
  void* base[kMax] = {};  // zeroed as bf16 elements, width[r] a token; null: unused
  int64_t width[kMax] = {};
};

// Varlen only: zeros the rows of the tokens outside [seq[0], seq[N]) (seq from
// launch_boundaries), which no chunk covers: only a malformed cu_seqlens
// leaves any, and the kernels write every covered token.
void launch_zero_uncovered(const int64_t* seq, int64_t N, int64_t tokens, const ZeroRows& rows,
                           cudaStream_t stream);

// K1: token-parallel, one block per (chunk, head): gate, L2 norms, decays,
// the chunk's matrices and the inverse; fills the workspace.
void launch_prepare(const FwdParams& params, cudaStream_t stream);

// K2's block shapes (forward/recurrence.cu), WxS: W warps a block, S warps to
// each 16 value rows (splitting their key columns). 4x1w: four full-width
// warps as one warpgroup, state products on wgmma (head size 128 only). 8x4 and
// 16x4: two and four 4x4 row groups sharing one block's stages (head size 256
// only, where the 2x2 and 4x4 have no kernels).
enum class RecurrenceBlock { k4x1w, k2x2, k4x4, k8x4, k16x4 };
constexpr std::pair<const char*, RecurrenceBlock> kRecurrenceBlocks[] = {
    {"4x1w", RecurrenceBlock::k4x1w}, {"2x2", RecurrenceBlock::k2x2}, {"4x4", RecurrenceBlock::k4x4},
    {"8x4", RecurrenceBlock::k8x4}, {"16x4", RecurrenceBlock::k16x4}};

// Whether K2 has kernels of this shape at head size D: the launcher's
// instances and the forced shapes' check (heuristics.cpp) both follow it.
constexpr bool has_kernels(RecurrenceBlock block, int D) {
  switch (block) {
    case RecurrenceBlock::k4x1w:
      return D == kHeadDim;  // its update is one m64n128 product a term
    case RecurrenceBlock::k2x2:
    case RecurrenceBlock::k4x4:
      return D < kMaxHeadSize;  // at 256 a stage (44 KB) would leave one such block an SM
    case RecurrenceBlock::k8x4:
    case RecurrenceBlock::k16x4:
      return D == kMaxHeadSize;
  }
  return false;
}

// K2's shape for one launch (heuristics.h chooses it). late_refill: the 4x1w
// forward issues a step's copies after its first products.
struct RecurrenceShape {
  RecurrenceBlock block = RecurrenceBlock::k4x1w;
  bool late_refill = false;
};

// K2: sequential over chunks; a row group of 16 value rows of one (sequence,
// head) per warp, or per two or four warps when its key columns are split.
// Carries the fp32 state on chip in tensor-core accumulators, writes out and
// final_state (and the chunk-start states where params.chunk_states asks).
void launch_recurrence(const FwdParams& params, cudaStream_t stream, const RecurrenceShape& shape);

// K1's backward (backward/input_gradients.cu): one block per (chunk slot, head) of the
// window; from the record gradients to the op's gradients (params.chain), or to
// those of q^, k^, v, lambda, sigmoid(beta) (the private test op).
void launch_prepare_backward(const PrepareBwdParams& params, cudaStream_t stream);

// The dS recurrence's block shapes (backward/ds_recurrence.cu), WxS as K2's:
// 4x1 up to head size 128; 8x2 (four split row groups sharing a block's stages)
// at 256 only.
enum class DsBlock { k4x1, k4x2, k2x2, k8x2 };
constexpr std::pair<const char*, DsBlock> kDsBlocks[] = {
    {"4x1", DsBlock::k4x1}, {"4x2", DsBlock::k4x2}, {"2x2", DsBlock::k2x2}, {"8x2", DsBlock::k8x2}};

constexpr bool has_kernels(DsBlock block, int D) {
  switch (block) {
    case DsBlock::k4x1:
      return D <= kHeadDim;  // full-width warps of 256 columns would carry 128 accumulators each
    case DsBlock::k4x2:
    case DsBlock::k2x2:
      return true;
    case DsBlock::k8x2:
      return D == kMaxHeadSize;  // at 256 a stage is ~52 KB, one 4x2 or 2x2 an SM
  }
  return false;
}

// The backward sweep, two kernels, one after the other: the dS recurrence
// (backward/ds_recurrence.cu: row groups of each (sequence, head) spread over
// blocks, backward over its chunks; dU, dS at each chunk's end, the initial
// state's gradient), then the record gradients (backward/record_gradients.cu:
// one block per (chunk slot, head)). ends_only: the segmented dS recurrence's
// passes (backward/schedule.cpp): only each sequence's d_initial (and, with
// params.d_maps, its map), no dU or dS per chunk.
void launch_ds_recurrence(const SweepBwdParams& params, cudaStream_t stream, DsBlock block, bool ends_only = false);
void launch_record_gradients(const SweepBwdParams& params, cudaStream_t stream);

// The segmented forward's scan (forward/segment_scan.cu; segments.h
// segment_start_states on the device): starts [N * P, H, V, K] fp32 from
// pass 1's ends, pass 2's maps (both fp32) and the initial states (fp32 or bf16,
// or null for zeros). reverse: each sequence's segments taken last to first.
void launch_segment_scan(const float* maps, const float* ends, const void* initial, bool initial_fp32, float* starts,
                         int64_t N, int64_t P, int64_t H, int head_size, cudaStream_t stream, bool reverse = false);

// The state pool (pool.cu): the decode, for requests of a few tokens; and the
// copies around the chunked forward for long ones: params.states from the
// pool (zeros for padding rows), back to the pool (but padding rows), and
// zeros over the padding rows' out.
void launch_pool_decode(const PoolParams& params, cudaStream_t stream);
void launch_pool_gather(const PoolParams& params, cudaStream_t stream);
void launch_pool_scatter(const PoolParams& params, cudaStream_t stream);
void launch_pool_zero_padding(const PoolParams& params, cudaStream_t stream);

}  // namespace kda::cuda
