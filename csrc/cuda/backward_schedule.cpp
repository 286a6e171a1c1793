#include "cuda/backward_schedule.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "checkpoints.h"
#include "cuda/forward_schedule.h"

namespace kda::cuda {
namespace {

// One fp32 state (the checkpoints and the carries; the scratch states are bf16).
constexpr int64_t kFp32StateBytes = kHeadDim * kHeadDim * 4;
// Below this a pass over the whole call is kept: windows cost a second forward
// (for the checkpoints; measured 7.6 against 6.2 ms per step at 8192 tokens x
// 32 heads, H200) and a few launches per window.
constexpr int64_t kOnePassScratch = int64_t{256} << 20;
// Windows are cut from the call's slots, so with several sequences a window
// holds few of them and the sequential kernels lose their parallelism across
// sequences (8 x 8192 tokens x 32 heads: 41 -> 66 ms per step). Calls of
// several sequences keep one pass up to this much scratch: speed over memory
// where the memory is there: at most a quarter of the device's. (Windows along
// each sequence would serve both.)
constexpr int64_t kOnePassScratchSeveralSequences = int64_t{32} << 30;
// With the forward's chunk-start states a window costs no forward pass, only
// the dS recurrence's parallelism across the sequences it holds: calls of
// several sequences then run in as few equal windows as hold at most this
// much scratch each (8 x 8192 tokens x 32 heads: two windows of four
// sequences, 19.15 GiB of one pass down to ~13 GiB at the step's peak).
constexpr int64_t kWindowScratchSeveralSequences = int64_t{8} << 30;

}  // namespace

int64_t backward_window_slots(const FwdParams& p, int64_t device_memory, bool saved_states, bool saved_records) {
  if (const char* env = std::getenv("TORCH_KDA_WINDOW_SLOTS"); env != nullptr && *env != '\0') {
    return window_slots(p, "kda.bwd");  // the forward's reading of it (checks the value)
  }
  const int64_t per_slot =
      p.H * (kBwdSlotScratchBytes - (saved_states ? kBwdStateBytes : 0) - (saved_records ? kWsChunkBytes : 0));
  if (saved_states && p.N > 1) {
    const int64_t limit = std::min(kWindowScratchSeveralSequences, device_memory / 4);
    const int64_t windows = std::max<int64_t>(1, (p.num_slots * per_slot + limit - 1) / limit);
    return (p.num_slots + windows - 1) / windows;
  }
  const int64_t one_pass_limit =
      p.N > 1 ? std::min(kOnePassScratchSeveralSequences, device_memory / 4) : kOnePassScratch;
  if (p.num_slots * per_slot <= one_pass_limit) {
    return p.num_slots;
  }
  if (saved_states) {  // no checkpoints to balance against
    const int64_t w = backward_window_floor(p.H);
    return w >= p.num_slots ? p.num_slots : w;
  }
  // Windows hold about 1 GiB of scratch or more (fewer, longer windows: the
  // checkpoint pass covers all windows but the last). Scratch grows with the
  // window, the checkpoints (a state per sequence and head for each window)
  // with the number of windows: their sum is least at sqrt(slots * checkpoint
  // / per_slot), which calls for longer windows only past ~10^6 tokens.
  const double checkpoint = static_cast<double>(p.N) * p.H * kFp32StateBytes;
  const auto balanced = static_cast<int64_t>(std::ceil(std::sqrt(p.num_slots * checkpoint / per_slot)));
  const int64_t w = std::max(balanced, backward_window_floor(p.H));
  return w >= p.num_slots ? p.num_slots : w;
}

void run_backward(const BackwardCall& call, const at::Tensor& like, int64_t window, RecurrenceBlock block,
                  DsBlock ds_block, const void* saved_states, const float* saved_records) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(like.device().index()).stream();
  const auto f32 = like.options().dtype(at::kFloat);
  FwdParams p = call.fwd;
  const int64_t S = p.num_slots, H = p.H, N = p.N, D = kHeadDim;
  if (window <= 0 || window > S) {
    window = S;
  }
  const int64_t windows = S > 0 ? (S + window - 1) / window : 1;
  const bool recur = saved_states == nullptr;  // K2's passes make the chunk-start states
  // The records' passes would need K1 of the checkpoint pass's records too;
  // check_saved has rejected records without the states.
  TORCH_INTERNAL_ASSERT(saved_records == nullptr || !recur, "kda.bwd: records are used only with the chunk-start states");
  // K2's passes here move only the states: no output, no final state.
  at::Tensor workspace = saved_records == nullptr ? at::empty({window, H, kWsChunkFloats}, f32) : at::Tensor();
  const auto bf16 = like.options().dtype(at::kBFloat16);
  at::Tensor states = recur ? at::empty({window, H, D, D}, bf16) : at::Tensor();
  at::Tensor d_states = at::empty({window, H, D, D}, bf16);
  at::Tensor d_record = at::empty({window, H, kDRecFloats}, f32);
  p.out = nullptr;
  p.final_state = nullptr;
  p.workspace = workspace.defined() ? workspace.data_ptr<float>() : nullptr;

