// Shape-only kernels for the Meta key: they serve FakeTensor, torch.compile
// (dynamic shapes included) and torch.export. They run the same argument
// checks as the real kernels, on SymInt shapes, and allocate outputs through
// the same functions, so shapes, dtypes and strides agree by construction.
#include <torch/library.h>

#include "checkpoints.h"
#include "kda.h"

namespace kda::meta {
namespace {

using at::Tensor;
using std::optional;

std::tuple<Tensor, Tensor> fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                               const optional<Tensor>& A_log_, const optional<Tensor>& dt_bias_, optional<double> scale,
                               optional<double> lower_bound, const optional<Tensor>& initial_state,
                               bool output_final_state, const optional<Tensor>& cu_seqlens) {
  const Tensor A_log = or_undefined(A_log_), dt_bias = or_undefined(dt_bias_);
  Problem p = check_forward_args("kda.fwd", q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state,
                                 cu_seqlens);
  ForwardOutputs o = allocate_forward_outputs(p, q, output_final_state);
  return {o.out, o.final_state};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> fwd_checkpointed(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                                    const Tensor& beta,
                                                    const optional<Tensor>& A_log_, const optional<Tensor>& dt_bias_,
                                                    optional<double> scale, optional<double> lower_bound,
                                                    const optional<Tensor>& initial_state, bool output_final_state,
                                                    const optional<Tensor>& cu_seqlens, c10::string_view save) {
  const Tensor A_log = or_undefined(A_log_), dt_bias = or_undefined(dt_bias_);
  Problem p = check_forward_args("kda.fwd", q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state,
                                 cu_seqlens);
  const Save what = parse_save("kda.fwd", save);
  ForwardOutputs o = allocate_forward_outputs(p, q, output_final_state);
  SavedForBackward saved = allocate_saved(p, q, cu_seqlens.has_value(), what);
  return {o.out, o.final_state, saved.checkpoints, saved.records};
}

void fwd_inplace(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                 const optional<Tensor>& A_log_, const optional<Tensor>& dt_bias_,
                 at::Tensor& out, const optional<Tensor>& final_state,
                 optional<double> scale, optional<double> lower_bound, const optional<Tensor>& initial_state,
                 const optional<Tensor>& cu_seqlens) {
  const Tensor A_log = or_undefined(A_log_), dt_bias = or_undefined(dt_bias_);
  Problem p = check_forward_args("kda.fwd_", q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state,
                                 cu_seqlens);
  check_inplace_buffers("kda.fwd_", p, q, out, final_state, initial_state);
}

void fwd_pool(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
              const optional<Tensor>& A_log_, const optional<Tensor>& dt_bias_,
              Tensor& state_pool, const Tensor& state_indices, Tensor& out,
              optional<double> scale, optional<double> lower_bound, const optional<Tensor>& cu_seqlens,
              const optional<Tensor>& num_accepted_tokens) {
  const Tensor A_log = or_undefined(A_log_), dt_bias = or_undefined(dt_bias_);
  Problem p = check_forward_args("kda.fwd_pool_", q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, std::nullopt,
                                 cu_seqlens);
  check_pool_args("kda.fwd_pool_", p, q, cu_seqlens.has_value(), state_pool, state_indices, num_accepted_tokens, out);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> bwd(
    const Tensor& grad_out, const optional<Tensor>& grad_final_state, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& g, const Tensor& beta,
    const optional<Tensor>& A_log_, const optional<Tensor>& dt_bias_,
    optional<double> scale, optional<double> lower_bound, const optional<Tensor>& initial_state,
    const optional<Tensor>& cu_seqlens, const optional<Tensor>& checkpoints, const optional<Tensor>& records) {
  const Tensor A_log = or_undefined(A_log_), dt_bias = or_undefined(dt_bias_);
  Problem p = check_forward_args("kda.bwd", q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state,
                                 cu_seqlens);
  check_backward_grads("kda.bwd", p, q, grad_out, grad_final_state);
  check_saved("kda.bwd", p, cu_seqlens.has_value(), q, checkpoints, records);
  BackwardOutputs o = allocate_backward_outputs(p, q, k, v, g, beta, A_log, dt_bias, initial_state);
  return {o.dq, o.dk, o.dv, o.dg, o.dbeta, o.dA_log, o.ddt_bias, o.dinitial_state};
}

}  // namespace

TORCH_LIBRARY_IMPL(kda, Meta, m) {
  m.impl("fwd", &fwd);
  m.impl("fwd_", &fwd_inplace);
  m.impl("fwd_pool_", &fwd_pool);
  m.impl("_fwd_checkpointed", &fwd_checkpointed);
  m.impl("bwd", &bwd);
}

}  // namespace kda::meta
