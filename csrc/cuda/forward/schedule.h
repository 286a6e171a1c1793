// How one forward call's two kernels are enqueued, and the memory between them.
//
// In one pass, K1 fills a record for every chunk slot of the call (27,136 bytes
// per chunk and head), then K2 walks them. Where that workspace would grow
// large (heuristics.cpp), the slots are cut into windows, run one after the
// other on the caller's stream: K1 fills one window's records, K2 advances
// every state through them, and the states wait between windows in an fp32 carry, so the
// results are bitwise those of one pass. When the records are kept for the
// backward (kda._fwd_checkpointed), they are all in the caller's buffer
// anyway, and the call runs in one pass.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "cuda/heuristics.h"
#include "cuda/params.h"

namespace kda::cuda {

// Allocates the workspace (and carry), fills the window fields of `params` and
// enqueues the kernels on the current stream of `like`'s device, as `plan`
// says (heuristics.h). records: null, or fp32 [params.num_slots, H, record_floats(head_size)]
// that K1 fills instead of a workspace, every slot in its place (with the lo
// planes: params.lo_for_backward). A caller whose outputs share memory with its
// inputs must pass params.num_slots: a later window's K1 would read what an
// earlier window's K2
// wrote (one pass: K1 reads every input but v before K2 writes anything, and
// the caller gives K2 a v that shares no memory with the outputs).
void run_forward(FwdParams params, const at::Tensor& like, const ForwardPlan& plan, float* records = nullptr);

// The forward over plan.segments segments a sequence (segments.h), in one pass
// of K1 and three of K2 over the segments, with the scan between them; the
// same outputs, chunk-start states and records as run_forward (the segments
// are whole chunks of their sequences, so the chunk slots are the call's).
// seq_offsets: the sequences' token offsets [N + 1] (int64, on the device), or
// undefined for a fixed-length call. initial, final_state: the tensors behind
// params.initial_state and params.final_state (undefined where null); the
// final state is written last, so the two may be one buffer.
void run_segmented_forward(FwdParams params, const at::Tensor& like, const ForwardPlan& plan,
                           const at::Tensor& seq_offsets, const at::Tensor& initial, const at::Tensor& final_state,
                           float* records = nullptr);

}  // namespace kda::cuda
