#include "chunked_backward.h"

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "activations.h"

namespace kda {
namespace {

using at::Tensor;
using std::optional;

constexpr int64_t C = 16;  // tokens per chunk

// One chunk of every (sequence, head), batched: [BH, C, *].
struct Chunk {
  Tensor G, D, P, A, Aqk, E, Ed, Kg, Qg, Kd, gl, IA;
};

struct Masks {
  Tensor strict, incl, excl4, eye;  // [C, C]; excl4: [1, C, C, 1], true above the diagonal
};

Chunk chunk_terms(const Tensor& Qc, const Tensor& Kc, const Tensor& lamc, const Tensor& bc, double scale,
                  const Masks& m) {
  Chunk t;
  t.G = lamc.cumsum(1);  // [BH, i, K]
  // exp(G_i - G_j) from differences, and only where j <= i: above the diagonal
  // it could overflow, and exp(-G) alone can for the softplus gate.
  t.D = (t.G.unsqueeze(2) - t.G.unsqueeze(1)).masked_fill(m.excl4, -INFINITY).exp();  // [BH, i, j, K]
  t.P = (Kc.unsqueeze(2) * Kc.unsqueeze(1) * t.D).sum(-1) * m.strict;                   // [BH, i, j]
  t.A = bc.unsqueeze(2) * t.P;
  t.Aqk = (Qc.unsqueeze(2) * Kc.unsqueeze(1) * t.D).sum(-1) * m.incl * scale;
  const Tensor g_last = t.G.narrow(1, C - 1, 1);  // [BH, 1, K]
  t.E = t.G.exp();
  t.Ed = (g_last - t.G).exp();
  t.Kg = t.E * Kc;
  t.Qg = t.E * Qc;
  t.Kd = t.Ed * Kc;
  t.gl = g_last.exp();
  t.IA = m.eye + t.A;  // unit lower triangular
  return t;
}

Tensor solve_lower(const Tensor& IA, const Tensor& rhs) {
  return at::linalg_solve_triangular(IA, rhs, /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
}

Tensor solve_upper_transposed(const Tensor& IA, const Tensor& rhs) {
  return at::linalg_solve_triangular(IA.transpose(1, 2), rhs, /*upper=*/true, /*left=*/true,
                                     /*unitriangular=*/true);
}

// [BH, K, V] from a [N, H, V, K] state, and back.
Tensor state_in(const Tensor& s, int64_t BH, int64_t K, int64_t V) {
  return s.reshape({BH, V, K}).transpose(1, 2).contiguous();
}
Tensor state_out(const Tensor& s, int64_t N, int64_t H, int64_t K, int64_t V) {
  return s.transpose(1, 2).reshape({N, H, V, K});
}

}  // namespace

ChunkedGrads chunked_recurrence_backward(const std::optional<std::vector<int64_t>>& offsets, double scale,
                                         const Tensor& qn, const Tensor& kn, const Tensor& v, const Tensor& lam,
                                         const Tensor& beta, const Tensor& init, const Tensor& grad_out,
                                         const Tensor& grad_final) {
  const int64_t B = qn.size(0), T = qn.size(1), H = qn.size(2), K = qn.size(3), V = v.size(3);
  const int64_t tokens = B * T, N = offsets.has_value() ? static_cast<int64_t>(offsets->size()) - 1 : B;
  const int64_t BH = N * H;
  int64_t longest = offsets.has_value() ? 0 : T;
  for (int64_t n = 0; offsets.has_value() && n < N; ++n) {
    longest = std::max(longest, (*offsets)[n + 1] - (*offsets)[n]);
  }
  const int64_t nc = (longest + C - 1) / C, Lp = nc * C;

  // Sequences padded to nc whole chunks with neutral tokens (q = k = v = 0,
  // lam = 0, beta = 0, no output gradient): they leave the state as it is and
  // receive gradients that are dropped. A fixed-length batch pads each row's
  // tail; a varlen batch gathers row n * Lp + i from token offsets[n] + i, or
  // from a zero row appended after the last token (index tensors built on the
  // host from the offsets the caller read).
  std::function<Tensor(const Tensor&)> pad, unpad;
  if (!offsets.has_value()) {
    pad = [=](const Tensor& x) {  // [B, T, H, F] -> [BH, nc, C, F]
      const int64_t F = x.size(-1);
      return at::constant_pad_nd(x, {0, 0, 0, 0, 0, Lp - T}).view({B, nc, C, H, F}).permute({0, 3, 1, 2, 4}).reshape(
          {BH, nc, C, F});
    };
    unpad = [=](const Tensor& x) {  // [BH, nc, C, F] -> [B, T, H, F]
      const int64_t F = x.size(-1);
      return x.view({B, H, Lp, F}).permute({0, 2, 1, 3}).narrow(1, 0, T).contiguous();
    };
  } else {
    std::vector<int64_t> gather(N * Lp, tokens), scatter(tokens, 0);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t t = (*offsets)[n]; t < (*offsets)[n + 1]; ++t) {
        gather[n * Lp + (t - (*offsets)[n])] = t;
        scatter[t] = n * Lp + (t - (*offsets)[n]);
      }
    }
    const auto host_long = at::TensorOptions().dtype(at::kLong);
    const Tensor gidx = at::tensor(gather, host_long).to(qn.device());
    const Tensor sidx = at::tensor(scatter, host_long).to(qn.device());
    pad = [=](const Tensor& x) {
      const int64_t F = x.size(-1);
      const Tensor rows = at::cat({x.reshape({tokens, H, F}), at::zeros({1, H, F}, x.options())});
      return rows.index_select(0, gidx).view({N, nc, C, H, F}).permute({0, 3, 1, 2, 4}).reshape({BH, nc, C, F});
    };
    unpad = [=](const Tensor& x) {
      const int64_t F = x.size(-1);
      const Tensor rows = x.view({N, H, nc, C, F}).permute({0, 2, 3, 1, 4}).reshape({N * Lp, H, F});
      return rows.index_select(0, sidx).view({B, T, H, F});
    };
  }

