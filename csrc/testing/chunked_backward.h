// The recurrence's backward over 16-token chunks, written with ATen ops, so it
// runs on whatever device its tensors are on: a check of the chunked form's
// backward, which the CUDA kernels compute, against the token-by-token CPU
// kernel (kda_testing::bwd_chunked).
// The math is torch_kda.reference.kda_chunked_backward's, batched over every
// (sequence, head) at once and sequential over chunks.
#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include "kda.h"

namespace kda {

// Gradients with respect to the recurrence's inputs, in their dtype and layout:
// dqn, dkn, dlam [B, T, H, K]; dv [B, T, H, V]; dbeta [B, T, H] (of sigmoid(beta));
// dinit [N, H, V, K], undefined without an initial state.
struct ChunkedGrads {
  at::Tensor dqn, dkn, dv, dlam, dbeta, dinit;
};

// qn, kn, lam [B, T, H, K], v [B, T, H, V], beta [B, T, H] (after the sigmoid),
// init [N, H, V, K] or undefined, grad_out like v, grad_final like init or
// undefined; all in one floating dtype on one device. offsets: for a varlen
// batch, the N + 1 token offsets of the sequences in the flattened B * T axis,
// on the host; absent for a fixed-length batch (N = B sequences of T tokens,
// and then nothing is read on the host).
ChunkedGrads chunked_recurrence_backward(const std::optional<std::vector<int64_t>>& offsets, double scale,
                                         const at::Tensor& qn, const at::Tensor& kn, const at::Tensor& v,
                                         const at::Tensor& lam, const at::Tensor& beta, const at::Tensor& init,
                                         const at::Tensor& grad_out, const at::Tensor& grad_final);

// kda::bwd's outputs by chunked_recurrence_backward, after the caller's checks:
// activations in the accumulation dtype (fp64 for fp64 inputs, else fp32),
// the chunked recurrence backward, the chain rule back to the inputs.
BackwardTuple backward_by_chunks(const char* op, const Problem& p, const at::Tensor& grad_out,
                                 const std::optional<at::Tensor>& grad_final_state, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                 const at::Tensor& beta, const at::Tensor& A_log, const at::Tensor& dt_bias,
                                 const std::optional<at::Tensor>& initial_state,
                                 const std::optional<at::Tensor>& cu_seqlens);

}  // namespace kda
