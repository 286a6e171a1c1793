// CUDA registrations of kda::fwd, kda::fwd_ and kda::bwd: the shared argument
// checks, the limits of the CUDA kernels, then the launch on the current
// stream of the tensors' device. The forward never synchronises with the host
// unless TORCH_KDA_CHECK=1 asks for the contents of cu_seqlens to be checked;
// neither does the backward (its kernels take the offsets from the device).
#include <ATen/MemoryOverlap.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checkpoints.h"
#include "chunked_backward.h"
#include "cuda/backward_schedule.h"
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
  // The bounded gate's kernels factor exp(G_i - G_j) = exp(G_i) exp(-G_j),
  // finite while 16 tokens decay by at most e^80 (params.h).
  TORCH_CHECK(
      p.gate == Gate::kSoftplus || p.lower_bound >= -5.0,
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

// K1's warps (TORCH_KDA_K1_WARPS), read before anything is enqueued; the
// softplus gate's K1 exists with two warps only.
int prepare_warps_for(const char* op, const Problem& p) {
  const int warps = forced_prepare_warps(op);
  TORCH_CHECK(warps == 2 || p.gate == Gate::kBounded, op,
              ": TORCH_KDA_K1_WARPS=1 serves the bounded gate only; the softplus gate's K1 has two warps");
  return warps;
}

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
  }
  return p;
}

// Sequence and chunk offsets of a varlen batch, built on the device by one
// kernel (boundaries.cu: cu_seqlens clamped into [0, tokens] and made
// non-decreasing, so a malformed one gives wrong numbers, never an access out
// of bounds). A fixed-length batch needs none (params.h). num_slots: the
// workspace's capacity in chunks.
struct Boundaries {
  Tensor offsets;  // [3, N + 1] int64: seq, chunks, then seq_order; undefined for fixed length
  int64_t num_slots = 0;
};

// The launches' grids (K1: a block per chunk slot and head; K2: at most
// eight per sequence and head) must fit one launch; checked before anything is
// enqueued, so a rejected call leaves no kernel behind.
void check_grid_sizes(const char* op, const Problem& p, int64_t num_slots) {
  const int64_t N = concrete(p.N), H = concrete(p.H);
  TORCH_CHECK(num_slots <= INT32_MAX / std::max<int64_t>(H, 1), op, ": q (with cu_seqlens, if given) makes ",
              std::to_string(num_slots), " chunks of 16 tokens x ", std::to_string(H),
              " heads, more blocks than one launch takes");
  TORCH_CHECK(N <= INT32_MAX / std::max<int64_t>(8 * H, 1), op, ": q (with cu_seqlens, if given) makes ",
              std::to_string(N), " sequences x ", std::to_string(H), " heads, more blocks than one launch takes");
}

Boundaries sequence_boundaries(const char* op, const Problem& p, const Tensor& q, const optional<Tensor>& cu_seqlens,
                               cudaStream_t stream) {
  const int64_t B = concrete(p.B), T = concrete(p.T), N = concrete(p.N), tokens = B * T;
  Boundaries b;
  if (!cu_seqlens.has_value()) {
    b.num_slots = B * ((T + kChunk - 1) / kChunk);
    check_grid_sizes(op, p, b.num_slots);
    return b;
  }
  // Each sequence adds at most one partial chunk, and every chunk holds a token.
  b.num_slots = std::min(tokens, (tokens + kChunk - 1) / kChunk + N);
  check_grid_sizes(op, p, b.num_slots);
  Tensor cu = cu_seqlens->contiguous();
  b.offsets = at::empty({3, N + 1}, q.options().dtype(at::kLong));
  int64_t* seq = b.offsets.data_ptr<int64_t>();
  launch_boundaries(cu.data_ptr(), cu.scalar_type() == at::kInt, N, tokens, seq, seq + (N + 1), seq + 2 * (N + 1),
                    stream);
  return b;
}

