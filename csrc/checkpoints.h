// What kda._fwd_checkpointed keeps for the CUDA backward: the state at the
// start of every chunk slot, in bf16 as the backward's record gradients read it,
// so that the backward runs no recurrence pass of its own; and K1's records of
// every chunk slot, so that it runs no K1 for them either. Shared by the real and the Meta kernels, so that
// the shapes agree by construction.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include <c10/util/string_view.h>

#include "kda.h"

namespace kda {

// What kda._fwd_checkpointed keeps, its `save` argument:
//   "states_and_records": the chunk-start states (2 KiB per token and head)
//     and the records (1.66 KiB per token and head); the backward runs no
//     recurrence pass and no K1 of its own for them. The fastest backward.
//   "states": the states alone; the backward runs K1 for the records.
//   "none": neither; the backward recomputes both (with one more forward
//     pass where it runs in windows). The least memory between the two.
enum class Save { kStatesAndRecords, kStates, kNone };

// `save` as the enum; any other string raises, naming `op` and the choices.
Save parse_save(const char* op, c10::string_view save);

// kda._fwd_checkpointed's two extra outputs, as `save` asks; functions of the
// shapes and `save` alone.
//   checkpoints: bf16 [slots, H, D, D] on q's device at the chunked kernels'
//     head size D (chunked_head_size in constants.h: 64, 128 or 256; other
//     sizes zero-padded, cuda/padded_heads.h), slot s the state at the start of chunk slot s
//     (slots: chunk_slots in kda.h; the slots past a varlen batch's chunks are
//     not written), or [0, H, D, D] when the states are not saved.
//   records: fp32 [slots, H, record_bytes(D) / 4] (6784 at D = 128, 3648 at
//     64, 13056 at 256) on q's device, the slots as for the checkpoints, or [0, H, ...] when
//     the records are not kept.
struct SavedForBackward {
  at::Tensor checkpoints;
  at::Tensor records;
};
SavedForBackward allocate_saved(const Problem& p, const at::Tensor& q, bool varlen, Save save);

// What a backward call was given of these: each absent, empty, or what
// allocate_saved gives for the same shapes, contiguous; records only with
// checkpoints.
void check_saved(const char* op, const Problem& p, bool varlen, const at::Tensor& q,
                 const std::optional<at::Tensor>& checkpoints, const std::optional<at::Tensor>& records);

}  // namespace kda
