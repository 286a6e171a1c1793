// CPU kernel of kda::fwd_pool_, the state-pool call for serving: each request
// starts from a slot of the pool and writes its state back to the pool, in
// place. The token recurrence is the forward's (recurrence.h); the pool is
// read before anything is written, so the result does not depend on the order
// in which the (request, head) tasks run.
#include <torch/library.h>

#include <algorithm>
#include <memory>

#include "activations.h"
#include "cpu/recurrence.h"
#include "cpu/recurrence_args.h"
#include "kda.h"

namespace kda::cpu {
namespace {

using at::Tensor;
using std::optional;

// S[k][v] (K x V, the recurrence's layout) into one slot's head at `dst`,
// [V][K] in the pool's dtype.
template <typename T>
void store_to_pool(const T* S, void* dst, at::ScalarType dtype, int64_t K, int64_t V) {
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "kda_pool_store", [&] {
    auto* d = static_cast<scalar_t*>(dst);
    for (int64_t v = 0; v < V; ++v) {
      for (int64_t k = 0; k < K; ++k) {
        d[v * K + k] = static_cast<scalar_t>(S[k * V + v]);
      }
    }
  });
}

void fwd_pool(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
              const optional<Tensor>& A_log_, const optional<Tensor>& dt_bias_,
              Tensor& state_pool, const Tensor& state_indices, Tensor& out,
              optional<double> scale, optional<double> lower_bound, const optional<Tensor>& cu_seqlens,
              const optional<Tensor>& num_accepted_tokens) {
  const Tensor A_log = or_undefined(A_log_), dt_bias = or_undefined(dt_bias_);
  const char* op = "kda.fwd_pool_";
  Problem p = check_cpu_args(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, std::nullopt, cu_seqlens);
  check_pool_args(op, p, q, cu_seqlens.has_value(), state_pool, state_indices, num_accepted_tokens, out);
  check_pool_disjoint(op, out, state_pool);
  const at::ScalarType acc = accumulation_dtype(p);
  const int64_t slots = state_pool.size(0);
  check_pool_indices(op, state_indices, num_accepted_tokens, slots);
  std::vector<int64_t> offsets = sequence_offsets(op, p, cu_seqlens);

  const int64_t N = concrete(p.N), H = concrete(p.H), K = concrete(p.K), V = concrete(p.V);
  const bool speculative = num_accepted_tokens.has_value();
  const Tensor idx = state_indices.to(at::kLong).contiguous();
  const int64_t* index = idx.data_ptr<int64_t>();
  const int64_t t_max = speculative ? idx.size(1) : 1;
  std::vector<int64_t> read_slot(N);
  if (speculative) {
    const Tensor accepted = num_accepted_tokens->to(at::kLong).contiguous();
    for (int64_t n = 0; n < N; ++n) {
      read_slot[n] = index[n * t_max + accepted.data_ptr<int64_t>()[n] - 1];
    }
  } else {
    std::copy(index, index + N, read_slot.begin());
  }
  // A negative start slot marks a padding row: nothing read, nothing written, out zero.
  std::unique_ptr<bool[]> skip(new bool[std::max<int64_t>(N, 1)]);
  Tensor init = at::zeros({N, H, V, K}, q.options().dtype(acc));
  for (int64_t n = 0; n < N; ++n) {
    skip[n] = read_slot[n] < 0;
    if (!skip[n]) {
      init[n].copy_(state_pool[read_slot[n]]);
    }
  }

  Activations a = compute_activations(p, acc, q, k, v, g, beta, A_log, dt_bias);
  Tensor out_acc = at::empty(out.sizes(), a.v.options());
  Tensor final_acc = speculative ? Tensor() : at::empty({N, H, V, K}, a.v.options());
  // Slot s, head h of the pool: slot_bytes * s + head_bytes * h from its start.
  auto* pool_base = static_cast<unsigned char*>(state_pool.data_ptr());
  const int64_t slot_bytes = state_pool.stride(0) * state_pool.element_size();
  const int64_t head_bytes = V * K * state_pool.element_size();
  AT_DISPATCH_FLOATING_TYPES(acc, "kda_cpu_pool", [&] {
    RecurrenceArgs<scalar_t> r = recurrence_args<scalar_t>(p, a, std::move(offsets), init);
    r.skip = skip.get();
    if (speculative) {
      // The state after token t goes to slot state_indices[n, t] (negative: none);
      // tokens past T_max update no slot.
      r.after_token = [&](int64_t n, int64_t h, int64_t t, const scalar_t* S) {
        const int64_t slot = t < t_max ? index[n * t_max + t] : -1;
        if (slot >= 0) {
          store_to_pool(S, pool_base + slot * slot_bytes + h * head_bytes, state_pool.scalar_type(), K, V);
        }
      };
    }
    recurrence_forward<scalar_t>(r, out_acc.data_ptr<scalar_t>(),
                                 final_acc.defined() ? final_acc.data_ptr<scalar_t>() : nullptr);
  });
  out.copy_(out_acc);
  if (!speculative) {
    for (int64_t n = 0; n < N; ++n) {
      if (!skip[n]) {
        state_pool[read_slot[n]].copy_(final_acc[n]);
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(kda, CPU, m) {
  m.impl("fwd_pool_", &fwd_pool);
}

}  // namespace kda::cpu
