// The token-parallel parts of KDA, written with ATen ops in the accumulation
// dtype (so any device runs them): L2 normalisation, the gate, the beta
// sigmoid, and the chain rule back through them. The CPU kernels and the
// chunked backward (testing/chunked_backward.h) share them.
#pragma once

#include "kda.h"

namespace kda {

// fp64 inputs are computed in fp64, everything else in fp32.
inline at::ScalarType accumulation_dtype(const Problem& p) {
  return p.input_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// An optional tensor in the accumulation dtype, contiguous; undefined when absent.
inline at::Tensor to_acc(const std::optional<at::Tensor>& t, at::ScalarType acc) {
  return t.has_value() ? t->to(acc).contiguous() : at::Tensor();
}

// Everything the recurrence reads, in the accumulation dtype, contiguous.
struct Activations {
  at::Tensor qn, kn;          // [B, T, H, K] L2-normalised q and k, one per value head
  at::Tensor qn_heads, kn_heads;  // [B, T, H_qk, K] the same per query/key head (qn, kn where H_qk = H)
  at::Tensor q_rnorm, k_rnorm;  // [B, T, H_qk, 1] 1 / sqrt(sum(x^2) + eps)
  at::Tensor v;               // [B, T, H, V]
  at::Tensor lam;             // [B, T, H, K] log decay, <= 0
  at::Tensor alpha;           // [B, T, H, K] exp(lam)
  at::Tensor gate_arg;        // bounded: exp(A_log) (g + dt_bias); softplus: g + dt_bias
  at::Tensor beta;            // [B, T, H] sigmoid(beta logits)
};

Activations compute_activations(
    const Problem& p,
    at::ScalarType acc,
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& g,
    const at::Tensor& beta,
    const at::Tensor& A_log,
    const at::Tensor& dt_bias);

// Gradients with respect to the activations (accumulation dtype); the decay's
// with respect to the log decay lam.
struct ActivationGrads {
  at::Tensor dqn, dkn, dv, dlam, dbeta;
};

// Chain rule from activation gradients to the op's inputs; writes into `o`.
void backprop_activations(
    const Problem& p,
    const Activations& a,
    const ActivationGrads& d,
    const at::Tensor& A_log,
    BackwardOutputs& o);

}  // namespace kda
