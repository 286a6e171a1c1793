// The token-parallel parts of KDA on the CPU, written with ATen ops in the
// accumulation dtype: L2 normalisation, the gate, the beta sigmoid, and the
// chain rule back through them. The recurrence itself is in recurrence.h.
#pragma once

#include "kda.h"

namespace kda::cpu {

// Everything the recurrence reads, in the accumulation dtype, contiguous.
struct Activations {
  at::Tensor qn, kn;          // [B, T, H, K] L2-normalised q and k
  at::Tensor q_rnorm, k_rnorm;  // [B, T, H, 1] 1 / sqrt(sum(x^2) + eps)
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

// Gradients with respect to the activations, as the recurrence's backward
// produces them (accumulation dtype).
struct ActivationGrads {
  at::Tensor dqn, dkn, dv, dalpha, dbeta;
};

// Chain rule from activation gradients to the op's inputs; writes into `o`.
void backprop_activations(
    const Problem& p,
    const Activations& a,
    const ActivationGrads& d,
    const at::Tensor& A_log,
    BackwardOutputs& o);

}  // namespace kda::cpu
