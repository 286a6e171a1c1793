// What kda._fwd_checkpointed keeps for the CUDA backward: the state at the
// start of every chunk slot, in bf16 as the backward's record gradients read it
// (cuda/backward_schedule.h), so that the backward runs no recurrence pass of
// its own; and K1's records of every chunk slot (cuda/params.h), so that it
// runs no K1 for them either. Shared by the real and the Meta kernels, so that
// the shapes agree by construction.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

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

// Whether kda._fwd_checkpointed also keeps the records (27,136 bytes per chunk
// slot and head, 1.66 KiB per token and head): yes with the states unless
// TORCH_KDA_SAVE_RECORDS=0; never without the states (the backward's passes
// that recompute the states recompute the records too), and
// TORCH_KDA_SAVE_RECORDS=1 with TORCH_KDA_SAVE_STATES=0 raises, as does any
// other value.
bool save_records_enabled(const char* op, bool states);

// kda._fwd_checkpointed's two extra outputs, as the two settings above ask
// (read here, raising with `op` on a bad value); functions of the shapes alone.
//   checkpoints: bf16 [slots, H, 128, 128] on q's device, slot s the state at
//     the start of chunk slot s (as the CUDA kernels number the slots: B *
//     ceil(T / 16) for fixed length, min(T, ceil(T / 16) + N) with cu_seqlens;
//     the slots past a varlen batch's chunks are not written), or [0, H, 128,
//     128] when the states are not saved.
//   records: fp32 [slots, H, 6784] (a record's bytes as fp32 elements) on q's
//     device, the slots as for the checkpoints, or [0, H, 6784] when the
//     records are not kept.
struct SavedForBackward {
  at::Tensor checkpoints;
  at::Tensor records;
};
SavedForBackward allocate_saved(const char* op, const Problem& p, const at::Tensor& q, bool varlen);

// What a backward call was given of these: each absent, empty, or what
// allocate_saved gives for the same shapes, contiguous; records only with
// checkpoints.
void check_saved(const char* op, const Problem& p, bool varlen, const at::Tensor& q,
                 const std::optional<at::Tensor>& checkpoints, const std::optional<at::Tensor>& records);

}  // namespace kda