  at::Tensor carry, d_carry, checkpoints;
  if (windows > 1) {
    d_carry = at::empty({N, H, D, D}, f32);
  }
  if (windows > 1 && recur) {
    carry = at::empty({N, H, D, D}, f32);
    // checkpoints[w]: every sequence's state at window w + 1's start (only those
    // of the sequences that run on into window w + 1 are read).
    checkpoints = at::empty({windows - 1, N, H, D, D}, f32);
    p.carry = carry.data_ptr<float>();
    p.chunk_states = nullptr;
    for (int64_t w = 0; w + 1 < windows; ++w) {
      p.slot_begin = w * window;
      p.slot_end = std::min(S, p.slot_begin + window);
      launch_prepare(p, stream);
      launch_recurrence(p, stream, block);
      C10_CUDA_CHECK(cudaMemcpyAsync(checkpoints[w].data_ptr(), p.carry, N * H * kFp32StateBytes,
                                     cudaMemcpyDeviceToDevice, stream));
    }
  }

  // All on the caller's stream, in order. K2 storing the states and the dS
  // recurrence share only the records, but side by side on two streams both
  // (issue-bound) ran slower and the step was slower on four of five cases, so
  // they run one after the other.
  p.chunk_states = recur ? states.data_ptr() : nullptr;
  p.lo_for_backward = true;  // the dS recurrence reads all of the records
  for (int64_t w = windows - 1; w >= 0; --w) {
    p.slot_begin = w * window;
    p.slot_end = std::min(S, p.slot_begin + window);
    if (saved_records != nullptr) {
      // The kernels index the records from the window's first slot; only read
      // here (no K1 for them runs).
      p.workspace = const_cast<float*>(saved_records) + p.slot_begin * H * kWsChunkFloats;
    } else {
      launch_prepare(p, stream);
    }
    if (recur) {
      // K2 reads the state of a sequence that runs on from an earlier window
      // from the checkpoint (and writes it back there at the end: not read again).
      p.carry = w > 0 ? checkpoints[w - 1].data_ptr<float>() : (carry.defined() ? carry.data_ptr<float>() : nullptr);
      launch_recurrence(p, stream, block);
    }

    SweepBwdParams sp;
    sp.fwd = p;
    sp.states = recur ? states.data_ptr()
                      : static_cast<const unsigned char*>(saved_states) + p.slot_begin * H * kBwdStateBytes;
    sp.grad_out = call.grad_out;
    sp.grad_out_fp32 = call.grad_out_fp32;
    sp.grad_final = call.grad_final;
    sp.d_states = d_states.data_ptr();
    sp.d_record = d_record.data_ptr<float>();
    sp.d_carry = d_carry.defined() ? d_carry.data_ptr<float>() : nullptr;
    sp.d_initial = call.d_initial;
    launch_sweep_backward(sp, stream, ds_block);

    // K1's backward recomputes what it needs of the records from the inputs.
    PrepareBwdParams pp;
    pp.fwd = p;
    pp.fwd.workspace = nullptr;
    pp.fwd.chunk_states = nullptr;
    pp.fwd.out = nullptr;
    pp.fwd.carry = nullptr;
    pp.d_record = d_record.data_ptr<float>();
    pp.chain = true;
    pp.grads = call.grads;
    // It indexes the parts from the window's first slot; they are kept by absolute slot.
    pp.grads.ddt_bias_part += p.slot_begin * H * D;
    pp.grads.dA_log_part += p.slot_begin * H;
    launch_prepare_backward(pp, stream);
  }
}

}  // namespace kda::cuda
