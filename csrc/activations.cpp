#include "activations.h"

namespace kda {
namespace {

// Returns (x * r, r) with r = 1 / sqrt(sum(x^2) + eps) over the last dim.
std::pair<at::Tensor, at::Tensor> l2_normalize(const at::Tensor& x) {
  at::Tensor r = at::rsqrt(x.square().sum(-1, /*keepdim=*/true) + kNormEps);
  return {(x * r).contiguous(), r};
}

// Backward of l2_normalize: (dxn - xn (xn . dxn)) * r.
at::Tensor l2_normalize_backward(const at::Tensor& xn, const at::Tensor& r, const at::Tensor& dxn) {
  return (dxn - xn * (xn * dxn).sum(-1, /*keepdim=*/true)) * r;
}

// Grouped value heads: query/key head h serves value heads h G .. h G + G - 1.
int64_t group_size(const Problem& p) {
  return concrete(p.H) / concrete(p.H_qk);
}

// [B, T, H_qk, K] -> [B, T, H, K], each head repeated for its group (a copy:
// the recurrence reads one head's rows contiguously).
at::Tensor to_value_heads(const at::Tensor& x, int64_t group) {
  return group == 1 ? x : x.repeat_interleave(group, /*dim=*/2).contiguous();
}

// The gradient of to_value_heads: a group's value heads summed into its query/key head.
at::Tensor to_qk_heads(const at::Tensor& dx, int64_t group) {
  if (group == 1) {
    return dx;
  }
  return dx.unflatten(2, {dx.size(2) / group, group}).sum(3);
}

}  // namespace

Activations compute_activations(
    const Problem& p,
    at::ScalarType acc,
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& g,
    const at::Tensor& beta,
    const at::Tensor& A_log,
    const at::Tensor& dt_bias) {
  Activations a;
  std::tie(a.qn_heads, a.q_rnorm) = l2_normalize(q.to(acc));
  std::tie(a.kn_heads, a.k_rnorm) = l2_normalize(k.to(acc));
  a.qn = to_value_heads(a.qn_heads, group_size(p));
  a.kn = to_value_heads(a.kn_heads, group_size(p));
  a.v = v.to(acc).contiguous();
  a.beta = at::sigmoid(beta.to(acc)).contiguous();

  const int64_t H = concrete(p.H);
  const int64_t K = concrete(p.K);
  if (p.precomputed_gate) {
    a.lam = g.to(acc).contiguous();
    a.alpha = at::exp(a.lam).contiguous();
    return a;
  }
  at::Tensor A = at::exp(A_log.to(acc)).view({1, 1, H, 1});
  at::Tensor x = g.to(acc) + dt_bias.to(acc).view({1, 1, H, K});
  if (p.gate == Gate::kBounded) {
    a.gate_arg = A * x;
    a.lam = (p.lower_bound * at::sigmoid(a.gate_arg)).contiguous();
  } else {
    a.gate_arg = x;
    // log1p(exp(x)) written stably; torch's softplus switches to x above 20,
    // which would put a kink into the gradient.
    at::Tensor softplus = at::clamp_min(x, 0) + at::log1p(at::exp(-x.abs()));
    a.lam = (-A * softplus).contiguous();
  }
  a.alpha = at::exp(a.lam).contiguous();
  return a;
}

void backprop_activations(
    const Problem& p,
    const Activations& a,
    const ActivationGrads& d,
    const at::Tensor& A_log,
    BackwardOutputs& o) {
  o.dq.copy_(l2_normalize_backward(a.qn_heads, a.q_rnorm, to_qk_heads(d.dqn, group_size(p))));
  o.dk.copy_(l2_normalize_backward(a.kn_heads, a.k_rnorm, to_qk_heads(d.dkn, group_size(p))));
  o.dv.copy_(d.dv);
  o.dbeta.copy_(d.dbeta * a.beta * (1 - a.beta));

  const at::Tensor& dlam = d.dlam;
  if (p.precomputed_gate) {
    o.dg.copy_(dlam);
    return;
  }
  const int64_t H = concrete(p.H);
  at::Tensor A = at::exp(A_log.to(a.lam.scalar_type())).view({1, 1, H, 1});
  at::Tensor dx;       // gradient w.r.t. g + dt_bias
  at::Tensor dA_term;  // per element contribution to dA_log
  if (p.gate == Gate::kBounded) {
    at::Tensor s = at::sigmoid(a.gate_arg);
    at::Tensor darg = dlam * p.lower_bound * s * (1 - s);
    dx = darg * A;
    dA_term = darg * a.gate_arg;
  } else {
    dx = dlam * (-A) * at::sigmoid(a.gate_arg);
    dA_term = dlam * a.lam;
  }
  o.dg.copy_(dx);
  o.ddt_bias.copy_(dx.sum(at::IntArrayRef{0, 1}));
  o.dA_log.copy_(dA_term.sum(at::IntArrayRef{0, 1, 3}));
}

}  // namespace kda
