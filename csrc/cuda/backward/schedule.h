// How one backward call's kernels are enqueued, and the memory between them.
//
// Per chunk slot and head the backward's kernels pass each other (at D = 128)
// the record (27,136 bytes), the state at the chunk's start and dS at its end
// (32,768 bytes each, bf16: they reach only the record gradients' products)
// and the record's gradients (34,304 bytes): 7.75 KB per (token, head), 1.94
// GiB for one pass at 8192 tokens x 32 heads; at D = 64, 3,040 bytes per
// (token, head). The chunk-start states and the records come
// from the forward (kda._fwd_checkpointed keeps them, checkpoints.h) or else
// from K2's and K1's passes here. Where one pass would hold too much
// (heuristics.cpp), the slots are cut into windows, run from the last to
// the first: K1 (the records, without the forward's), K2 (the chunk-start
// states, without the forward's: from every sequence's state at the window's
// start, a checkpoint that a first forward pass of K1 and K2 without output
// makes), the dS recurrence from the dS that the later window left in a carry,
// the record gradients, and K1's backward, which writes the window's tokens of
// the gradients. The carries are fp32 and every kernel computes what it
// computes in one pass, so the gradients are bitwise those of one pass, with or
// without the forward's states and records (the forward's K1 is the backward's:
// the same records, bit for bit). The exception: a lone sequence on few heads
// (plan.segments) runs each window's dS recurrence over segments of that
// window, whose sums follow the window's edges.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "cuda/heuristics.h"
#include "cuda/params.h"

namespace kda::cuda {

struct BackwardCall {
  FwdParams fwd;  // inputs, sizes, offsets and the initial state, over all the call's slots
  const void* grad_out = nullptr;  // as SweepBwdParams
  bool grad_out_fp32 = false;
  const float* grad_final = nullptr;
  float* d_initial = nullptr;
  // The gradients, by token; the parts of ddt_bias and dA_log by absolute slot
  // ([num_slots, H, D] and [num_slots, H]).
  PrepareBwdParams::Grads grads;
};

// Allocates the scratch (`like`: a tensor on the device, for the options and
// the stream) and enqueues every kernel of the backward on the
// current stream of its device, as `plan` says (heuristics.h).
// saved_states: null, or the state at the start of every chunk slot, bf16
// [num_slots, H, D, D] at the call's head size D (kda._fwd_checkpointed's): K2
// then does not run. saved_records: null, or (only with saved_states) the
// record of every chunk slot, with the lo planes, fp32 [num_slots, H,
// record_floats(D)] (kda._fwd_checkpointed's): K1 then runs only for its
// backward.
void run_backward(const BackwardCall& call, const at::Tensor& like, const BackwardPlan& plan,
                  const void* saved_states = nullptr, const float* saved_records = nullptr);

}  // namespace kda::cuda
