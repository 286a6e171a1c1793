// The host steps that every CUDA op takes before it enqueues a kernel: the
// checks of what the kernels support, the sequence offsets, and the inputs
// made as the kernels read them.
#include "cuda/staging.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <string>

#include "cuda/launch.h"

namespace kda::cuda {
namespace {

using at::Tensor;
using std::optional;

void check_cuda_limits(const char* op, const Problem& p, const Tensor& A_log, const Tensor& dt_bias) {
  TORCH_CHECK(
      p.input_dtype == at::kBFloat16,
      op, ": on CUDA, q, k, v, g and beta must have dtype bfloat16 (a precomputed gate's g also float32), got ",
      dtype_name(p.input_dtype));
  // Every head size the op takes (checks.cpp) runs, zero-padded where the
  // kernels have no instances of its own (padded_heads.h).
  if (!p.precomputed_gate) {
    TORCH_CHECK(A_log.scalar_type() == at::kFloat, op, ": on CUDA, A_log must have dtype float32, got ",
                dtype_name(A_log.scalar_type()));
    TORCH_CHECK(dt_bias.scalar_type() == at::kFloat, op, ": on CUDA, dt_bias must have dtype float32, got ",
                dtype_name(dt_bias.scalar_type()));
  }
  // The bounded gate's kernels factor exp(G_i - G_j) = exp(G_i) exp(-G_j),
  // finite while 16 tokens decay by at most e^80 (params.h). A precomputed
  // gate promised to a lower bound below -5 takes the softplus gate's kernels
  // (set_gate), which take any decay.
  TORCH_CHECK(
      p.gate == Gate::kSoftplus || p.lower_bound >= -5.0 || p.precomputed_gate,
      op, ": on CUDA, lower_bound must be in [-5, 0) or None (the softplus gate), got ", float_str(p.lower_bound));
  TORCH_CHECK(
      p.state_dtype == at::kBFloat16 || p.state_dtype == at::kFloat,
      op, ": on CUDA, states must have dtype bfloat16 or float32, got ", dtype_name(p.state_dtype));
  // The kernels compute in fp32: a finite double scale beyond fp32's range would turn
  // into inf there, and inf * 0 into NaN.
  TORCH_CHECK(
      std::abs(resolved_scale(p)) <= FLT_MAX,
      op, ": on CUDA, scale must fit in float32, got ", float_str(resolved_scale(p)));
}

// The launches' grids (K1: a block per chunk slot and head; K2: at most
// a row group of 16 value rows of each sequence and head, kMaxHeadSize / 16
// at most) must fit one launch.
void check_grid_sizes(const char* op, const Problem& p, int64_t num_slots) {
  const int64_t N = concrete(p.N), H = concrete(p.H);
  TORCH_CHECK(num_slots <= INT32_MAX / std::max<int64_t>(H, 1), op, ": q (with cu_seqlens, if given) makes ",
              std::to_string(num_slots), " chunks of 16 tokens x ", std::to_string(H),
              " heads, more blocks than one launch takes");
  TORCH_CHECK(N <= INT32_MAX / std::max<int64_t>((kMaxHeadSize / 16) * H, 1), op,
              ": q (with cu_seqlens, if given) makes ", std::to_string(N), " sequences x ", std::to_string(H),
              " heads, more blocks than one launch takes");
}

}  // namespace

Problem check_all(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                  const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias, optional<double> scale,
                  optional<double> lower_bound, const optional<Tensor>& initial_state,
                  const optional<Tensor>& cu_seqlens) {
  Problem p = check_forward_args(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  check_cuda_limits(op, p, A_log, dt_bias);
  if (debug_checks_enabled()) {
    if (cu_seqlens.has_value()) {
      read_and_check_cu_seqlens(op, *cu_seqlens, concrete(p.T));
    }
    check_A_log_values(op, A_log, /*in_double=*/false);
    check_precomputed_gate_values(op, p, g);
  }
  return p;
}

int64_t value_head_group(const Problem& p) {
  return concrete(p.H) / std::max<int64_t>(concrete(p.H_qk), 1);
}

void set_gate(FwdParams& fp, const Problem& p, const Tensor& g) {
  fp.gate_given = p.precomputed_gate;
  fp.g_fp32 = g.scalar_type() == at::kFloat;
  fp.softplus = p.gate == Gate::kSoftplus || (p.precomputed_gate && p.lower_bound < -5.0);
  fp.lower_bound = static_cast<float>(p.lower_bound);
}

const float* float_data_or_null(const Tensor& t) {
  return t.defined() ? t.data_ptr<float>() : nullptr;
}

Boundaries sequence_boundaries(const char* op, const Problem& p, const Tensor& q, const optional<Tensor>& cu_seqlens,
                               cudaStream_t stream) {
  const int64_t B = concrete(p.B), T = concrete(p.T), N = concrete(p.N), tokens = B * T;
  Boundaries b;
  b.num_slots = concrete(chunk_slots(p.B, p.T, p.N, cu_seqlens.has_value()));
  check_grid_sizes(op, p, b.num_slots);
  if (!cu_seqlens.has_value()) {
    return b;
  }
  Tensor cu = cu_seqlens->contiguous();
  b.offsets = at::empty({3, N + 1}, q.options().dtype(at::kLong));
  int64_t* seq = b.offsets.data_ptr<int64_t>();
  launch_boundaries(cu.data_ptr(), cu.scalar_type() == at::kInt, N, tokens, seq, seq + (N + 1), seq + 2 * (N + 1),
                    stream);
  return b;
}

bool aligned16(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

Tensor staged16(const Tensor& t) {
  if (!t.defined()) {
    return t;
  }
  Tensor c = t.contiguous();
  return aligned16(c) ? c : c.clone();
}

Tensor sweep_grad_out(const Tensor& grad_out) {
  const auto dtype = grad_out.scalar_type();
  return staged16(dtype == at::kBFloat16 || dtype == at::kFloat ? grad_out : grad_out.to(at::kFloat));
}

CallInputs call_inputs(const Problem& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                       const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias, const Boundaries& bounds) {
  // K1 reads q, k and g by 16-byte cp.async, K2 v by 16-byte vectors.
  CallInputs in{staged16(q),       staged16(k),     staged16(v),          staged16(g),
                beta.contiguous(), staged16(A_log), staged16(dt_bias), FwdParams{}};
  FwdParams& fp = in.params;
  // By now a served size (padded_heads.h), the same for K and V.
  TORCH_INTERNAL_ASSERT(concrete(p.K) == concrete(p.V), "the kernels take K = V, got ",
                        std::to_string(concrete(p.K)), " and ", std::to_string(concrete(p.V)));
  fp.head_size = static_cast<int>(concrete(p.K));
  fp.H = concrete(p.H);
  fp.N = concrete(p.N);
  fp.group = value_head_group(p);
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&fp.num_sms, cudaDevAttrMultiProcessorCount, q.device().index()));
  fp.q = in.q.data_ptr();
  fp.k = in.k.data_ptr();
  fp.v = in.v.data_ptr();
  fp.g = in.g.data_ptr();
  fp.beta = in.beta.data_ptr();
  fp.A_log = float_data_or_null(in.A_log);
  fp.dt_bias = float_data_or_null(in.dt_bias);
  fp.seq_offsets = bounds.offsets.defined() ? bounds.offsets.data_ptr<int64_t>() : nullptr;
  fp.chunk_offsets = fp.seq_offsets != nullptr ? fp.seq_offsets + (fp.N + 1) : nullptr;
  fp.seq_order = fp.seq_offsets != nullptr ? fp.seq_offsets + 2 * (fp.N + 1) : nullptr;
  fp.T = concrete(p.T);
  fp.num_slots = bounds.num_slots;
  fp.slot_begin = 0;
  fp.slot_end = bounds.num_slots;
  fp.scale = static_cast<float>(resolved_scale(p));
  set_gate(fp, p, in.g);
  // Here, where the forward and the backward's recomputing passes both take
  // them: the backward's states are then the forward's.
  fp.state_fp32 = p.state_dtype == at::kFloat;
  fp.bf16_products = !fp.state_fp32;
  return in;
}

}  // namespace kda::cuda
