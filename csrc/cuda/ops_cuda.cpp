// CUDA registrations of kda::fwd, kda::fwd_, kda::_fwd_checkpointed and
// kda::bwd (kda::fwd_pool_'s are in pool_ops.cpp): the shared host steps (staging.h), then the kernels on the current
// stream of the tensors' device, as heuristics.h plans them. Neither the
// forward nor the backward synchronises with the host unless TORCH_KDA_CHECK=1
// asks for the contents of cu_seqlens and A_log to be checked.
#include <ATen/MemoryOverlap.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "checkpoints.h"
#include "cuda/backward/schedule.h"
#include "cuda/forward/schedule.h"
#include "cuda/forward_call.h"
#include "cuda/heuristics.h"
#include "cuda/launch.h"
#include "cuda/padded_heads.h"
#include "cuda/staging.h"
#include "kda.h"

namespace kda::cuda {
namespace {

using at::Tensor;
using std::optional;

// Whether t shares memory with out or final (where defined); an undefined t (a
// precomputed gate's A_log and dt_bias) shares none.
bool overlaps_outputs(const Tensor& t, const Tensor& out, const Tensor& final) {
  return t.defined() && (at::get_overlap_status(t, out) != at::MemOverlapStatus::No ||
                         (final.defined() && at::get_overlap_status(t, final) != at::MemOverlapStatus::No));
}

// The forward in windows of chunk slots (or one pass), as plan says.
// Windows (forward/schedule.h) write outputs before they read every input:
// only when no output shares memory with an input.
void run_windows(const FwdParams& params, const Tensor& q, ForwardPlan plan, float* kept_records,
                 const CallInputs& in, const Tensor& out_c, const Tensor& final_c) {
  if (plan.window < params.num_slots) {
    for (const Tensor* input : {&in.q, &in.k, &in.v, &in.g, &in.beta, &in.A_log, &in.dt_bias}) {
      if (overlaps_outputs(*input, out_c, final_c)) {
        plan.window = params.num_slots;
        break;
      }
    }
  }
  run_forward(params, q, plan, kept_records);
}

// Whether forward_served runs the decode kernel (forward_call.h) rather than
// the chunked pair.
bool takes_decode_kernel(const Problem& p, bool decode_short_requests, const Tensor& chunk_states,
                         const Tensor& records) {
  return decode_short_requests && !chunk_states.defined() && !records.defined() && concrete(p.K) <= kHeadDim &&
         concrete(p.V) <= kHeadDim && pool_by_decode(concrete(p.B) * concrete(p.T), concrete(p.N), false);
}

// Runs the forward at a served head size (K = V = 64, 128 or 256) into `out` /
// `final_state`; decode: the decode kernel instead of the chunked pair. Inputs
// are made contiguous (copies only where the caller's tensors are not). An
// output that is not contiguous or not 16-byte aligned, or a final_state whose
// dtype is not the one the kernels write (p.state_dtype: the initial state's,
// else fp32), gets a staging tensor that is copied back afterwards.
void forward_into(const char* op, const Problem& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                  const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias,
                  const optional<Tensor>& initial_state, const optional<Tensor>& cu_seqlens, const Tensor& out,
                  const optional<Tensor>& final_state, const Tensor& chunk_states, const Tensor& records,
                  bool decode) {
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
  if (overlaps_outputs(in.v, out_c, final_c)) {
    in.v = in.v.clone();
    params.v = in.v.data_ptr();
  }
  params.initial_state = init.defined() ? init.data_ptr() : nullptr;
  params.final_state = final_c.defined() ? final_c.data_ptr() : nullptr;
  params.out = out_c.data_ptr();
  if (decode) {
    // One kernel reads every input while it writes out and the final states,
    // in vectors of up to 16 bytes.
    for (Tensor* input : {&in.q, &in.k, &in.g, &in.beta, &in.A_log, &in.dt_bias}) {
      *input = staged16(*input);
      if (overlaps_outputs(*input, out_c, final_c)) {
        *input = input->clone();
      }
    }
    params.q = in.q.data_ptr(), params.k = in.k.data_ptr(), params.g = in.g.data_ptr();
    params.beta = in.beta.data_ptr(), params.A_log = float_data_or_null(in.A_log);
    params.dt_bias = float_data_or_null(in.dt_bias);
    decode_forward(params, init, final_c, p.state_dtype == at::kFloat, stream);
  } else {
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

    ForwardPlan plan = forward_plan(params, kept_records != nullptr);
    if (plan.segments > 1) {
      run_segmented_forward(params, q, plan, bounds.offsets.defined() ? bounds.offsets.select(0, 0) : Tensor(), init,
                            final_c, kept_records);
    } else {
      run_windows(params, q, plan, kept_records, in, out_c, final_c);
    }
  }

  if (!out_c.is_same(out)) {
    out.copy_(out_c);
  }
  if (final_state.has_value() && !final_c.is_same(*final_state)) {
    final_state->copy_(final_c);
  }
}

}  // namespace

// Sizes without kernels of their own run padded (padded_heads.h) into padded
// outputs, whose leading blocks are then copied out. chunk_states and records
// keep the padded sizes, which are the sizes kda.bwd checks them against.
void forward_served(const char* op, const Problem& p, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& g, const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias,
                    const optional<Tensor>& initial_state, const optional<Tensor>& cu_seqlens, const Tensor& out,
                    const optional<Tensor>& final_state, const Tensor& chunk_states, const Tensor& records,
                    bool decode_short_requests) {
  const bool decode = takes_decode_kernel(p, decode_short_requests, chunk_states, records);
  const int64_t D = decode ? kHeadDim : chunked_head_size(concrete(p.K), concrete(p.V));
  if (!pads_heads(p, D)) {
    forward_into(op, p, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state, chunk_states,
                 records, decode);
    return;
  }
  const PaddedInputs x = padded_inputs(p, D, q, k, v, g, dt_bias, initial_state);
  const int64_t K = concrete(p.K), V = concrete(p.V), Kp = concrete(x.p.K), Vp = concrete(x.p.V);
  std::vector<int64_t> out_sizes = out.sizes().vec();
  out_sizes.back() = Vp;
  const Tensor out_p = at::empty(out_sizes, out.options());
  optional<Tensor> final_p;
  if (final_state.has_value()) {
    final_p = at::empty({concrete(p.N), concrete(p.H), Vp, Kp}, final_state->options().dtype(p.state_dtype));
  }
  forward_into(op, x.p, x.q, x.k, x.v, x.g, beta, A_log, x.dt_bias, x.initial_state, cu_seqlens, out_p, final_p,
               chunk_states, records, decode);
  out.copy_(out_p.narrow(-1, 0, V));
  if (final_state.has_value()) {
    final_state->copy_(final_p->narrow(-2, 0, V).narrow(-1, 0, K));
  }
}

namespace {

std::tuple<Tensor, Tensor> fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                               const optional<Tensor>& A_log_, const optional<Tensor>& dt_bias_, optional<double> scale,
                               optional<double> lower_bound, const optional<Tensor>& initial_state,
                               bool output_final_state, const optional<Tensor>& cu_seqlens) {
  const Tensor A_log = or_undefined(A_log_), dt_bias = or_undefined(dt_bias_);
  Problem p = check_all("kda.fwd", q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  c10::cuda::CUDAGuard guard(q.device());
  ForwardOutputs o = allocate_forward_outputs(p, q, output_final_state);
  forward_served("kda.fwd", p, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, o.out,
               output_final_state ? optional<Tensor>(o.final_state) : std::nullopt);
  return {o.out, o.final_state};
}

// kda::_fwd_checkpointed (not API): fwd that also keeps every chunk-start state
// (checkpoints.h), for autograd to hand to bwd.
std::tuple<Tensor, Tensor, Tensor, Tensor> fwd_checkpointed(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                                    const Tensor& beta,
                                                    const optional<Tensor>& A_log_, const optional<Tensor>& dt_bias_,
                                                    optional<double> scale, optional<double> lower_bound,
                                                    const optional<Tensor>& initial_state, bool output_final_state,
                                                    const optional<Tensor>& cu_seqlens, c10::string_view save) {
  const Tensor A_log = or_undefined(A_log_), dt_bias = or_undefined(dt_bias_);
  // Named kda.fwd in messages: torch_kda.kda calls this op in fwd's place.
  const char* op = "kda.fwd";
  Problem p = check_all(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  const Save what = parse_save(op, save);
  c10::cuda::CUDAGuard guard(q.device());
  ForwardOutputs o = allocate_forward_outputs(p, q, output_final_state);
  auto [checkpoints, records] = allocate_saved(p, q, cu_seqlens.has_value(), what);
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
  forward_served(op, p, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, o.out,
                 output_final_state ? optional<Tensor>(o.final_state) : std::nullopt, checkpoints, records);
  return {o.out, o.final_state, checkpoints, records};
}

void fwd_inplace(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                 const optional<Tensor>& A_log_, const optional<Tensor>& dt_bias_,
                 at::Tensor& out, const optional<Tensor>& final_state,
                 optional<double> scale, optional<double> lower_bound, const optional<Tensor>& initial_state,
                 const optional<Tensor>& cu_seqlens) {
  const Tensor A_log = or_undefined(A_log_), dt_bias = or_undefined(dt_bias_);
  Problem p = check_all("kda.fwd_", q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  check_inplace_buffers("kda.fwd_", p, q, out, final_state, initial_state);
  check_outputs_disjoint("kda.fwd_", out, final_state);
  c10::cuda::CUDAGuard guard(q.device());
  // Serving code written for flash_kda calls this with one token or a few a
  // sequence: those take the decode kernel (heuristics.h, pool_by_decode).
  forward_served("kda.fwd_", p, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state,
                 Tensor(), Tensor(), true);
}

// kda.bwd with the backward kernels (backward/schedule.h: K1 for the records
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
  const int64_t H = concrete(p.H), N = concrete(p.N), D = concrete(p.K);  // K = V: a served size
  Boundaries bounds = sequence_boundaries(op, p, q, cu_seqlens, stream);
  CallInputs in = call_inputs(p, q, k, v, g, beta, A_log, dt_bias, bounds);
  // The forward's chunk-start states (checked by bwd) spare the recurrence's
  // passes, and its records (given only with the states) K1's.
  const bool saved = checkpoints.defined() && checkpoints.numel() > 0;
  const bool saved_records = records.defined() && records.numel() > 0;
  const BackwardPlan plan = backward_plan(
      in.params, static_cast<int64_t>(at::cuda::getDeviceProperties(q.device().index())->totalGlobalMem), saved,
      saved_records);
  Tensor init = staged16(initial_state.value_or(Tensor()));
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor go = sweep_grad_out(grad_out);
  // Read in float2 vectors (a view from cat's backward may start mid-vector).
  Tensor gf = staged16(grad_final_state.has_value() ? grad_final_state->to(at::kFloat) : Tensor());
  Tensor d_initial = init.defined() ? at::empty({N, H, D, D}, f32) : Tensor();
  BackwardOutputs o = allocate_backward_outputs(p, q, k, v, g, beta, A_log, dt_bias, initial_state);
  // Grouped value heads: K1's backward leaves each value head's part of dq and
  // dk in fp32, summed over each group below (deterministic).
  const int64_t group = in.params.group;
  Tensor dq_parts = group > 1 ? at::empty(v.sizes(), f32) : Tensor();
  Tensor dk_parts = group > 1 ? at::empty(v.sizes(), f32) : Tensor();
  Tensor& dq_out = group > 1 ? dq_parts : o.dq;
  Tensor& dk_out = group > 1 ? dk_parts : o.dk;
  // The gradients straight from K1's backward (bf16, dg fp32 for an fp32
  // precomputed gate; contiguous: allocated so). Zeros where no chunk covers a
  // token (only a malformed cu_seqlens leaves any): those tokens alone, as
  // zeroing the five tensors whole would write each of them once more.
  if (cu_seqlens.has_value()) {
    ZeroRows rows;
    int r = 0;
    for (Tensor* t : {&dq_out, &dk_out, &o.dv, &o.dg, &o.dbeta}) {
      rows.base[r] = t->data_ptr();
      // In bf16 units: an fp32 dg (a precomputed fp32 gate's) is twice as wide.
      rows.width[r++] = t->numel() * t->element_size() / 2 / std::max<int64_t>(concrete(p.T), 1);
    }
    launch_zero_uncovered(in.params.seq_offsets, N, concrete(p.T), rows, stream);
  }
  // Zeros: the blocks of slots past the live chunks return without writing
  // their part. A precomputed gate has neither parameter.
  const bool gate_params = !p.precomputed_gate;
  Tensor ddt_part = gate_params ? at::zeros({bounds.num_slots, H, D}, f32) : Tensor();
  Tensor dA_part = gate_params ? at::zeros({blocks_of_head_size(D) * bounds.num_slots, H}, f32) : Tensor();

  BackwardCall call;
  call.fwd = in.params;
  call.fwd.initial_state = init.defined() ? init.data_ptr() : nullptr;
  call.grad_out = go.data_ptr();
  call.grad_out_fp32 = go.scalar_type() == at::kFloat;
  call.grad_final = gf.defined() ? gf.data_ptr<float>() : nullptr;
  call.d_initial = d_initial.defined() ? d_initial.data_ptr<float>() : nullptr;
  call.grads.dq = dq_out.data_ptr();
  call.grads.dk = dk_out.data_ptr();
  call.grads.dv = o.dv.data_ptr();
  call.grads.dg = o.dg.data_ptr();
  call.grads.dbeta = o.dbeta.data_ptr();
  call.grads.ddt_bias_part = gate_params ? ddt_part.data_ptr<float>() : nullptr;
  call.grads.dA_log_part = gate_params ? dA_part.data_ptr<float>() : nullptr;
  run_backward(call, in.v, plan, saved ? checkpoints.data_ptr() : nullptr,
               saved_records ? records.data_ptr<float>() : nullptr);

  if (gate_params) {
    o.ddt_bias.copy_(ddt_part.sum(0));
    o.dA_log.copy_(dA_part.sum(0));
  }
  if (init.defined()) {
    o.dinitial_state.copy_(d_initial);
  }
  if (group > 1) {
    const int64_t B = concrete(p.B), T = concrete(p.T), Hq = concrete(p.H_qk);
    o.dq.copy_(dq_parts.view({B, T, Hq, group, D}).sum(3));
    o.dk.copy_(dk_parts.view({B, T, Hq, group, D}).sum(3));
  }
  return {o.dq, o.dk, o.dv, o.dg, o.dbeta, o.dA_log, o.ddt_bias, o.dinitial_state};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> bwd(
    const Tensor& grad_out, const optional<Tensor>& grad_final_state, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& g, const Tensor& beta,
    const optional<Tensor>& A_log_, const optional<Tensor>& dt_bias_,
    optional<double> scale, optional<double> lower_bound, const optional<Tensor>& initial_state,
    const optional<Tensor>& cu_seqlens, const optional<Tensor>& checkpoints, const optional<Tensor>& records) {
  const Tensor A_log = or_undefined(A_log_), dt_bias = or_undefined(dt_bias_);
  Problem p = check_all("kda.bwd", q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, initial_state, cu_seqlens);
  check_backward_grads("kda.bwd", p, q, grad_out, grad_final_state);
  check_saved("kda.bwd", p, cu_seqlens.has_value(), q, checkpoints, records);
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t D = chunked_head_size(concrete(p.K), concrete(p.V));
  if (!pads_heads(p, D)) {
    return backward_by_kernels(p, grad_out, grad_final_state, q, k, v, g, beta, A_log, dt_bias, initial_state,
                               cu_seqlens, checkpoints.value_or(Tensor()), records.value_or(Tensor()));
  }
  // Sizes without kernels of their own (padded_heads.h): the padded problem's
  // gradients, of which the real channels' are the leading blocks.
  const PaddedInputs x = padded_inputs(p, D, q, k, v, g, dt_bias, initial_state);
  const int64_t K = concrete(p.K), V = concrete(p.V), Kp = concrete(x.p.K), Vp = concrete(x.p.V);
  // (An empty grad_final_state stands for None.)
  const optional<Tensor> gf = grad_final_state.has_value() && grad_final_state->dim() == 4
                                  ? optional<Tensor>(padded_to(*grad_final_state, {Vp, Kp}))
                                  : grad_final_state;
  auto [dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinit] =
      backward_by_kernels(x.p, padded_to(grad_out, {Vp}), gf, x.q, x.k, x.v, x.g, beta, A_log, x.dt_bias,
                          x.initial_state, cu_seqlens, checkpoints.value_or(Tensor()), records.value_or(Tensor()));
  return {leading_block(dq, {K}), leading_block(dk, {K}), leading_block(dv, {V}), leading_block(dg, {K}), dbeta,
          dA_log, ddt_bias.dim() == 2 ? leading_block(ddt_bias, {K}) : ddt_bias,  // [0] for a precomputed gate
          dinit.numel() > 0 ? leading_block(dinit, {V, K}) : dinit};
}

}  // namespace

TORCH_LIBRARY_IMPL(kda, CUDA, m) {
  m.impl("fwd", &fwd);
  m.impl("fwd_", &fwd_inplace);
  m.impl("_fwd_checkpointed", &fwd_checkpointed);
  m.impl("bwd", &bwd);
}

}  // namespace kda::cuda
