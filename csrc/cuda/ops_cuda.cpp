// CUDA registrations of kda::fwd, kda::fwd_ and kda::bwd: the shared argument
// checks, the limits of the CUDA kernels, then the launch on the current
// stream of the tensors' device. The forward never synchronises with the host
// unless TORCH_KDA_CHECK=1 asks for the contents of cu_seqlens to be checked;
// the backward's first version reads a varlen batch's cu_seqlens on the host
// (one sync; fixed-length batches need none).
#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "chunked_backward.h"
#include "cuda/forward_schedule.h"
#include "cuda/launch.h"
#include "kda.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <string>

namespace kda::cuda {
namespace {

using at::Tensor;
using std::optional;

void check_cuda_limits(const char* op, const Problem& p, const Tensor& A_log, const Tensor& dt_bias) {
  TORCH_CHECK(
      p.input_dtype == at::kBFloat16,
      op, ": on CUDA, q, k, v, g and beta must have dtype bfloat16, got ", dtype_name(p.input_dtype));
  TORCH_CHECK(
      concrete(p.K) == kHeadDim,
      op, ": on CUDA, the key head size K must be ", int_str(kHeadDim), ", got K = ", int_str(concrete(p.K)),
      " (other sizes run on the CPU)");
  TORCH_CHECK(
      concrete(p.V) == kHeadDim,
      op, ": on CUDA, the value head size V must be ", int_str(kHeadDim), ", got V = ", int_str(concrete(p.V)),
      " (other sizes run on the CPU)");
  TORCH_CHECK(A_log.scalar_type() == at::kFloat, op, ": on CUDA, A_log must have dtype float32, got ",
              dtype_name(A_log.scalar_type()));
  TORCH_CHECK(dt_bias.scalar_type() == at::kFloat, op, ": on CUDA, dt_bias must have dtype float32, got ",
              dtype_name(dt_bias.scalar_type()));
  TORCH_CHECK(
      p.gate == Gate::kBounded,
      op, ": on CUDA, lower_bound must be given (the bounded gate); the softplus gate (lower_bound=None) runs on the "
      "CPU only for now");
  TORCH_CHECK(
      p.lower_bound >= -5.0,
      op, ": on CUDA, lower_bound must be in [-5, 0), got ", float_str(p.lower_bound));
  TORCH_CHECK(
      p.state_dtype == at::kBFloat16 || p.state_dtype == at::kFloat,
      op, ": on CUDA, states must have dtype bfloat16 or float32, got ", dtype_name(p.state_dtype));
  // The kernels compute in fp32: a finite double scale beyond fp32's range would turn
  // into inf there, and inf * 0 into NaN.
  TORCH_CHECK(
      std::abs(resolved_scale(p)) <= FLT_MAX,
      op, ": on CUDA, scale must fit in float32, got ", float_str(resolved_scale(p)));
}

Problem check_all(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                  const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias, optional<double> scale,
                  optional<double> lower_bound, const optional<Tensor>& initial_state,
                  const optional<Tensor>& cu_seqlens) {
  Problem p = check_forward_args(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  check_cuda_limits(op, p, A_log, dt_bias);
  if (cu_seqlens.has_value() && debug_checks_enabled()) {
    read_and_check_cu_seqlens(op, *cu_seqlens, concrete(p.T));
  }
  return p;
}

// Sequence and chunk offsets of a varlen batch, built on the device by one
// kernel (boundaries.cu: cu_seqlens clamped into [0, tokens] and made
// non-decreasing, so a malformed one gives wrong numbers, never an access out
// of bounds). A fixed-length batch needs none (params.h). num_slots: the
// workspace's capacity in chunks.
struct Boundaries {
  Tensor offsets;  // [2, N + 1] int64: seq, then chunks; undefined for fixed length
  int64_t num_slots = 0;
};

// The launches' grids (K1: a block per chunk slot and head; K2: at most
// eight per sequence and head) must fit one launch; checked before anything is
// enqueued, so a rejected call leaves no kernel behind.
void check_grid_sizes(const Problem& p, int64_t num_slots) {
  const int64_t N = concrete(p.N), H = concrete(p.H);
  TORCH_CHECK(num_slots <= INT32_MAX / std::max<int64_t>(H, 1), "kda.fwd: q (with cu_seqlens, if given) makes ",
              std::to_string(num_slots), " chunks of 16 tokens x ", std::to_string(H),
              " heads, more blocks than one launch takes");
  TORCH_CHECK(N <= INT32_MAX / std::max<int64_t>(8 * H, 1), "kda.fwd: q (with cu_seqlens, if given) makes ",
              std::to_string(N), " sequences x ", std::to_string(H), " heads, more blocks than one launch takes");
}

Boundaries sequence_boundaries(const Problem& p, const Tensor& q, const optional<Tensor>& cu_seqlens,
                               cudaStream_t stream) {
  const int64_t B = concrete(p.B), T = concrete(p.T), N = concrete(p.N), tokens = B * T;
  Boundaries b;
  if (!cu_seqlens.has_value()) {
    b.num_slots = B * ((T + kChunk - 1) / kChunk);
    check_grid_sizes(p, b.num_slots);
    return b;
  }
  // Each sequence adds at most one partial chunk, and every chunk holds a token.
  b.num_slots = std::min(tokens, (tokens + kChunk - 1) / kChunk + N);
  check_grid_sizes(p, b.num_slots);
  Tensor cu = cu_seqlens->contiguous();
  b.offsets = at::empty({2, N + 1}, q.options().dtype(at::kLong));
  int64_t* seq = b.offsets.data_ptr<int64_t>();
  launch_boundaries(cu.data_ptr(), cu.scalar_type() == at::kInt, N, tokens, seq, seq + (N + 1), stream);
  return b;
}

// The kernels move 16-byte vectors; a view that starts mid-vector is staged.
bool aligned16(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// Runs the forward into `out` / `final_state`. Inputs are made contiguous
// (copies only where the caller's tensors are not). An output that is not
// contiguous or not 16-byte aligned, or a final_state whose dtype is not the one the kernels write
// (p.state_dtype: the initial state's, else fp32), gets a staging tensor that is
// copied back afterwards.
void forward_into(const Problem& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                  const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias,
                  const optional<Tensor>& initial_state, const optional<Tensor>& cu_seqlens, const Tensor& out,
                  const optional<Tensor>& final_state) {
  Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = g.contiguous();
  Tensor bc = beta.contiguous(), ac = A_log.contiguous(), dc = dt_bias.contiguous();
  Tensor init = initial_state.has_value() ? initial_state->contiguous() : Tensor();
  if (init.defined() && !aligned16(init)) {
    init = init.clone();
  }
  Tensor out_c = out.is_contiguous() && aligned16(out) ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
  Tensor final_c;
  if (final_state.has_value()) {
    const bool direct =
        final_state->is_contiguous() && aligned16(*final_state) && final_state->scalar_type() == p.state_dtype;
    final_c = direct ? *final_state : at::empty(final_state->sizes(), final_state->options().dtype(p.state_dtype));
  }
  // Each recurrence block reads its slice of the initial state before it writes the
  // same slice of the final state, so the very same buffer may serve as both; any
  // other overlap with an output (a shifted view, or out) would race between blocks.
  if (init.defined()) {
    const bool final_clash =
        final_c.defined() && at::get_overlap_status(init, final_c) != at::MemOverlapStatus::No &&
        !(final_c.data_ptr() == init.data_ptr() && final_c.strides() == init.strides());
    if (final_clash || at::get_overlap_status(init, out_c) != at::MemOverlapStatus::No) {
      init = init.clone();
    }
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  Boundaries bounds = sequence_boundaries(p, q, cu_seqlens, stream);

  FwdParams params;
  params.H = concrete(p.H);
  params.N = concrete(p.N);
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&params.num_sms, cudaDevAttrMultiProcessorCount, q.device().index()));
  params.q = qc.data_ptr();
  params.k = kc.data_ptr();
  params.v = vc.data_ptr();
  params.g = gc.data_ptr();
  params.beta = bc.data_ptr();
  params.A_log = ac.data_ptr<float>();
  params.dt_bias = dc.data_ptr<float>();
  params.seq_offsets = bounds.offsets.defined() ? bounds.offsets.data_ptr<int64_t>() : nullptr;
  params.chunk_offsets = params.seq_offsets != nullptr ? params.seq_offsets + (params.N + 1) : nullptr;
  params.T = concrete(p.T);
  params.num_slots = bounds.num_slots;
  params.initial_state = init.defined() ? init.data_ptr() : nullptr;
  params.final_state = final_c.defined() ? final_c.data_ptr() : nullptr;
  params.state_fp32 = p.state_dtype == at::kFloat;
  params.out = out_c.data_ptr();
  params.scale = static_cast<float>(resolved_scale(p));
  params.lower_bound = static_cast<float>(p.lower_bound);

  // Both settings are read before anything is enqueued, so a bad one leaves no kernel behind.
  const RecurrenceBlock block = forced_recurrence_block();
  int64_t window = window_slots(params);
  // Windows (forward_schedule.h) write outputs before they read every input:
  // only when no output shares memory with an input.
  if (window < params.num_slots) {
    for (const Tensor* input : {&qc, &kc, &vc, &gc, &bc, &ac, &dc}) {
      if (at::get_overlap_status(*input, out_c) != at::MemOverlapStatus::No ||
          (final_c.defined() && at::get_overlap_status(*input, final_c) != at::MemOverlapStatus::No)) {
        window = params.num_slots;
        break;
      }
    }
  }
  run_forward(params, q, window, block);

  if (!out_c.is_same(out)) {
    out.copy_(out_c);
  }
  if (final_state.has_value() && !final_c.is_same(*final_state)) {
    final_state->copy_(final_c);
  }
}

std::tuple<Tensor, Tensor> fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                               const Tensor& A_log, const Tensor& dt_bias, optional<double> scale,
                               optional<double> lower_bound, const optional<Tensor>& initial_state,
                               bool output_final_state, const optional<Tensor>& cu_seqlens) {
  Problem p = check_all("kda.fwd", q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  c10::cuda::CUDAGuard guard(q.device());
  ForwardOutputs o = allocate_forward_outputs(p, q, output_final_state);
  forward_into(p, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, o.out,
               output_final_state ? optional<Tensor>(o.final_state) : std::nullopt);
  return {o.out, o.final_state};
}

void fwd_inplace(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                 const Tensor& A_log, const Tensor& dt_bias, at::Tensor& out, const optional<Tensor>& final_state,
                 optional<double> scale, optional<double> lower_bound, const optional<Tensor>& initial_state,
                 const optional<Tensor>& cu_seqlens) {
  Problem p = check_all("kda.fwd_", q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  check_inplace_buffers("kda.fwd_", p, q, out, final_state, initial_state);
  check_outputs_disjoint("kda.fwd_", out, final_state);
  c10::cuda::CUDAGuard guard(q.device());
  forward_into(p, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> bwd(
    const Tensor& grad_out, const optional<Tensor>& grad_final_state, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias,
    optional<double> scale, optional<double> lower_bound, const optional<Tensor>& initial_state,
    const optional<Tensor>& cu_seqlens) {
  Problem p = check_all("kda.bwd", q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  check_backward_grads("kda.bwd", p, q, grad_out, grad_final_state);
  c10::cuda::CUDAGuard guard(q.device());
  // First version: the chunked backward composed of ATen ops (chunked_backward.h),
  // correct but far from the kernels' speed; varlen batches read cu_seqlens on
  // the host (one sync).
  return backward_by_chunks("kda.bwd", p, grad_out, grad_final_state, q, k, v, g, beta, A_log, dt_bias,
                            initial_state, cu_seqlens);
}

}  // namespace

TORCH_LIBRARY_IMPL(kda, CUDA, m) {
  m.impl("fwd", &fwd);
  m.impl("fwd_", &fwd_inplace);
  m.impl("bwd", &bwd);
}

}  // namespace kda::cuda
