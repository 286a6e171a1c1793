// The CUDA forward's host entry, shared by the ops that run it (ops_cuda.cpp,
// pool_ops.cpp), and the decode kernel run as a forward.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <optional>

#include "cuda/params.h"
#include "kda.h"

namespace kda::cuda {

// The forward of p into `out` and `final_state` for any head size the CUDA ops
// take (1 to 256; ops_cuda.cpp has the staging rules): the chunked kernels of
// chunked_head_size (64, 128 or 256), or the decode kernel's 128 where
// decode_short_requests and the requests average a few tokens (kda::fwd_,
// heuristics.h pool_by_decode: torch_kda.kda gives the same bits with and
// without a gradient, so kda::fwd and kda::_fwd_checkpointed always take the
// chunked kernels). chunk_states and records: kept for the backward
// (kda._fwd_checkpointed); the decode kernel keeps none.
void forward_served(const char* op, const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& g, const at::Tensor& beta, const at::Tensor& A_log, const at::Tensor& dt_bias,
                    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
                    const at::Tensor& out, const std::optional<at::Tensor>& final_state,
                    const at::Tensor& chunk_states = at::Tensor(), const at::Tensor& records = at::Tensor(),
                    bool decode_short_requests = false);

// The decode kernel (pool.cu) over params' requests, each from its initial
// state (zeros where undefined) to its final state (not stored where
// undefined), both [N, H, V, K] contiguous in the states' dtype.
void decode_forward(const FwdParams& params, const at::Tensor& initial_state, const at::Tensor& final_state,
                    bool state_fp32, cudaStream_t stream);

}  // namespace kda::cuda
