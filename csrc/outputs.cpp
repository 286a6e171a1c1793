// Output allocation shared by the real kernels and the Meta kernels.
#include "kda.h"

namespace kda {

ForwardOutputs allocate_forward_outputs(const Problem& p, const at::Tensor& q, bool output_final_state) {
  ForwardOutputs o;
  o.out = at::empty_symint({p.B, p.T, p.H, p.V}, q.options());
  if (output_final_state) {
    o.final_state = at::empty_symint({p.N, p.H, p.V, p.K}, q.options().dtype(p.state_dtype));
  } else {
    o.final_state = at::empty({0}, q.options().dtype(p.state_dtype));
  }
  return o;
}

BackwardOutputs allocate_backward_outputs(
    const Problem& p,
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& g,
    const at::Tensor& beta,
    const at::Tensor& A_log,
    const at::Tensor& dt_bias,
    const std::optional<at::Tensor>& initial_state) {
  auto like = [](const at::Tensor& t) { return at::empty_symint(t.sym_sizes(), t.options()); };
  BackwardOutputs o;
  o.dq = like(q);
  o.dk = like(k);
  o.dv = like(v);
  o.dg = like(g);
  o.dbeta = like(beta);
  // A precomputed gate has no A_log or dt_bias: their gradients are empty.
  const auto param_grad = [&](const at::Tensor& t) {
    return t.defined() ? like(t) : at::empty({0}, q.options().dtype(at::kFloat));
  };
  o.dA_log = param_grad(A_log);
  o.ddt_bias = param_grad(dt_bias);
  if (initial_state.has_value()) {
    o.dinitial_state = like(*initial_state);
  } else {
    o.dinitial_state = at::empty({0}, q.options().dtype(p.state_dtype));
  }
  return o;
}

}  // namespace kda
