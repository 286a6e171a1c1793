// The states that kda._fwd_checkpointed keeps for the CUDA backward, so that
// the backward's windows (cuda/backward_schedule.h) start from them instead of
// running a forward pass of their own first. Shared by the real and the Meta
// kernels, so that the checkpoints' shape agrees by construction.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "kda.h"

namespace kda {

// TORCH_KDA_WINDOW_SLOTS=n, the chunk slots per window that tests force on the
// forward and the backward (0: one pass); nullopt when unset. Raises on any
// other value, naming `op`.
std::optional<int64_t> forced_window_slots(const char* op);

// The backward's window when the call is long enough to need windows: as few
// slots as hold kWindowScratch of scratch (at least 16), for H heads.
int64_t backward_window_floor(int64_t H);

struct CheckpointPlan {
  c10::SymInt every = 0;  // chunk slots between checkpoints: one backward window
  c10::SymInt count = 0;  // checkpoints: the state at the start of each window, the first the initial one
};

// For one fixed-length sequence (B = 1, no cu_seqlens), the only calls whose
// backward runs in windows at sizes that fit in memory: a checkpoint every
// window of backward_window_floor(H) slots (or of TORCH_KDA_WINDOW_SLOTS), so
// ceil(slots / every) of them. None (count 0) otherwise: the backward then
// makes its own where it needs them.
CheckpointPlan checkpoint_plan(const char* op, const Problem& p, bool varlen);

// The checkpoints output: float32 [plan.count, H, 128, 128] on q's device.
at::Tensor allocate_checkpoints(const Problem& p, const at::Tensor& q, const CheckpointPlan& plan);

// The checkpoints a backward call was given: empty (none), or float32
// [plan.count, H, 128, 128] on q's device, contiguous.
void check_checkpoints(const char* op, const Problem& p, bool varlen, const at::Tensor& q,
                       const at::Tensor& checkpoints);

}  // namespace kda
