// CPU kernels of kda::fwd, kda::fwd_ and kda::bwd. They compute in float64
// for float64 inputs (so gradcheck works) and in float32 otherwise.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "activations.h"
#include "checkpoints.h"
#include "cpu/recurrence.h"
#include "cpu/recurrence_args.h"
#include "kda.h"
#include "segments.h"
#include "testing/hook.h"

namespace kda::cpu {
namespace {

using at::Tensor;
using std::optional;

// One task per (sequence, head) leaves threads idle where the pairs are fewer
// than the threads; segments (segments.h) cost about 2.3 passes' work, so they
// pay from three a pair, with the longest sequence at least this long a
// segment. The choice follows the thread count, so the low bits do too.
constexpr int64_t kMinSegmentsThatPay = 3;
constexpr int64_t kMinSegmentTokens = 1024;

int64_t segments_per_sequence(const std::vector<int64_t>& offsets, int64_t H) {
  if (const optional<int64_t> segments = forced().segments) {
    return *segments;
  }
  const int64_t N = static_cast<int64_t>(offsets.size()) - 1;
  int64_t longest = 0;
  for (int64_t n = 0; n < N; ++n) {
    longest = std::max(longest, offsets[n + 1] - offsets[n]);
  }
  const int64_t P = std::min(at::get_num_threads() / std::max<int64_t>(N * H, 1), longest / kMinSegmentTokens);
  return P >= kMinSegmentsThatPay ? P : 1;
}

// The forward over P segments a sequence (segments.h): pass 1 their end
// states from zero (the first segment's from the initial state), pass 2 their
// transition maps, the scan, then pass 3 from the true start states.
template <typename T>
void segmented_forward(const Problem& p, const Activations& a, const std::vector<int64_t>& offsets,
                       const Tensor& init, int64_t P, Tensor& out, Tensor& final_state) {
  const int64_t N = concrete(p.N), H = concrete(p.H), K = concrete(p.K), V = concrete(p.V);
  const Tensor seq = at::tensor(offsets, at::kLong);
  const Tensor seg = segment_offsets(seq, P);
  std::vector<int64_t> seg_offsets(seg.data_ptr<int64_t>(), seg.data_ptr<int64_t>() + seg.numel());
  const auto options = a.v.options();

  const Tensor first_starts = first_segment_states(init, N, P, H, V, K, options);
  const Tensor ends = at::empty({N * P, H, V, K}, options);
  recurrence_forward<T>(recurrence_args<T>(p, a, seg_offsets, first_starts), nullptr, ends.data_ptr<T>());

  const Tensor identity = identity_states(N, P, H, K, options);
  RecurrenceArgs<T> transitions = recurrence_args<T>(p, a, seg_offsets, identity);
  transitions.V = K;
  transitions.v = nullptr;  // v = 0
  const Tensor maps = at::empty({N * P, H, K, K}, options);
  recurrence_forward<T>(transitions, nullptr, maps.data_ptr<T>());

  const Tensor starts = segment_start_states(maps, ends, init, P);
  const Tensor seg_final = final_state.defined() ? at::empty({N * P, H, V, K}, options) : Tensor();
  recurrence_forward<T>(recurrence_args<T>(p, a, std::move(seg_offsets), starts), out.data_ptr<T>(),
                        seg_final.defined() ? seg_final.data_ptr<T>() : nullptr);
  if (final_state.defined()) {
    final_state.copy_(last_segment_states(seg_final, P));
  }
}

// Computes the forward and writes it into `out` and, if given, `final_state`.
// Results go through temporaries, so the destinations may be any strided
// tensors and may even overlap the inputs.
void forward_into(const char* op, const Problem& p, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& g, const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias,
                  const optional<Tensor>& initial_state, const optional<Tensor>& cu_seqlens, const Tensor& out,
                  const optional<Tensor>& final_state) {
  std::vector<int64_t> offsets = sequence_offsets(op, p, cu_seqlens);
  const at::ScalarType acc = accumulation_dtype(p);
  Activations a = compute_activations(p, acc, q, k, v, g, beta, A_log, dt_bias);
  Tensor init = to_acc(initial_state, acc);
  Tensor out_acc = at::empty(out.sizes(), a.v.options());
  Tensor final_acc;
  if (final_state.has_value()) {
    final_acc = at::empty(final_state->sizes(), a.v.options());
  }
  const int64_t P = segments_per_sequence(offsets, concrete(p.H));
  AT_DISPATCH_FLOATING_TYPES(acc, "kda_cpu_forward", [&] {
    if (P > 1) {
      segmented_forward<scalar_t>(p, a, offsets, init, P, out_acc, final_acc);
    } else {
      recurrence_forward<scalar_t>(recurrence_args<scalar_t>(p, a, std::move(offsets), init),
                                   out_acc.data_ptr<scalar_t>(),
                                   final_acc.defined() ? final_acc.data_ptr<scalar_t>() : nullptr);
    }
  });
  out.copy_(out_acc);
  if (final_state.has_value()) {
    final_state->copy_(final_acc);
  }
}

std::tuple<Tensor, Tensor> fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                               const optional<Tensor>& A_log_, const optional<Tensor>& dt_bias_, optional<double> scale,
                               optional<double> lower_bound, const optional<Tensor>& initial_state,
                               bool output_final_state, const optional<Tensor>& cu_seqlens) {
  const Tensor A_log = or_undefined(A_log_), dt_bias = or_undefined(dt_bias_);
  const char* op = "kda.fwd";
  Problem p = check_cpu_args(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  ForwardOutputs o = allocate_forward_outputs(p, q, output_final_state);
  forward_into(op, p, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, o.out,
               output_final_state ? optional<Tensor>(o.final_state) : std::nullopt);
  return {o.out, o.final_state};
}

void fwd_inplace(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                 const optional<Tensor>& A_log_, const optional<Tensor>& dt_bias_,
                 at::Tensor& out, const optional<Tensor>& final_state,
                 optional<double> scale, optional<double> lower_bound, const optional<Tensor>& initial_state,
                 const optional<Tensor>& cu_seqlens) {
  const Tensor A_log = or_undefined(A_log_), dt_bias = or_undefined(dt_bias_);
  const char* op = "kda.fwd_";
  Problem p = check_cpu_args(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  check_inplace_buffers(op, p, q, out, final_state, initial_state);
  check_outputs_disjoint(op, out, final_state);
  forward_into(op, p, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> bwd(
    const Tensor& grad_out, const optional<Tensor>& grad_final_state, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& g, const Tensor& beta,
    const optional<Tensor>& A_log_, const optional<Tensor>& dt_bias_,
    optional<double> scale, optional<double> lower_bound, const optional<Tensor>& initial_state,
    const optional<Tensor>& cu_seqlens, const optional<Tensor>& checkpoints, const optional<Tensor>& records) {
  const Tensor A_log = or_undefined(A_log_), dt_bias = or_undefined(dt_bias_);
  const char* op = "kda.bwd";
  Problem p = check_cpu_args(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  check_backward_grads(op, p, q, grad_out, grad_final_state);
  // Checked as on CUDA, then not needed: this backward keeps every state it uses.
  check_saved(op, p, cu_seqlens.has_value(), q, checkpoints, records);
  BackwardOutputs o = allocate_backward_outputs(p, q, k, v, g, beta, A_log, dt_bias, initial_state);

  std::vector<int64_t> offsets = sequence_offsets(op, p, cu_seqlens);
  const at::ScalarType acc = accumulation_dtype(p);
  Activations a = compute_activations(p, acc, q, k, v, g, beta, A_log, dt_bias);
  Tensor init = to_acc(initial_state, acc);
  Tensor gout = grad_out.to(acc).contiguous();
  Tensor gfinal = to_acc(grad_final_state, acc);
  ActivationGrads d;
  d.dqn = at::empty_like(a.qn);
  d.dkn = at::empty_like(a.kn);
  d.dv = at::empty_like(a.v);
  Tensor dalpha = at::empty_like(a.alpha);  // the token kernel's: w.r.t. exp(lam)
  d.dbeta = at::empty_like(a.beta);
  Tensor dinit = init.defined() ? at::empty_like(init) : Tensor();
  AT_DISPATCH_FLOATING_TYPES(acc, "kda_cpu_backward", [&] {
    RecurrenceGrads<scalar_t> r;
    r.grad_out = gout.data_ptr<scalar_t>();
    r.grad_final_state = gfinal.defined() ? gfinal.data_ptr<scalar_t>() : nullptr;
    r.dqn = d.dqn.data_ptr<scalar_t>();
    r.dkn = d.dkn.data_ptr<scalar_t>();
    r.dv = d.dv.data_ptr<scalar_t>();
    r.dalpha = dalpha.data_ptr<scalar_t>();
    r.dbeta = d.dbeta.data_ptr<scalar_t>();
    r.dinitial_state = dinit.defined() ? dinit.data_ptr<scalar_t>() : nullptr;
    recurrence_backward<scalar_t>(recurrence_args<scalar_t>(p, a, std::move(offsets), init), r);
  });
  d.dlam = dalpha * a.alpha;
  backprop_activations(p, a, d, A_log, o);
  if (dinit.defined()) {
    o.dinitial_state.copy_(dinit);
  }
  return {o.dq, o.dk, o.dv, o.dg, o.dbeta, o.dA_log, o.ddt_bias, o.dinitial_state};
}

}  // namespace

TORCH_LIBRARY_IMPL(kda, CPU, m) {
  m.impl("fwd", &fwd);
  m.impl("fwd_", &fwd_inplace);
  m.impl("bwd", &bwd);
}

}  // namespace kda::cpu
