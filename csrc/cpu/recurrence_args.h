// What the CPU kernels (ops_cpu.cpp, pool_cpu.cpp) share before the recurrence:
// the argument checks the CPU can afford, and the recurrence's arguments over
// the activations.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "activations.h"
#include "cpu/recurrence.h"
#include "kda.h"

namespace kda::cpu {

// The shared argument checks, then the values the CPU can read at no cost:
// exp(A_log) must be finite in the accumulation dtype; a precomputed gate's g
// must be a log decay within its promised bound.
inline Problem check_cpu_args(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& g, const at::Tensor& beta, const at::Tensor& A_log,
                              const at::Tensor& dt_bias, std::optional<double> scale,
                              std::optional<double> lower_bound, const std::optional<at::Tensor>& initial_state,
                              const std::optional<at::Tensor>& cu_seqlens) {
  Problem p = check_forward_args(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  check_A_log_values(op, A_log, accumulation_dtype(p) == at::kDouble);
  check_precomputed_gate_values(op, p, g);
  return p;
}

template <typename T>
RecurrenceArgs<T> recurrence_args(const Problem& p, const Activations& a, std::vector<int64_t> offsets,
                                  const at::Tensor& initial_state) {
  RecurrenceArgs<T> r;
  r.H = concrete(p.H);
  r.K = concrete(p.K);
  r.V = concrete(p.V);
  r.offsets = std::move(offsets);
  r.scale = static_cast<T>(resolved_scale(p));
  r.qn = a.qn.data_ptr<T>();
  r.kn = a.kn.data_ptr<T>();
  r.v = a.v.data_ptr<T>();
  r.alpha = a.alpha.data_ptr<T>();
  r.beta = a.beta.data_ptr<T>();
  r.initial_state = initial_state.defined() ? initial_state.data_ptr<T>() : nullptr;
  return r;
}

}  // namespace kda::cpu
