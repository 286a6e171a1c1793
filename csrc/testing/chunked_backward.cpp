#include "testing/chunked_backward.h"

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

}  // namespace

ChunkedGrads chunked_recurrence_backward(const std::optional<std::vector<int64_t>>& offsets, double scale,
                                         const Tensor& qn, const Tensor& kn, const Tensor& v, const Tensor& lam,
                                         const Tensor& beta, const Tensor& init, const Tensor& grad_out,
                                         const Tensor& grad_final) {
  const int64_t B = qn.size(0), T = qn.size(1), H = qn.size(2), K = qn.size(3), V = v.size(3);
  const int64_t tokens = B * T, N = offsets.has_value() ? static_cast<int64_t>(offsets->size()) - 1 : B;
  const auto opts = qn.options();

  // Chunk-major layout. Sequences are ranked by their number of chunks, most
  // first, so that the sequences that still have a chunk c are ranks
  // [0, count[c]): step c works on a prefix of the (rank, head) rows, and the
  // work and memory follow the real chunks, not N times the longest sequence.
  // Slot slot_begin[c] + r holds chunk c of rank r, 16 tokens; a sequence's
  // last chunk is completed with neutral tokens (q = k = v = 0, lam = 0,
  // beta = 0, no output gradient), which leave the state as it is and whose
  // gradients are dropped.
  std::vector<int64_t> len(N), order(N);
  for (int64_t n = 0; n < N; ++n) {
    len[n] = offsets.has_value() ? (*offsets)[n + 1] - (*offsets)[n] : T;
    order[n] = n;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len[a] > len[b]; });
  const int64_t nc = N > 0 ? (len[order[0]] + C - 1) / C : 0;
  std::vector<int64_t> count(nc, 0), slot_begin(nc + 1, 0);
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t c = 0; c * C < len[order[r]]; ++c) {
      ++count[c];
    }
  }
  for (int64_t c = 0; c < nc; ++c) {
    slot_begin[c + 1] = slot_begin[c] + count[c];
  }
  const int64_t slots = slot_begin[nc];

  // slotted(x): [B, T, H, F] -> [slots, H, C, F], laid out once so that every
  // step's rows are a plain view; unslotted: back. A fixed-length
  // batch does it with views and one copy (nothing read on the host); a varlen
  // batch gathers rows through index tensors built here from the offsets.
  std::function<Tensor(const Tensor&)> slotted, unslotted;
  Tensor rank_of;  // [N] original sequence -> rank, on the device; undefined when the identity
  if (!offsets.has_value()) {
    const int64_t Lp = nc * C;
    slotted = [=](const Tensor& x) {
      const int64_t F = x.size(-1);
      return at::constant_pad_nd(x, {0, 0, 0, 0, 0, Lp - T})
          .view({B, nc, C, H, F})
          .permute({1, 0, 3, 2, 4})
          .reshape({slots, H, C, F})
          .contiguous();
    };
    unslotted = [=](const Tensor& x) {
      const int64_t F = x.size(-1);
      return x.view({nc, B, H, C, F}).permute({1, 0, 3, 2, 4}).reshape({B, Lp, H, F}).narrow(1, 0, T).contiguous();
    };
  } else {
    std::vector<int64_t> gather(slots * C, tokens), scatter(tokens, 0), rank(N);
    for (int64_t r = 0; r < N; ++r) {
      const int64_t n = order[r], start = (*offsets)[n];
      rank[n] = r;
      for (int64_t t = start; t < start + len[n]; ++t) {
        const int64_t row = (slot_begin[(t - start) / C] + r) * C + (t - start) % C;
        gather[row] = t;
        scatter[t] = row;
      }
    }
    const auto host_long = at::TensorOptions().dtype(at::kLong);
    const Tensor gidx = at::tensor(gather, host_long).to(qn.device());
    const Tensor sidx = at::tensor(scatter, host_long).to(qn.device());
    rank_of = at::tensor(rank, host_long).to(qn.device());
    slotted = [=](const Tensor& x) {
      const int64_t F = x.size(-1);
      const Tensor rows = at::cat({x.reshape({tokens, H, F}), at::zeros({1, H, F}, x.options())});
      return rows.index_select(0, gidx).view({slots, C, H, F}).transpose(1, 2).contiguous();
    };
    unslotted = [=](const Tensor& x) {
      const int64_t F = x.size(-1);
      return x.transpose(1, 2).reshape({slots * C, H, F}).index_select(0, sidx).view({B, T, H, F});
    };
  }
  // States [N, H, V, K] <-> rows (rank, head) of [N * H, K, V].
  auto states_in = [&](const Tensor& s) {
    const Tensor ranked = rank_of.defined() ? at::empty_like(s).index_copy_(0, rank_of, s) : s;
    return ranked.reshape({N * H, V, K}).transpose(1, 2).contiguous();
  };
  auto states_out = [&](const Tensor& s) {
    const Tensor ranked = s.transpose(1, 2).reshape({N, H, V, K});
    return rank_of.defined() ? ranked.index_select(0, rank_of) : ranked;
  };
  // Step c's rows of a slotted tensor, a view: [count[c] * H, C, F], (rank, head) major.
  auto step = [&](const Tensor& x, int64_t c) {
    return x.narrow(0, slot_begin[c], count[c]).view({count[c] * H, C, x.size(-1)});
  };

  const Tensor Qs = slotted(qn), Ks = slotted(kn), Vs = slotted(v), Lams = slotted(lam), dOs = slotted(grad_out);
  const Tensor Bs = slotted(beta.unsqueeze(-1));  // [slots, H, C, 1]
  Masks m;
  m.strict = at::ones({C, C}, opts).tril(-1);
  m.incl = at::ones({C, C}, opts).tril();
  m.excl4 = (m.incl == 0).view({1, C, C, 1});
  m.eye = at::eye(C, opts);

  // Forward: the state at every chunk start, for the sequences that have the
  // chunk, and each chunk's W = V - Kg S0 and U (the backward reads them back;
  // the chunk terms are recomputed instead, since their decay tensor D is as
  // large as 16 token-sized tensors).
  std::vector<Tensor> starts, Ws, Us;
  starts.reserve(nc);
  Ws.reserve(nc);
  Us.reserve(nc);
  Tensor S = init.defined() ? states_in(init) : at::zeros({N * H, K, V}, opts);
  for (int64_t c = 0; c < nc; ++c) {
    const Tensor S0 = S.narrow(0, 0, count[c] * H);
    const Tensor bc = step(Bs, c).squeeze(-1);
    const Chunk t = chunk_terms(step(Qs, c), step(Ks, c), step(Lams, c), bc, scale, m);
    const Tensor W = step(Vs, c) - t.Kg.bmm(S0);  // [rows, C, V]
    const Tensor U = solve_lower(t.IA, bc.unsqueeze(2) * W);
    starts.push_back(S0);
    Ws.push_back(W);
    Us.push_back(U);
    S = t.gl.transpose(1, 2) * S0 + t.Kd.transpose(1, 2).bmm(U);
  }

  // Backward over chunks, carrying dS (the gradient of the chunk-start state);
  // sequences without chunk c keep theirs.
  // Updated in place below, so never a view of the caller's grad_final.
  Tensor dS = grad_final.defined() ? states_in(grad_final).clone() : at::zeros({N * H, K, V}, opts);
  Tensor dQs = at::zeros_like(Qs), dKs = at::zeros_like(Ks), dVs = at::zeros_like(Vs), dLams = at::zeros_like(Lams);
  Tensor dBs = at::zeros_like(Bs);
  for (int64_t c = nc - 1; c >= 0; --c) {
    const Tensor& S0 = starts[c];
    const Tensor dS1 = dS.narrow(0, 0, count[c] * H);
    const Tensor Qc = step(Qs, c), Kc = step(Ks, c), bc = step(Bs, c).squeeze(-1), dO = step(dOs, c);
    const Chunk t = chunk_terms(Qc, Kc, step(Lams, c), bc, scale, m);
    const Tensor &W = Ws[c], &U = Us[c];
    const Tensor dU = t.Aqk.transpose(1, 2).bmm(dO) + t.Kd.bmm(dS1);
    const Tensor dR = solve_upper_transposed(t.IA, dU);
    const Tensor dA = -dR.bmm(U.transpose(1, 2)) * m.strict;
    const Tensor dPq = dO.bmm(U.transpose(1, 2)) * m.incl * scale;
    const Tensor dP = bc.unsqueeze(2) * dA;
    const Tensor dW = bc.unsqueeze(2) * dR;
    step(dBs, c).copy_(((dR * W).sum(2) + (dA * t.P).sum(2)).unsqueeze(-1));
    step(dVs, c).copy_(dW);
    const Tensor S0t = S0.transpose(1, 2);
    const Tensor dKg = -dW.bmm(S0t), dQg = dO.bmm(S0t) * scale, dKd = U.bmm(dS1.transpose(1, 2));
    const Tensor dS0 =
        -t.Kg.transpose(1, 2).bmm(dW) + t.Qg.transpose(1, 2).bmm(dO) * scale + t.gl.transpose(1, 2) * dS1;
    const Tensor dgl = (S0 * dS1).sum(2);  // [rows, K]
    // P_ij = sum_d k_id k_jd D_ijd and Aqk_ij / scale = sum_d q_id k_jd D_ijd.
    const Tensor wq = dPq.unsqueeze(3) * t.D, wk = dP.unsqueeze(3) * t.D;  // [rows, i, j, K]
    const Tensor Qi = Qc.unsqueeze(2), Ki = Kc.unsqueeze(2), Kj = Kc.unsqueeze(1);
    step(dQs, c).copy_((wq * Kj).sum(2) + t.E * dQg);
    step(dKs, c).copy_((wq * Qi).sum(1) + (wk * Ki).sum(1) + (wk * Kj).sum(2) + t.E * dKg + t.Ed * dKd);
    const Tensor terms = (wq * Qi + wk * Ki) * Kj;  // d/dG_i of exp(G_i - G_j), times the rest
    Tensor dG = terms.sum(2) - terms.sum(1) + t.Kg * dKg + t.Qg * dQg - t.Kd * dKd;
    dG.select(1, C - 1).add_((t.Kd * dKd).sum(1) + t.gl.squeeze(1) * dgl);
    step(dLams, c).copy_(dG.flip({1}).cumsum(1).flip({1}));  // G = cumsum(lam)
    dS.narrow(0, 0, count[c] * H).copy_(dS0);
  }

  ChunkedGrads out;
  out.dqn = unslotted(dQs);
  out.dkn = unslotted(dKs);
  out.dv = unslotted(dVs);
  out.dlam = unslotted(dLams);
  out.dbeta = unslotted(dBs).squeeze(-1);
  if (init.defined()) {
    out.dinit = states_out(dS);
  }
  return out;
}

