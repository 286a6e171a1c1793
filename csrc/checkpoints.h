// The states that kda._fwd_checkpointed keeps for the CUDA backward: the state
// at the start of every chunk slot, in bf16 as the backward's record gradients
// read it (cuda/backward_schedule.h), so that the backward runs no recurrence
// pass of its own. Shared by the real and the Meta kernels, so that the
// checkpoints' shape agrees by construction.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kda.h"

namespace kda {

// The backward's window when the call is long enough to need windows: as few
// slots as hold kWindowScratch of scratch (at least 16), for H heads.
int64_t backward_window_floor(int64_t H);

// Whether kda._fwd_checkpointed keeps the states: yes unless TORCH_KDA_SAVE_STATES=0
// (2 KiB per token and head held from the forward to the backward; without
// them the backward recomputes them, with one more forward pass where it runs
// in windows). Raises on another value.
bool save_states_enabled(const char* op);

// The checkpoints output: bf16 [slots, H, 128, 128] on q's device, slot s the
// state at the start of chunk slot s (as the CUDA kernels number the slots:
// B * ceil(T / 16) for fixed length, min(T, ceil(T / 16) + N) with cu_seqlens;
// the slots past a varlen batch's chunks are not written), or [0, H, 128, 128]
// when the states are not saved. A function of the shapes alone.
at::Tensor allocate_checkpoints(const Problem& p, const at::Tensor& q, bool varlen, bool save);

// The checkpoints a backward call was given: empty (none), or what
// allocate_checkpoints gives for the same shapes, contiguous.
void check_checkpoints(const char* op, const Problem& p, bool varlen, const at::Tensor& q,
                       const at::Tensor& checkpoints);

}  // namespace kda
