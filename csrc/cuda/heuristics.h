// Every automatic choice of the CUDA path, in one place: K2's and the dS
// recurrence's block shapes, the 4x1w forward's copy point, the windows of
// chunk slots that bound the forward's workspace and the backward's scratch,
// and the segments a long sequence is cut into (segments.h; in the backward,
// a lone sequence's windows or a batch's sequences in one pass). None of them
// changes a result's meaning; the block shapes and the segments change its low
// bits (they sum in different orders), the windows none but where the
// backward cuts them into segments, which follow the window. The testing hook
// (testing/hook.h) overrides each of them for the whole process.
#pragma once

#include <cstdint>

#include "cuda/launch.h"
#include "cuda/params.h"

namespace kda::cuda {

// The warps that K2 gives each SM when every (sequence, head) has its D / 16 row
// groups resident at once; its block shape follows from this.
inline int64_t recurrence_warps_per_sm(const FwdParams& p) {
  return (p.N * p.H * (p.head_size / 16) + p.num_sms - 1) / p.num_sms;
}

// What one forward call runs: K2's shape and the chunk slots per window
// (params.num_slots for one pass), or the segments each sequence is cut into
// (segments.h; one pass, K2's shape then chosen for the segments).
// kept_records: the records are kept for the backward (kda._fwd_checkpointed),
// all in the caller's buffer, so one pass.
struct ForwardPlan {
  RecurrenceShape recurrence;
  int64_t window = 0;
  int64_t segments = 1;
};
ForwardPlan forward_plan(const FwdParams& params, bool kept_records);

// What one backward call runs: K2's shape (its passes without output), the dS
// recurrence's, the chunk slots per window, and the segments each window's
// dS recurrence is cut into (backward/schedule.cpp: a lone sequence's
// windows, or every sequence of one pass; the dS recurrence's shape then
// chosen for the segments). device_memory: the
// device's total, in bytes; saved_states, saved_records: the forward's
// chunk-start states, and its records, are given.
struct BackwardPlan {
  RecurrenceShape recurrence;
  DsBlock ds_block = DsBlock::k4x1;
  int64_t window = 0;
  int64_t segments = 1;
};
BackwardPlan backward_plan(const FwdParams& params, int64_t device_memory, bool saved_states, bool saved_records);

// Whether kda::fwd_pool_ (and kda::fwd_) run the decode kernel (pool.cu),
// token by token per (request, head), rather than the chunked forward (between
// copies from and to the pool): for speculative decoding always (it writes a
// state after every token), else where the requests average few tokens.
bool pool_by_decode(int64_t tokens, int64_t requests, bool speculative);

}  // namespace kda::cuda