  const Tensor Qp = pad(qn), Kp = pad(kn), Vp = pad(v), Lam = pad(lam), dOp = pad(grad_out);
  const Tensor Bp = pad(beta.unsqueeze(-1)).squeeze(-1);  // [BH, nc, C]
  const auto opts = qn.options();
  Masks m;
  m.strict = at::ones({C, C}, opts).tril(-1);
  m.incl = at::ones({C, C}, opts).tril();
  m.excl4 = (m.incl == 0).view({1, C, C, 1});
  m.eye = at::eye(C, opts);

  // Forward: the state at every chunk start.
  std::vector<Tensor> starts;
  starts.reserve(nc);
  Tensor S = init.defined() ? state_in(init, BH, K, V) : at::zeros({BH, K, V}, opts);
  for (int64_t c = 0; c < nc; ++c) {
    starts.push_back(S);
    const Tensor bc = Bp.select(1, c);
    const Chunk t = chunk_terms(Qp.select(1, c), Kp.select(1, c), Lam.select(1, c), bc, scale, m);
    const Tensor U = solve_lower(t.IA, bc.unsqueeze(2) * (Vp.select(1, c) - t.Kg.bmm(S)));
    S = t.gl.transpose(1, 2) * S + t.Kd.transpose(1, 2).bmm(U);
  }

  // Backward over chunks, carrying dS (the gradient of the chunk-start state).
  Tensor dS = grad_final.defined() ? state_in(grad_final, BH, K, V) : at::zeros({BH, K, V}, opts);
  Tensor dQp = at::zeros_like(Qp), dKp = at::zeros_like(Kp), dVp = at::zeros_like(Vp), dLam = at::zeros_like(Lam);
  Tensor dBp = at::zeros_like(Bp);
  for (int64_t c = nc - 1; c >= 0; --c) {
    const Tensor& S0 = starts[c];
    const Tensor Qc = Qp.select(1, c), Kc = Kp.select(1, c), bc = Bp.select(1, c), dO = dOp.select(1, c);
    const Chunk t = chunk_terms(Qc, Kc, Lam.select(1, c), bc, scale, m);
    const Tensor W = Vp.select(1, c) - t.Kg.bmm(S0);  // [BH, C, V]
    const Tensor U = solve_lower(t.IA, bc.unsqueeze(2) * W);
    const Tensor dU = t.Aqk.transpose(1, 2).bmm(dO) + t.Kd.bmm(dS);
    const Tensor dR = solve_upper_transposed(t.IA, dU);
    const Tensor dA = -dR.bmm(U.transpose(1, 2)) * m.strict;
    const Tensor dPq = dO.bmm(U.transpose(1, 2)) * m.incl * scale;
    const Tensor dP = bc.unsqueeze(2) * dA;
    const Tensor dW = bc.unsqueeze(2) * dR;
    dBp.select(1, c).copy_((dR * W).sum(2) + (dA * t.P).sum(2));
    dVp.select(1, c).copy_(dW);
    const Tensor S0t = S0.transpose(1, 2);
    const Tensor dKg = -dW.bmm(S0t), dQg = dO.bmm(S0t) * scale, dKd = U.bmm(dS.transpose(1, 2));
    const Tensor dS0 = -t.Kg.transpose(1, 2).bmm(dW) + t.Qg.transpose(1, 2).bmm(dO) * scale + t.gl.transpose(1, 2) * dS;
    const Tensor dgl = (S0 * dS).sum(2);  // [BH, K]
    // P_ij = sum_d k_id k_jd D_ijd and Aqk_ij / scale = sum_d q_id k_jd D_ijd.
    const Tensor wq = dPq.unsqueeze(3) * t.D, wk = dP.unsqueeze(3) * t.D;  // [BH, i, j, K]
    const Tensor Qi = Qc.unsqueeze(2), Ki = Kc.unsqueeze(2), Kj = Kc.unsqueeze(1);
    Tensor dQ = (wq * Kj).sum(2) + t.E * dQg;
    Tensor dK = (wq * Qi).sum(1) + (wk * Ki).sum(1) + (wk * Kj).sum(2) + t.E * dKg + t.Ed * dKd;
    const Tensor terms = (wq * Qi + wk * Ki) * Kj;  // d/dG_i of exp(G_i - G_j), times the rest
    Tensor dG = terms.sum(2) - terms.sum(1) + t.Kg * dKg + t.Qg * dQg - t.Kd * dKd;
    dG.select(1, C - 1).add_((t.Kd * dKd).sum(1) + t.gl.squeeze(1) * dgl);
    dQp.select(1, c).copy_(dQ);
    dKp.select(1, c).copy_(dK);
    dLam.select(1, c).copy_(dG.flip({1}).cumsum(1).flip({1}));  // G = cumsum(lam)
    dS = dS0;
  }

