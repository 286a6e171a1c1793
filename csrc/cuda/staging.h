// What every CUDA op does on the host before it enqueues a kernel
// (staging.cpp): the argument checks with the CUDA kernels' limits, the
// sequence offsets, and the inputs as the kernels read them.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>

#include "cuda/params.h"
#include "kda.h"

namespace kda::cuda {

// The shared argument checks (checks.cpp), then what the CUDA kernels support
// (bf16 inputs, lower_bound in [-5, 0) or None, ...), then under
// TORCH_KDA_CHECK=1 the contents of cu_seqlens, A_log and a precomputed gate's g
// (a device sync).
Problem check_all(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& g, const at::Tensor& beta, const at::Tensor& A_log, const at::Tensor& dt_bias,
                  std::optional<double> scale, std::optional<double> lower_bound,
                  const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens);

// Sequence and chunk offsets of a varlen batch, built on the device by one
// kernel (boundaries.cu: cu_seqlens clamped into [0, tokens] and made
// non-decreasing, so a malformed one gives wrong numbers, never an access out
// of bounds). A fixed-length batch needs none (params.h). num_slots: the
// workspace's capacity in chunks (chunk_slots, kda.h).
struct Boundaries {
  at::Tensor offsets;  // [3, N + 1] int64: seq, chunks, then seq_order; undefined for fixed length
  int64_t num_slots = 0;
};

// Raises, naming `op`, where the grids would not fit one launch; checked
// before anything is enqueued, so a rejected call leaves no kernel behind.
Boundaries sequence_boundaries(const char* op, const Problem& p, const at::Tensor& q,
                               const std::optional<at::Tensor>& cu_seqlens, cudaStream_t stream);

// Whether t starts on a 16-byte boundary: the kernels move 16-byte vectors.
bool aligned16(const at::Tensor& t);

// t as a kernel reads it: contiguous and 16-byte aligned (a copy only where it
// is not); an undefined tensor stays undefined.
at::Tensor staged16(const at::Tensor& t);

// grad_out as the backward sweep reads it: bf16 or fp32 as given (other dtypes
// in fp32), contiguous and 16-byte aligned.
at::Tensor sweep_grad_out(const at::Tensor& grad_out);

// Value heads per query/key head (FwdParams::group).
int64_t value_head_group(const Problem& p);

// The gate's fields of fp (params.h): which formula, if any, and which
// factoring the kernels take for p's gate, and g's dtype.
void set_gate(FwdParams& fp, const Problem& p, const at::Tensor& g);

// t's fp32 data, or null where t is undefined (A_log and dt_bias of a precomputed gate).
const float* float_data_or_null(const at::Tensor& t);

// A call's inputs made contiguous (copies only where the caller's tensors are
// not; v also 16-byte aligned, as K2 copies it in 16-byte pieces) and the
// FwdParams over them, as one pass over all the call's chunk slots; the caller
// adds the workspace, the states and the outputs.
struct CallInputs {
  at::Tensor q, k, v, g, beta, A_log, dt_bias;
  FwdParams params;
};

CallInputs call_inputs(const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& g, const at::Tensor& beta, const at::Tensor& A_log,
                       const at::Tensor& dt_bias, const Boundaries& bounds);

}  // namespace kda::cuda