// The kernels move 16-byte vectors; a view that starts mid-vector is staged.
bool aligned16(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// t as a kernel reads it: contiguous and 16-byte aligned (a copy only where it
// is not); an undefined tensor stays undefined.
Tensor staged16(const Tensor& t) {
  if (!t.defined()) {
    return t;
  }
  Tensor c = t.contiguous();
  return aligned16(c) ? c : c.clone();
}

// grad_out as the backward sweep reads it: bf16 or fp32 as given (other dtypes
// in fp32), contiguous and 16-byte aligned.
Tensor sweep_grad_out(const Tensor& grad_out) {
  const auto dtype = grad_out.scalar_type();
  return staged16(dtype == at::kBFloat16 || dtype == at::kFloat ? grad_out : grad_out.to(at::kFloat));
}

// A call's inputs made contiguous (copies only where the caller's tensors are
// not; v also 16-byte aligned, as K2 copies it in 16-byte pieces) and the
// FwdParams over them, as one pass over all the call's chunk slots; the caller
// adds the workspace, the states and the outputs.
struct CallInputs {
  Tensor q, k, v, g, beta, A_log, dt_bias;
  FwdParams params;
};

CallInputs call_inputs(const Problem& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                       const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias, const Boundaries& bounds) {
  CallInputs in{q.contiguous(),    k.contiguous(),     staged16(v),          g.contiguous(),
                beta.contiguous(), A_log.contiguous(), dt_bias.contiguous(), FwdParams{}};
  FwdParams& fp = in.params;
  fp.H = concrete(p.H);
  fp.N = concrete(p.N);
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&fp.num_sms, cudaDevAttrMultiProcessorCount, q.device().index()));
  fp.q = in.q.data_ptr();
  fp.k = in.k.data_ptr();
  fp.v = in.v.data_ptr();
  fp.g = in.g.data_ptr();
  fp.beta = in.beta.data_ptr();
  fp.A_log = in.A_log.data_ptr<float>();
  fp.dt_bias = in.dt_bias.data_ptr<float>();
  fp.seq_offsets = bounds.offsets.defined() ? bounds.offsets.data_ptr<int64_t>() : nullptr;
  fp.chunk_offsets = fp.seq_offsets != nullptr ? fp.seq_offsets + (fp.N + 1) : nullptr;
  fp.seq_order = fp.seq_offsets != nullptr ? fp.seq_offsets + 2 * (fp.N + 1) : nullptr;
  fp.T = concrete(p.T);
  fp.num_slots = bounds.num_slots;
  fp.slot_begin = 0;
  fp.slot_end = bounds.num_slots;
  fp.scale = static_cast<float>(resolved_scale(p));
  fp.softplus = p.gate == Gate::kSoftplus;
  fp.lower_bound = static_cast<float>(p.lower_bound);
  // Here, where the forward and the backward's recomputing passes both take
  // them: the backward's states are then the forward's.
  fp.state_fp32 = p.state_dtype == at::kFloat;
  fp.bf16_products = !fp.state_fp32;
  return in;
}

