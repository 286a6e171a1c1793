// Launchers of the CUDA kernels (each defined in its own .cu file of this
// folder). They take the params by value and enqueue on the given stream. The
// block-shape knobs below are read in forced_shapes.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "cuda/params.h"

namespace kda::cuda {

// Varlen only, before K1: seq[0..N] and chunks[0..N] (params.h) from
// cu_seqlens (int32 or int64, N + 1 entries, on the device), and order[0..N)
// (FwdParams::seq_order).
void launch_boundaries(const void* cu_seqlens, bool cu_int32, int64_t N, int64_t tokens, int64_t* seq,
                       int64_t* chunks, int64_t* order, cudaStream_t stream);

// Rows of bf16 tensors [tokens, width] to clear where no chunk covers a token.
struct ZeroRows {
  static constexpr int kMax = 5;
  void* base[kMax] = {};  // bf16; null: unused
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

// K2's block shapes: W warps splitting each row group's key columns S ways.
// kAuto lets the launcher choose by recurrence_warps_per_sm.
// 4x1w: the 4x1 shape with its state products on wgmma (kAuto's full-width choice).
enum class RecurrenceBlock { kAuto, k8x1, k4x1, k4x1w, k2x1, k2x2, k4x4 };

// K2: sequential over chunks; a row group of 16 value rows of one (sequence,
// head) per warp, or per two or four warps when its key columns are split; blocks of
// two or four warps (eight only when forced). Carries the fp32 state on chip in
// tensor-core accumulators, writes out and final_state.
void launch_recurrence(const FwdParams& params, cudaStream_t stream, RecurrenceBlock block);

// K1's backward (bwd_prepare.cu): one block per (chunk slot, head) of the
// window; from the record gradients to the op's gradients (params.chain), or to
// those of q^, k^, v, lambda, sigmoid(beta) (the private test op).
void launch_prepare_backward(const PrepareBwdParams& params, cudaStream_t stream);

// The dS recurrence's block shapes, as K2's: W warps splitting each row
// group's key columns S ways. kAuto lets the launcher choose by
// recurrence_warps_per_sm.
enum class DsBlock { kAuto, k1x1, k2x1, k4x1, k2x2, k4x2, k8x2 };

// The backward sweep (bwd_sweep.cu), two kernels: the dS recurrence (row
// groups of each (sequence, head) spread over blocks, backward over its chunks;
// dU, dS at each chunk's end, the initial state's gradient), then one block per
// (chunk slot, head) for the record gradients.
void launch_sweep_backward(const SweepBwdParams& params, cudaStream_t stream, DsBlock block);

// TORCH_KDA_RECURRENCE_BLOCK=WxS forces K2's block shape (8x1, 4x1, 4x1w, 2x1,
// 2x2 or 4x4), for measurements and tests: the shape, or kAuto when unset; raises on
// any other value, naming `op` (the op called). Read once per call, before K1 and
// K2 are enqueued, so a bad value leaves no kernel behind that writes the caller's tensors.
RecurrenceBlock forced_recurrence_block(const char* op);

// TORCH_KDA_DS_BLOCK=WxS forces the dS recurrence's block shape (1x1, 2x1, 4x1,
// 2x2, 4x2 or 8x2) in the same way, read at the same point.
DsBlock forced_ds_block(const char* op);

// TORCH_KDA_K1_WARPS=1 or 2: K1's warps per (chunk, head), for measurements
// and tests (2 when unset); raises on any other value, naming `op`. Read with
// the block shapes, into FwdParams::prepare_warps.
int forced_prepare_warps(const char* op);

// The warps that K2 gives each SM when every (sequence, head) has its eight row
// groups resident at once; its block shape follows from this.
inline int64_t recurrence_warps_per_sm(const FwdParams& p) {
  return (p.N * p.H * (kHeadDim / 16) + p.num_sms - 1) / p.num_sms;
}

}  // namespace kda::cuda
