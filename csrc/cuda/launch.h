// Launchers of the CUDA kernels (each defined in its own .cu file of this
// folder). They take the params by value and enqueue on the given stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/params.h"

namespace kda::cuda {

// Varlen only, before K1: seq[0..N] and chunks[0..N] (params.h) from
// cu_seqlens (int32 or int64, N + 1 entries, on the device).
void launch_boundaries(const void* cu_seqlens, bool cu_int32, int64_t N, int64_t tokens, int64_t* seq,
                       int64_t* chunks, cudaStream_t stream);

// K1: token-parallel, one block per (chunk, head): gate, L2 norms, decays,
// the chunk's matrices and the inverse; fills the workspace.
void launch_prepare(const FwdParams& params, cudaStream_t stream);

// K2: sequential over chunks; a row group of 16 value rows of one (sequence,
// head) per warp, or per four warps when its key columns are split; blocks of
// four or eight warps. Carries the fp32 state on chip in tensor-core
// accumulators, writes out and final_state.
void launch_recurrence(const FwdParams& params, cudaStream_t stream);

inline void launch_forward(const FwdParams& params, cudaStream_t stream) {
  launch_prepare(params, stream);
  launch_recurrence(params, stream);
}

}  // namespace kda::cuda
