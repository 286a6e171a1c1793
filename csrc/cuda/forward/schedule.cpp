#include "cuda/forward/schedule.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "cuda/launch.h"

namespace kda::cuda {

// Windows hide none of K1's time beside K2's on a side stream, nor beside a
// persistent K1 on SMs of its own (both kernels are issue-bound:
// docs/performance-notes.md), so they run in order.
void run_forward(FwdParams p, const at::Tensor& like, const ForwardPlan& plan, float* records) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(like.device().index()).stream();
  const auto options = like.options().dtype(at::kFloat);
  int64_t window = plan.window;
  if (window <= 0 || window > p.num_slots) {
    window = p.num_slots;
  }
  at::Tensor workspace;
  if (records == nullptr) {
    workspace = at::empty({window, p.H, kWsChunkFloats}, options);
    p.workspace = workspace.data_ptr<float>();
  }
  at::Tensor carry;
  if (window < p.num_slots) {
    carry = at::empty({p.N, p.H, kHeadDim, kHeadDim}, options);
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
      p.chunk_states = chunk_states + begin * p.H * kBwdStateBytes;
    }
    if (records != nullptr) {  // K1 and K2 index the records from the window's first slot
      p.workspace = records + begin * p.H * kWsChunkFloats;
    }
    launch_prepare(p, stream);
    launch_recurrence(p, stream, plan.recurrence);
    begin = p.slot_end;
  } while (begin < p.num_slots);
}

}  // namespace kda::cuda
