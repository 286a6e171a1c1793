// The CUDA kernels of torch.ops.kda_testing (testing/ops.cpp), and the CUDA
// part of the testing hook (testing/hook.h): kda_testing::force sets what
// heuristics.cpp then takes in place of its automatic choices, for every op of
// the process until it is set again.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <c10/util/string_view.h>

#include <string>
#include <tuple>
#include <utility>

#include "cuda/heuristics.h"
#include "cuda/launch.h"
#include "cuda/staging.h"
#include "kda.h"
#include "testing/hook.h"

namespace kda::cuda {
namespace {

using at::Tensor;
using std::optional;

// `name` among the shapes, or none for "auto"; any other raises, naming the choices.
template <typename Shape, size_t N>
std::optional<Shape> shape_named(const char* arg, c10::string_view name,
                                 const std::pair<const char*, Shape> (&shapes)[N]) {
  if (name == "auto") {
    return std::nullopt;
  }
  std::string names = "auto";
  for (const auto& [shape_name, shape] : shapes) {
    if (name == shape_name) {
      return shape;
    }
    names += std::string(", ") + shape_name;
  }
  TORCH_CHECK(false, "kda_testing.force: ", arg, " must be one of ", names, ", got '", std::string(name), "'");
}

template <typename Shape, size_t N>
std::string name_of(const std::optional<Shape>& shape, const std::pair<const char*, Shape> (&shapes)[N]) {
  for (const auto& [shape_name, s] : shapes) {
    if (shape.has_value() && *shape == s) {
      return shape_name;
    }
  }
  return "auto";
}

// Validates every argument before it sets any; leaves the segments as they are.
void force(c10::string_view recurrence_block, c10::string_view ds_block, int64_t window_slots) {
  const std::optional<RecurrenceBlock> recurrence =
      shape_named("recurrence_block", recurrence_block, kRecurrenceBlocks);
  const std::optional<DsBlock> ds = shape_named("ds_block", ds_block, kDsBlocks);
  TORCH_CHECK(window_slots >= -1, "kda_testing.force: window_slots must be -1 (automatic), 0 (one pass) or a "
              "positive number of chunk slots, got ", std::to_string(window_slots));
  const std::optional<int64_t> window = window_slots >= 0 ? std::optional<int64_t>(window_slots) : std::nullopt;
  change_forced([&](Forced& f) {
    f.recurrence_block = recurrence;
    f.ds_block = ds;
    f.window_slots = window;
  });
}

// The settings now, as force takes them.
std::tuple<std::string, std::string, int64_t> forced_now() {
  const Forced f = forced();
  return {name_of(f.recurrence_block, kRecurrenceBlocks), name_of(f.ds_block, kDsBlocks),
          f.window_slots.value_or(-1)};
}

// What heuristics.h's plans read of a call of N sequences of `tokens` tokens in
// all (N of equal length, or varlen), H heads of a served head size, on a
// device of num_sms SMs: host logic alone, no GPU needed.
FwdParams plan_params(const char* op, int64_t N, int64_t tokens, bool varlen, int64_t H, int64_t num_sms,
                      bool bf16_products, int64_t head_size) {
  TORCH_CHECK(N >= 1 && tokens >= 0 && H >= 0 && num_sms >= 1 && (varlen || tokens % N == 0), op,
              ": N and num_sms must be >= 1, tokens and H >= 0, and tokens a multiple of N without varlen");
  TORCH_CHECK(head_size <= kMaxHeadSize && ChunkedHeadSizes::contains(static_cast<int>(head_size)), op,
              ": head_size must be a size the chunked kernels serve (64, 128 or 256), got ",
              std::to_string(head_size));
  const int64_t num_slots = concrete(varlen ? chunk_slots(1, tokens, N, true) : chunk_slots(N, tokens / N, N, false));
  FwdParams p;
  p.N = N;
  p.H = H;
  p.num_slots = num_slots;
  p.slot_end = num_slots;
  p.num_sms = static_cast<int>(num_sms);
  p.head_size = static_cast<int>(head_size);
  p.bf16_products = bf16_products;
  p.state_fp32 = !bf16_products;
  return p;
}

// The forward's plan under the hook's settings: K2's block shape, its late
// copies, the window in slots and the segments a sequence.
std::tuple<std::string, bool, int64_t, int64_t> forward_plan_for(int64_t N, int64_t tokens, bool varlen, int64_t H,
                                                                 int64_t num_sms, bool bf16_products,
                                                                 bool kept_records, int64_t head_size) {
  const FwdParams p =
      plan_params("kda_testing.forward_plan", N, tokens, varlen, H, num_sms, bf16_products, head_size);
  const ForwardPlan plan = forward_plan(p, kept_records);
  return {name_of(std::optional<RecurrenceBlock>(plan.recurrence.block), kRecurrenceBlocks),
          plan.recurrence.late_refill, plan.window, plan.segments};
}

// The backward's plan under the hook's settings, on a device of device_memory
// bytes, given the forward's chunk-start states and records or not (torch_kda.kda
// keeps both by default): K2's block shape, the dS recurrence's, the window in
// slots, the segments a window's dS recurrence is cut into.
std::tuple<std::string, std::string, int64_t, int64_t> backward_plan_for(int64_t N, int64_t tokens, bool varlen,
                                                                         int64_t H, int64_t num_sms,
                                                                         bool bf16_products, int64_t head_size,
                                                                         int64_t device_memory, bool saved_states,
                                                                         bool saved_records) {
  const FwdParams p =
      plan_params("kda_testing.backward_plan", N, tokens, varlen, H, num_sms, bf16_products, head_size);
  const BackwardPlan plan = backward_plan(p, device_memory, saved_states, saved_records);
  return {name_of(std::optional<RecurrenceBlock>(plan.recurrence.block), kRecurrenceBlocks),
          name_of(std::optional<DsBlock>(plan.ds_block), kDsBlocks), plan.window, plan.segments};
}

// An intermediate that a private test op takes in (what the backward's kernels
// pass each other: fp32, or bf16 for the chunk states): contiguous, on q's
// device, of exactly this dtype and shape.
void check_scratch_input(const char* op, const char* name, const Tensor& t, const Tensor& q,
                         at::IntArrayRef shape, at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK(t.device() == q.device() && t.scalar_type() == dtype && t.is_contiguous() && t.sizes() == shape,
              op, ": ", name, " must be a contiguous ", dtype == at::kFloat ? "float32" : "bfloat16",
              " tensor on q's device of shape ", shape_str(c10::fromIntArrayRefSlow(shape)));
}

// The backward's kernels run here unpadded: K = V = 128 only.
void check_kernels_head_size(const char* op, const Problem& p) {
  TORCH_CHECK(concrete(p.K) == kHeadDim && concrete(p.V) == kHeadDim, op, ": takes K = V = ",
              std::to_string(kHeadDim), ", got K = ", std::to_string(concrete(p.K)), ", V = ",
              std::to_string(concrete(p.V)));
}

// K1's backward alone.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> prepare_bwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                               const Tensor& g, const Tensor& beta,
                                                               const Tensor& A_log, const Tensor& dt_bias,
                                                               const Tensor& d_record, optional<double> scale,
                                                               double lower_bound) {
  const char* op = "kda_testing.prepare_bwd";
  Problem p = check_all(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, std::nullopt, std::nullopt);
  check_kernels_head_size(op, p);
  const int64_t B = concrete(p.B), T = concrete(p.T), H = concrete(p.H);
  const int64_t slots = concrete(chunk_slots(p.B, p.T, p.N, false));
  check_scratch_input(op, "d_record", d_record, q, {slots, H, record_grad_floats(kHeadDim)});
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

// K1, then the backward sweep alone.
std::tuple<Tensor, Tensor, Tensor> sweep_bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                     const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias,
                                     const Tensor& states, const Tensor& grad_out,
                                     const optional<Tensor>& grad_final_state, optional<double> scale,
                                     double lower_bound) {
  const char* op = "kda_testing.sweep_bwd";
  Problem p = check_all(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, std::nullopt, std::nullopt);
  check_kernels_head_size(op, p);
  const int64_t B = concrete(p.B), H = concrete(p.H);
  const int64_t slots = concrete(chunk_slots(p.B, p.T, p.N, false));
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
  Tensor workspace = at::empty({slots, H, record_floats(kHeadDim)}, f32);
  Tensor d_record = at::empty({slots, H, record_grad_floats(kHeadDim)}, f32);
  Tensor d_initial = at::empty({B, H, kHeadDim, kHeadDim}, f32);
  Tensor d_states = at::empty({slots, H, kHeadDim, kHeadDim}, q.options().dtype(at::kBFloat16));
  SweepBwdParams bp;
  bp.d_states = d_states.data_ptr();
  bp.fwd = in.params;
  bp.fwd.workspace = workspace.data_ptr<float>();
  FwdParams& fp = bp.fwd;
  fp.lo_for_backward = true;
  bp.states = st.data_ptr();
  bp.grad_out = go.data_ptr();
  bp.grad_out_fp32 = go.scalar_type() == at::kFloat;
  bp.grad_final = gf.defined() ? gf.data_ptr<float>() : nullptr;
  bp.d_record = d_record.data_ptr<float>();
  bp.d_initial = d_initial.data_ptr<float>();
  const int64_t memory = static_cast<int64_t>(at::cuda::getDeviceProperties(q.device().index())->totalGlobalMem);
  const DsBlock ds_block = backward_plan(fp, memory, true, false).ds_block;
  launch_prepare(fp, stream);
  launch_ds_recurrence(bp, stream, ds_block);
  launch_record_gradients(bp, stream);
  return {d_record, d_initial, d_states};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kda_testing, m) {
  // The testing hook's CUDA settings: "auto" and -1 leave a choice to heuristics.cpp.
  m.def("force(str recurrence_block=\"auto\", str ds_block=\"auto\", int window_slots=-1) -> ()", &force);
  m.def("forced() -> (str recurrence_block, str ds_block, int window_slots)", &forced_now);
  m.def("forward_plan(int N, int tokens, bool varlen, int H, int num_sms, bool bf16_products, bool kept_records, "
        "int head_size=128) -> (str recurrence_block, bool late_refill, int window, int segments)",
        &forward_plan_for);
  m.def("backward_plan(int N, int tokens, bool varlen, int H, int num_sms, bool bf16_products, int head_size, "
        "int device_memory, bool saved_states=True, bool saved_records=True) -> "
        "(str recurrence_block, str ds_block, int window, int segments)", &backward_plan_for);
}

TORCH_LIBRARY_IMPL(kda_testing, CUDA, m) {
  m.impl("prepare_bwd", &prepare_bwd);
  m.impl("sweep_bwd", &sweep_bwd);
}

}  // namespace kda::cuda