BackwardTuple backward_by_chunks(const char* op, const Problem& p, const Tensor& grad_out,
                                 const optional<Tensor>& grad_final_state, const Tensor& q, const Tensor& k,
                                 const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& A_log,
                                 const Tensor& dt_bias, const optional<Tensor>& initial_state,
                                 const optional<Tensor>& cu_seqlens) {
  // The accumulation dtype is fp32 throughout; a global TF32 setting must not reach them.
  at::NoTF32Guard no_tf32;
  BackwardOutputs o = allocate_backward_outputs(p, q, k, v, g, beta, A_log, dt_bias, initial_state);
  // Only a varlen batch needs its offsets on the host (a device sync on CUDA).
  std::optional<std::vector<int64_t>> offsets;
  if (cu_seqlens.has_value()) {
    offsets = sequence_offsets(op, p, cu_seqlens);
  }
  const at::ScalarType acc = accumulation_dtype(p);
  Activations a = compute_activations(p, acc, q, k, v, g, beta, A_log, dt_bias);
  ChunkedGrads r = chunked_recurrence_backward(offsets, resolved_scale(p), a.qn, a.kn, a.v, a.lam, a.beta,
                                               to_acc(initial_state, acc), grad_out.to(acc).contiguous(),
                                               to_acc(grad_final_state, acc));
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

// kda_testing::bwd_chunked: kda::bwd by the chunked composition on any device.
BackwardTuple bwd_chunked(const Tensor& grad_out, const optional<Tensor>& grad_final_state, const Tensor& q,
                          const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& A_log,
                          const Tensor& dt_bias, optional<double> scale, optional<double> lower_bound,
                          const optional<Tensor>& initial_state, const optional<Tensor>& cu_seqlens) {
  const char* op = "kda_testing.bwd_chunked";
  Problem p = check_forward_args(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  check_backward_grads(op, p, q, grad_out, grad_final_state);
  return backward_by_chunks(op, p, grad_out, grad_final_state, q, k, v, g, beta, A_log, dt_bias, initial_state,
                            cu_seqlens);
}

}  // namespace

TORCH_LIBRARY_IMPL(kda_testing, CompositeExplicitAutograd, m) {
  m.impl("bwd_chunked", &bwd_chunked);
}

}  // namespace kda
