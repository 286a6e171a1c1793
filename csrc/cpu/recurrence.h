// The delta-rule recurrence on the CPU, token by token, one (sequence, head)
// per task. Inputs are the activations (normalised q and k, decays, beta) in
// the accumulation dtype T (float or double), laid out [tokens, H, *] where
// tokens is the flattened B*T axis and `offsets` bounds each sequence in it.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace kda::cpu {

template <typename T>
struct RecurrenceArgs {
  int64_t H = 0, K = 0, V = 0;
  std::vector<int64_t> offsets;  // N + 1 token offsets
  T scale = 1;
  const T* qn = nullptr;     // [tokens, H, K]
  const T* kn = nullptr;     // [tokens, H, K]
  const T* v = nullptr;      // [tokens, H, V]; null in the forward: zeros
  const T* alpha = nullptr;  // [tokens, H, K]
  const T* beta = nullptr;   // [tokens, H]
  const T* initial_state = nullptr;  // [N, H, V, K], null means zeros
  // The forward only: sequences to leave out (null: none), whose out rows are
  // zeros and whose final state is not written; and a function that receives
  // the state (as S[k][v], K x V) after token t (counted from the sequence's
  // start) of sequence n and head h (null: none). Called from parallel tasks,
  // one (sequence, head) each.
  const bool* skip = nullptr;  // [N]
  std::function<void(int64_t n, int64_t h, int64_t t, const T* S)> after_token;
};

// Writes, when non-null, out [tokens, H, V] and final_state [N, H, V, K].
template <typename T>
void recurrence_forward(const RecurrenceArgs<T>& a, T* out, T* final_state);

template <typename T>
struct RecurrenceGrads {
  const T* grad_out = nullptr;          // [tokens, H, V]
  const T* grad_final_state = nullptr;  // [N, H, V, K], null means zeros
  T* dqn = nullptr;                     // [tokens, H, K]
  T* dkn = nullptr;                     // [tokens, H, K]
  T* dv = nullptr;                      // [tokens, H, V]
  T* dalpha = nullptr;                  // [tokens, H, K]
  T* dbeta = nullptr;                   // [tokens, H]
  T* dinitial_state = nullptr;          // [N, H, V, K], may be null
};

template <typename T>
void recurrence_backward(const RecurrenceArgs<T>& a, const RecurrenceGrads<T>& g);

}  // namespace kda::cpu