// Runs the forward into `out` / `final_state`. Inputs are made contiguous
// (copies only where the caller's tensors are not). An output that is not
// contiguous or not 16-byte aligned, or a final_state whose dtype is not the one the kernels write
// (p.state_dtype: the initial state's, else fp32), gets a staging tensor that is
// copied back afterwards.
void forward_into(const char* op, const Problem& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                  const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias,
                  const optional<Tensor>& initial_state, const optional<Tensor>& cu_seqlens, const Tensor& out,
                  const optional<Tensor>& final_state, const Tensor& chunk_states = Tensor(),
                  const Tensor& records = Tensor()) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  Boundaries bounds = sequence_boundaries(op, p, q, cu_seqlens, stream);
  CallInputs in = call_inputs(p, q, k, v, g, beta, A_log, dt_bias, bounds);
  Tensor init = staged16(initial_state.value_or(Tensor()));
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
  FwdParams& params = in.params;
  // K2 reads v while it writes out and, at its end, the final state (the
  // record leaves v to it: params.h), so a v that shares memory with either is
  // read from a copy.
  if (at::get_overlap_status(in.v, out_c) != at::MemOverlapStatus::No ||
      (final_c.defined() && at::get_overlap_status(in.v, final_c) != at::MemOverlapStatus::No)) {
    in.v = in.v.clone();
    params.v = in.v.data_ptr();
  }
  params.initial_state = init.defined() ? init.data_ptr() : nullptr;
  params.final_state = final_c.defined() ? final_c.data_ptr() : nullptr;
  params.out = out_c.data_ptr();
  // Every chunk-start state, for the backward (kda._fwd_checkpointed):
  // run_forward moves the pointer to each window's first slot.
  if (chunk_states.defined() && chunk_states.numel() > 0) {
    params.chunk_states = chunk_states.data_ptr();
  }
  // Every chunk slot's record, kept for the backward: K1 writes them with the
  // lo planes the backward reads (K2 reads the same planes as from its own
  // workspace), all of them in this buffer.
  float* kept_records = nullptr;
  if (records.defined() && records.numel() > 0) {
    kept_records = records.data_ptr<float>();
    params.lo_for_backward = true;
  }

  // The settings are read before K1 and K2 are enqueued, so a bad one leaves
  // no kernel behind that writes the caller's tensors.
  const RecurrenceBlock block = forced_recurrence_block(op);
  params.prepare_warps = prepare_warps_for(op, p);
  int64_t window = window_slots(params, op, kept_records != nullptr);
  // Windows (forward_schedule.h) write outputs before they read every input:
  // only when no output shares memory with an input.
  if (window < params.num_slots) {
    for (const Tensor* input : {&in.q, &in.k, &in.v, &in.g, &in.beta, &in.A_log, &in.dt_bias}) {
      if (at::get_overlap_status(*input, out_c) != at::MemOverlapStatus::No ||
          (final_c.defined() && at::get_overlap_status(*input, final_c) != at::MemOverlapStatus::No)) {
        window = params.num_slots;
        break;
      }
    }
  }
  run_forward(params, q, window, block, kept_records);

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
  forward_into("kda.fwd", p, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, o.out,
               output_final_state ? optional<Tensor>(o.final_state) : std::nullopt);
  return {o.out, o.final_state};
}

