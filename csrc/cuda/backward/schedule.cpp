#include "cuda/backward/schedule.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "cuda/launch.h"

namespace kda::cuda {

void run_backward(const BackwardCall& call, const at::Tensor& like, const BackwardPlan& plan,
                  const void* saved_states, const float* saved_records) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(like.device().index()).stream();
  const auto f32 = like.options().dtype(at::kFloat);
  FwdParams p = call.fwd;
  TORCH_INTERNAL_ASSERT(ChunkedHeadSizes::contains(p.head_size), "the backward: no kernels for head size ",
                        std::to_string(p.head_size));
  const int64_t S = p.num_slots, H = p.H, N = p.N, D = p.head_size;
  int64_t window = plan.window;
  if (window <= 0 || window > S) {
    window = S;
  }
  const int64_t windows = S > 0 ? (S + window - 1) / window : 1;
  const bool recur = saved_states == nullptr;  // K2's passes make the chunk-start states
  // The records' passes would need K1 of the checkpoint pass's records too;
  // check_saved has rejected records without the states.
  TORCH_INTERNAL_ASSERT(saved_records == nullptr || !recur, "kda.bwd: records are used only with the chunk-start states");
  // K2's passes here move only the states: no output, no final state.
  at::Tensor workspace = saved_records == nullptr ? at::empty({window, H, record_floats(D)}, f32) : at::Tensor();
  const auto bf16 = like.options().dtype(at::kBFloat16);
  at::Tensor states = recur ? at::empty({window, H, D, D}, bf16) : at::Tensor();
  at::Tensor d_states = at::empty({window, H, D, D}, bf16);
  at::Tensor d_record = at::empty({window, H, record_grad_floats(D)}, f32);
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
      launch_recurrence(p, stream, plan.recurrence);
      C10_CUDA_CHECK(cudaMemcpyAsync(checkpoints[w].data_ptr(), p.carry, N * H * fp32_state_bytes(D),
                                     cudaMemcpyDeviceToDevice, stream));
    }
  }

  // All on the caller's stream, in order. K2 storing the states and the dS
  // recurrence share only the records, but both are issue-bound: side by side
  // on two streams each runs slower and the step gains nothing.
  p.chunk_states = recur ? states.data_ptr() : nullptr;
  p.lo_for_backward = true;  // the dS recurrence reads all of the records
  for (int64_t w = windows - 1; w >= 0; --w) {
    p.slot_begin = w * window;
    p.slot_end = std::min(S, p.slot_begin + window);
    if (saved_records != nullptr) {
      // The kernels index the records from the window's first slot; only read
      // here (no K1 for them runs).
      p.workspace = const_cast<float*>(saved_records) + p.slot_begin * H * record_floats(D);
    } else {
      launch_prepare(p, stream);
    }
    if (recur) {
      // K2 reads the state of a sequence that runs on from an earlier window
      // from the checkpoint (and writes it back there at the end: not read again).
      p.carry = w > 0 ? checkpoints[w - 1].data_ptr<float>() : (carry.defined() ? carry.data_ptr<float>() : nullptr);
      launch_recurrence(p, stream, plan.recurrence);
    }

    SweepBwdParams sp;
    sp.fwd = p;
    sp.states = recur ? states.data_ptr()
                      : static_cast<const unsigned char*>(saved_states) + p.slot_begin * H * bwd_state_bytes(D);
    sp.grad_out = call.grad_out;
    sp.grad_out_fp32 = call.grad_out_fp32;
    sp.grad_final = call.grad_final;
    sp.d_states = d_states.data_ptr();
    sp.d_record = d_record.data_ptr<float>();
    sp.d_carry = d_carry.defined() ? d_carry.data_ptr<float>() : nullptr;
    sp.d_initial = call.d_initial;
    launch_ds_recurrence(sp, stream, plan.ds_block);
    launch_record_gradients(sp, stream);

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
    // It indexes the parts from the window's first slot; they are kept by
    // absolute slot (none for a precomputed gate).
    if (!p.gate_given) {
      pp.grads.ddt_bias_part += p.slot_begin * H * D;
      pp.grads.dA_log_part += p.slot_begin * H;
    }
    launch_prepare_backward(pp, stream);
  }
}

}  // namespace kda::cuda
