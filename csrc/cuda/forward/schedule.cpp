#include "cuda/forward/schedule.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "cuda/launch.h"
#include "segments.h"

namespace kda::cuda {

// Windows hide none of K1's time beside K2's on a side stream, nor beside a
// persistent K1 on SMs of its own (both kernels are issue-bound:
// docs/performance-notes.md), so they run in order.
void run_forward(FwdParams p, const at::Tensor& like, const ForwardPlan& plan, float* records) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(like.device().index()).stream();
  const auto options = like.options().dtype(at::kFloat);
  const int64_t D = p.head_size, record = record_floats(p.head_size);
  int64_t window = plan.window;
  if (window <= 0 || window > p.num_slots) {
    window = p.num_slots;
  }
  at::Tensor workspace;
  if (records == nullptr) {
    workspace = at::empty({window, p.H, record}, options);
    p.workspace = workspace.data_ptr<float>();
  }
  at::Tensor carry;
  if (window < p.num_slots) {
    carry = at::empty({p.N, p.H, D, D}, options);
    p.carry = carry.data_ptr<float>();
  }
  // One stream: K1 of window w + 1 overwrites the records only after K2 of
  // window w has read them. A call without slots (only empty sequences) still
  // runs one K2, which moves the initial states to the final ones.
  auto* const chunk_states = static_cast<unsigned char*>(p.chunk_states);  // all the call's slots, or null
  int64_t begin = 0;
  do {
    p.slot_begin = begin;
    p.slot_end = std::min(p.num_slots, begin + window);
    if (chunk_states != nullptr) {
      p.chunk_states = chunk_states + begin * p.H * D * D * 2;  // bf16
    }
    if (records != nullptr) {  // K1 and K2 index the records from the window's first slot
      p.workspace = records + begin * p.H * record;
    }
    launch_prepare(p, stream);
    launch_recurrence(p, stream, plan.recurrence);
    begin = p.slot_end;
  } while (begin < p.num_slots);
}

// Passes 1 and 2 write only their end states, fp32; pass 3 starts every
// segment from the scan's fp32 state. Every pass keeps the call's products
// (bf16 for a bf16 state): only the state buffers differ from one pass's.
void run_segmented_forward(FwdParams p, const at::Tensor& like, const ForwardPlan& plan,
                           const at::Tensor& seq_offsets, const at::Tensor& initial, const at::Tensor& final_state,
                           float* records) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(like.device().index()).stream();
  const auto f32 = like.options().dtype(at::kFloat);
  const auto i64 = like.options().dtype(at::kLong);
  const int64_t N = p.N, H = p.H, P = plan.segments, S = N * P, D = p.head_size;
  const int64_t tokens = p.seq_offsets != nullptr ? p.T : N * p.T;

  const at::Tensor seq = seq_offsets.defined() ? seq_offsets : at::arange(N + 1, i64) * p.T;
  const at::Tensor cut = segment_offsets(seq, P);
  const at::Tensor offsets = at::empty({3, S + 1}, i64);
  int64_t* o = offsets.data_ptr<int64_t>();
  launch_boundaries(cut.data_ptr(), /*cu_int32=*/false, S, tokens, o, o + (S + 1), o + 2 * (S + 1), stream);
  p.N = S;
  p.seq_offsets = o;
  p.chunk_offsets = o + (S + 1);
  p.seq_order = o + 2 * (S + 1);
  p.slot_begin = 0;
  p.slot_end = p.num_slots;
  p.carry = nullptr;
  p.state_fp32 = true;
  at::Tensor workspace;
  if (records == nullptr) {
    workspace = at::empty({p.num_slots, H, record_floats(p.head_size)}, f32);
  }
  p.workspace = records != nullptr ? records : workspace.data_ptr<float>();
  launch_prepare(p, stream);

  const at::Tensor first = first_segment_states(initial, N, P, H, D, D, f32);
  const at::Tensor ends = at::empty({S, H, D, D}, f32);
  FwdParams pass = p;
  pass.out = nullptr;
  pass.chunk_states = nullptr;
  pass.initial_state = first.data_ptr();
  pass.final_state = ends.data_ptr();
  launch_recurrence(pass, stream, plan.recurrence);

  const at::Tensor identity = identity_states(N, P, H, D, f32);
  const at::Tensor maps = at::empty({S, H, D, D}, f32);
  pass.v = nullptr;  // read as zeros
  pass.initial_state = identity.data_ptr();
  pass.final_state = maps.data_ptr();
  launch_recurrence(pass, stream, plan.recurrence);

  const at::Tensor starts = at::empty({S, H, D, D}, f32);
  launch_segment_scan(maps.data_ptr<float>(), ends.data_ptr<float>(), initial.defined() ? initial.data_ptr() : nullptr,
                      initial.defined() && initial.scalar_type() == at::kFloat, starts.data_ptr<float>(), N, P, H,
                      p.head_size, stream);
  const at::Tensor seg_final = final_state.defined() ? at::empty({S, H, D, D}, f32) : at::Tensor();
  p.initial_state = starts.data_ptr();
  p.final_state = seg_final.defined() ? seg_final.data_ptr() : nullptr;
  launch_recurrence(p, stream, plan.recurrence);
  if (final_state.defined()) {
    final_state.copy_(last_segment_states(seg_final, P));
  }
}

}  // namespace kda::cuda