// kda::_fwd_checkpointed (not API): fwd that also keeps every chunk-start state
// (checkpoints.h), for autograd to hand to bwd.
std::tuple<Tensor, Tensor, Tensor, Tensor> fwd_checkpointed(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                                    const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias,
                                                    optional<double> scale, optional<double> lower_bound,
                                                    const optional<Tensor>& initial_state, bool output_final_state,
                                                    const optional<Tensor>& cu_seqlens) {
  // Named kda.fwd in messages: torch_kda.kda calls this op in fwd's place.
  const char* op = "kda.fwd";
  Problem p = check_all(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  c10::cuda::CUDAGuard guard(q.device());
  ForwardOutputs o = allocate_forward_outputs(p, q, output_final_state);
  auto [checkpoints, records] = allocate_saved(op, p, q, cu_seqlens.has_value());
  if (cu_seqlens.has_value()) {
    // A varlen batch's chunks fill all but at most N of its slots (their count
    // is an upper bound from the shapes), and K1 and K2 write only those: the
    // last N are zeroed first, so that the outputs hold no uninitialised memory.
    for (Tensor* t : {&checkpoints, &records}) {
      const int64_t tail = std::min<int64_t>(concrete(p.N), t->size(0));
      if (tail > 0) {
        t->narrow(0, t->size(0) - tail, tail).zero_();
      }
    }
  }
  forward_into(op, p, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, o.out,
               output_final_state ? optional<Tensor>(o.final_state) : std::nullopt, checkpoints, records);
  return {o.out, o.final_state, checkpoints, records};
}

void fwd_inplace(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                 const Tensor& A_log, const Tensor& dt_bias, at::Tensor& out, const optional<Tensor>& final_state,
                 optional<double> scale, optional<double> lower_bound, const optional<Tensor>& initial_state,
                 const optional<Tensor>& cu_seqlens) {
  Problem p = check_all("kda.fwd_", q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  check_inplace_buffers("kda.fwd_", p, q, out, final_state, initial_state);
  check_outputs_disjoint("kda.fwd_", out, final_state);
  c10::cuda::CUDAGuard guard(q.device());
  forward_into("kda.fwd_", p, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state);
}

// kda.bwd with the backward kernels (backward_schedule.h: K1 for the records
// and K2 storing the chunk-start states unless the forward kept them, the dS
// recurrence, the record gradients, then K1's backward with the chain rule
// through the activations, which writes the gradients, in windows of slots
// where one pass would hold too much); only dA_log's and dt_bias's per-chunk
// parts are summed here.
BackwardTuple backward_by_kernels(const Problem& p, const Tensor& grad_out, const optional<Tensor>& grad_final_state,
                                  const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                  const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias,
                                  const optional<Tensor>& initial_state, const optional<Tensor>& cu_seqlens,
                                  const Tensor& checkpoints, const Tensor& records) {
  const char* op = "kda.bwd";
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  const int64_t H = concrete(p.H), N = concrete(p.N);
  // Read before any kernel is enqueued: a bad value leaves none behind.
  const RecurrenceBlock block = forced_recurrence_block(op);
  const DsBlock ds_block = forced_ds_block(op);
  const int prepare_warps = prepare_warps_for(op, p);
  Boundaries bounds = sequence_boundaries(op, p, q, cu_seqlens, stream);
  CallInputs in = call_inputs(p, q, k, v, g, beta, A_log, dt_bias, bounds);
  in.params.prepare_warps = prepare_warps;
  // The forward's chunk-start states (checked by bwd) spare the recurrence's
  // passes, and its records (given only with the states) K1's.
  const bool saved = checkpoints.defined() && checkpoints.numel() > 0;
  const bool saved_records = records.defined() && records.numel() > 0;
  const int64_t window = backward_window_slots(
      in.params, static_cast<int64_t>(at::cuda::getDeviceProperties(q.device().index())->totalGlobalMem), saved,
      saved_records);
  Tensor init = staged16(initial_state.value_or(Tensor()));
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor go = sweep_grad_out(grad_out);
  // Read in float2 vectors (a view from cat's backward may start mid-vector).
  Tensor gf = staged16(grad_final_state.has_value() ? grad_final_state->to(at::kFloat) : Tensor());
  Tensor d_initial = init.defined() ? at::empty({N, H, kHeadDim, kHeadDim}, f32) : Tensor();
  BackwardOutputs o = allocate_backward_outputs(p, q, k, v, g, beta, A_log, dt_bias, initial_state);
  // The gradients straight from K1's backward (bf16, contiguous: allocated so,
  // and the CUDA op takes bf16 inputs only). Zeros where no chunk covers a
  // token (only a malformed cu_seqlens leaves any): those tokens alone, where
  // zeroing the five tensors whole took 0.64 ms of a step at 8 x 8192 tokens x
  // 32 heads (H200).
  if (cu_seqlens.has_value()) {
    ZeroRows rows;
    int r = 0;
    for (Tensor* t : {&o.dq, &o.dk, &o.dv, &o.dg, &o.dbeta}) {
      rows.base[r] = t->data_ptr();
      rows.width[r++] = t->numel() / std::max<int64_t>(concrete(p.T), 1);
    }
    launch_zero_uncovered(in.params.seq_offsets, N, concrete(p.T), rows, stream);
  }
  // Zeros: the blocks of slots past the live chunks return without writing their part.
  Tensor ddt_part = at::zeros({bounds.num_slots, H, kHeadDim}, f32);
  Tensor dA_part = at::zeros({bounds.num_slots, H}, f32);

  BackwardCall call;
  call.fwd = in.params;
  call.fwd.initial_state = init.defined() ? init.data_ptr() : nullptr;
  call.grad_out = go.data_ptr();
  call.grad_out_fp32 = go.scalar_type() == at::kFloat;
  call.grad_final = gf.defined() ? gf.data_ptr<float>() : nullptr;
  call.d_initial = d_initial.defined() ? d_initial.data_ptr<float>() : nullptr;
  call.grads.dq = o.dq.data_ptr();
  call.grads.dk = o.dk.data_ptr();
  call.grads.dv = o.dv.data_ptr();
  call.grads.dg = o.dg.data_ptr();
  call.grads.dbeta = o.dbeta.data_ptr();
  call.grads.ddt_bias_part = ddt_part.data_ptr<float>();
  call.grads.dA_log_part = dA_part.data_ptr<float>();
  run_backward(call, in.v, window, block, ds_block, saved ? checkpoints.data_ptr() : nullptr,
               saved_records ? records.data_ptr<float>() : nullptr);

  o.ddt_bias.copy_(ddt_part.sum(0));
  o.dA_log.copy_(dA_part.sum(0));
  if (init.defined()) {
    o.dinitial_state.copy_(d_initial);
  }
  return {o.dq, o.dk, o.dv, o.dg, o.dbeta, o.dA_log, o.ddt_bias, o.dinitial_state};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> bwd(
    const Tensor& grad_out, const optional<Tensor>& grad_final_state, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias,
    optional<double> scale, optional<double> lower_bound, const optional<Tensor>& initial_state,
    const optional<Tensor>& cu_seqlens, const optional<Tensor>& checkpoints, const optional<Tensor>& records) {
  Problem p = check_all("kda.bwd", q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  check_backward_grads("kda.bwd", p, q, grad_out, grad_final_state);
  check_saved("kda.bwd", p, cu_seqlens.has_value(), q, checkpoints, records);
  c10::cuda::CUDAGuard guard(q.device());
  return backward_by_kernels(p, grad_out, grad_final_state, q, k, v, g, beta, A_log, dt_bias, initial_state,
                             cu_seqlens, checkpoints.value_or(Tensor()), records.value_or(Tensor()));
}

// An intermediate that a private test op takes in (what the backward's kernels
// pass each other: fp32, or bf16 for the chunk states): contiguous, on q's
// device, of exactly this dtype and shape.
void check_scratch_input(const char* op, const char* name, const Tensor& t, const Tensor& q,
                         at::IntArrayRef shape, at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK(t.device() == q.device() && t.scalar_type() == dtype && t.is_contiguous() && t.sizes() == shape,
              op, ": ", name, " must be a contiguous ", dtype == at::kFloat ? "float32" : "bfloat16",
              " tensor on q's device of shape ", shape);
}

// kda::_prepare_bwd (not API): K1's backward alone, for its GPU test.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> prepare_bwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                               const Tensor& g, const Tensor& beta,
                                                               const Tensor& A_log, const Tensor& dt_bias,
                                                               const Tensor& d_record, optional<double> scale,
                                                               double lower_bound) {
  const char* op = "kda._prepare_bwd";
  Problem p = check_all(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, std::nullopt, std::nullopt);
  const int64_t B = concrete(p.B), T = concrete(p.T), H = concrete(p.H);
  const int64_t slots = B * ((T + kChunk - 1) / kChunk);
  check_scratch_input(op, "d_record", d_record, q, {slots, H, kDRecFloats});
  c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  CallInputs in = call_inputs(p, q, k, v, g, beta, A_log, dt_bias, sequence_boundaries(op, p, q, std::nullopt, stream));
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor dqn = at::empty({B, T, H, kHeadDim}, f32), dkn = at::empty({B, T, H, kHeadDim}, f32);
  Tensor dv = at::empty({B, T, H, kHeadDim}, f32), dlam = at::empty({B, T, H, kHeadDim}, f32);
  Tensor dbeta = at::empty({B, T, H}, f32);
  PrepareBwdParams bp;
  bp.fwd = in.params;
  bp.d_record = d_record.data_ptr<float>();
  bp.dqn = dqn.data_ptr<float>();
  bp.dkn = dkn.data_ptr<float>();
  bp.dv = dv.data_ptr<float>();
  bp.dlam = dlam.data_ptr<float>();
  bp.dbeta = dbeta.data_ptr<float>();
  launch_prepare_backward(bp, stream);
  return {dqn, dkn, dv, dlam, dbeta};
}

// kda::_sweep_bwd (not API): K1, then the backward sweep alone, for its GPU test.
std::tuple<Tensor, Tensor, Tensor> sweep_bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                     const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias,
                                     const Tensor& states, const Tensor& grad_out,
                                     const optional<Tensor>& grad_final_state, optional<double> scale,
                                     double lower_bound) {
  const char* op = "kda._sweep_bwd";
  const DsBlock ds_block = forced_ds_block(op);
  const int prepare_warps = forced_prepare_warps(op);
  Problem p = check_all(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, std::nullopt, std::nullopt);
  const int64_t B = concrete(p.B), T = concrete(p.T), H = concrete(p.H);
  const int64_t slots = B * ((T + kChunk - 1) / kChunk);
  check_scratch_input(op, "states", states, q, {slots, H, kHeadDim, kHeadDim}, at::kBFloat16);
  TORCH_CHECK(grad_out.device() == q.device() && grad_out.scalar_type() == at::kBFloat16 &&
                  grad_out.sizes() == v.sizes(),
              op, ": grad_out must be a bfloat16 tensor on q's device shaped like v");
  Tensor gf;
  if (grad_final_state.has_value()) {
    gf = grad_final_state->contiguous();
    TORCH_CHECK(gf.device() == q.device() && gf.scalar_type() == at::kFloat && gf.dim() == 4 && gf.size(0) == B &&
                    gf.size(1) == H && gf.size(2) == kHeadDim && gf.size(3) == kHeadDim,
                op, ": grad_final_state must be float32 on q's device of shape [B, H, 128, 128]");
  }
  gf = staged16(gf);  // read in vectors, as in kda.bwd
  const Tensor st = staged16(states);
  c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  CallInputs in = call_inputs(p, q, k, v, g, beta, A_log, dt_bias, sequence_boundaries(op, p, q, std::nullopt, stream));
  Tensor go = sweep_grad_out(grad_out);
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor workspace = at::empty({slots, H, kWsChunkFloats}, f32);
  Tensor d_record = at::empty({slots, H, kDRecFloats}, f32);
  Tensor d_initial = at::empty({B, H, kHeadDim, kHeadDim}, f32);
  Tensor d_states = at::empty({slots, H, kHeadDim, kHeadDim}, q.options().dtype(at::kBFloat16));
  SweepBwdParams bp;
  bp.d_states = d_states.data_ptr();
  bp.fwd = in.params;
  bp.fwd.workspace = workspace.data_ptr<float>();
  FwdParams& fp = bp.fwd;
  fp.lo_for_backward = true;
  fp.prepare_warps = prepare_warps;
  bp.states = st.data_ptr();
  bp.grad_out = go.data_ptr();
  bp.grad_out_fp32 = go.scalar_type() == at::kFloat;
  bp.grad_final = gf.defined() ? gf.data_ptr<float>() : nullptr;
  bp.d_record = d_record.data_ptr<float>();
  bp.d_initial = d_initial.data_ptr<float>();
  launch_prepare(fp, stream);
  launch_sweep_backward(bp, stream, ds_block);
  return {d_record, d_initial, d_states};
}

}  // namespace

TORCH_LIBRARY_IMPL(kda, CUDA, m) {
  m.impl("fwd", &fwd);
  m.impl("fwd_", &fwd_inplace);
  m.impl("_fwd_checkpointed", &fwd_checkpointed);
  m.impl("bwd", &bwd);
  m.impl("_prepare_bwd", &prepare_bwd);
  m.impl("_sweep_bwd", &sweep_bwd);
}

}  // namespace kda::cuda