  ChunkedGrads out;
  out.dqn = unpad(dQp);
  out.dkn = unpad(dKp);
  out.dv = unpad(dVp);
  out.dlam = unpad(dLam);
  out.dbeta = unpad(dBp.unsqueeze(-1)).squeeze(-1);
  if (init.defined()) {
    out.dinit = state_out(dS, N, H, K, V);
  }
  return out;
}

BackwardTuple backward_by_chunks(const char* op, const Problem& p, const Tensor& grad_out,
                                 const optional<Tensor>& grad_final_state, const Tensor& q, const Tensor& k,
                                 const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& A_log,
                                 const Tensor& dt_bias, const optional<Tensor>& initial_state,
                                 const optional<Tensor>& cu_seqlens) {
  BackwardOutputs o = allocate_backward_outputs(p, q, k, v, g, beta, A_log, dt_bias, initial_state);
  // Only a varlen batch needs its offsets on the host (a device sync on CUDA).
  std::optional<std::vector<int64_t>> offsets;
  if (cu_seqlens.has_value()) {
    offsets = sequence_offsets(op, p, cu_seqlens);
  }
  const at::ScalarType acc = accumulation_dtype(p);
  Activations a = compute_activations(p, acc, q, k, v, g, beta, A_log, dt_bias);
  auto to_acc = [&](const optional<Tensor>& t) { return t.has_value() ? t->to(acc).contiguous() : Tensor(); };
  ChunkedGrads r = chunked_recurrence_backward(offsets, resolved_scale(p), a.qn, a.kn, a.v, a.lam, a.beta,
                                               to_acc(initial_state), grad_out.to(acc).contiguous(),
                                               to_acc(grad_final_state));
  ActivationGrads d;
  d.dqn = r.dqn;
  d.dkn = r.dkn;
  d.dv = r.dv;
  d.dlam = r.dlam;
  d.dbeta = r.dbeta;
  backprop_activations(p, a, d, A_log, o);
  if (r.dinit.defined()) {
    o.dinitial_state.copy_(r.dinit);
  }
  return {o.dq, o.dk, o.dv, o.dg, o.dbeta, o.dA_log, o.ddt_bias, o.dinitial_state};
}

namespace {

// kda::_bwd_chunked: kda::bwd by the chunked composition on any device.
BackwardTuple bwd_chunked(const Tensor& grad_out, const optional<Tensor>& grad_final_state, const Tensor& q,
                          const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& A_log,
                          const Tensor& dt_bias, optional<double> scale, optional<double> lower_bound,
                          const optional<Tensor>& initial_state, const optional<Tensor>& cu_seqlens) {
  const char* op = "kda._bwd_chunked";
  Problem p = check_forward_args(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  check_backward_grads(op, p, q, grad_out, grad_final_state);
  return backward_by_chunks(op, p, grad_out, grad_final_state, q, k, v, g, beta, A_log, dt_bias, initial_state,
                            cu_seqlens);
}

}  // namespace

TORCH_LIBRARY_IMPL(kda, CompositeExplicitAutograd, m) {
  m.impl("_bwd_chunked", &bwd_chunked);
}

}  // namespace kda
