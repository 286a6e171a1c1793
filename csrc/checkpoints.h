// The states that kda._fwd_checkpointed keeps for the CUDA backward, so that
// the backward's windows (cuda/backward_schedule.h) start from them instead of
// running a forward pass of their own first. Shared by the real and the Meta
// kernels, so that the checkpoints' shape agrees by construction.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kda.h"

namespace kda {

// The backward's window when the call is long enough to need windows: as few
// slots as hold kWindowScratch of scratch (at least 16), for H heads.
int64_t backward_window_floor(int64_t H);

struct CheckpointPlan {
  int64_t every = 0;      // chunk slots between checkpoints: one backward window
  c10::SymInt count = 0;  // checkpoints: the state at the start of each window, the first the initial one
};

// For one fixed-length sequence (B = 1, no cu_seqlens), the only calls whose
// backward runs in windows at sizes that fit in memory: a checkpoint every
// window of backward_window_floor(H) slots, so ceil(slots / every) of them;
// none (count 0) otherwise, and the backward then makes its own where it needs
// them. A function of the shapes alone, so that a forward and its backward
// agree on where the checkpoints lie: TORCH_KDA_WINDOW_SLOTS does not move
// them (a backward given them runs their windows; the gradients are bitwise
// the same in any windows).
CheckpointPlan checkpoint_plan(const Problem& p, bool varlen);

// The checkpoints output: float32 [plan.count, H, 128, 128] on q's device.
at::Tensor allocate_checkpoints(const Problem& p, const at::Tensor& q, const CheckpointPlan& plan);

// The checkpoints a backward call was given: empty (none), or float32
// [plan.count, H, 128, 128] on q's device, contiguous.
void check_checkpoints(const char* op, const Problem& p, bool varlen, const at::Tensor& q,
                       const at::Tensor& checkpoints);

}  // namespace kda
