// How one forward call's two kernels are enqueued, and the memory between them.
//
// In one pass, K1 fills a record for every chunk slot of the call (27,136 bytes
// per chunk and head), then K2 walks them. When that workspace would pass
// 1 GiB and K2 runs few (sequence, head) pairs (at most two of its warps per
// SM), the slots are cut into as few equal windows as keep each one's
// workspace within 1 GiB, run one after the other on the caller's stream: K1 fills one window's records, K2 advances every state
// through them, and the states wait between windows in an fp32 carry, so the
// results are bitwise those of one pass. When the records are kept for the
// backward (kda._fwd_checkpointed), they are all in the caller's buffer
// anyway, and the call runs in one pass.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "cuda/launch.h"
#include "cuda/params.h"

namespace kda::cuda {

// The chunk slots per window for this call: params.num_slots for one pass
// (always, unless forced, with `kept_records`). Reads TORCH_KDA_WINDOW_SLOTS
// (raises on a bad value, naming `op`, the op called).
int64_t window_slots(const FwdParams& params, const char* op, bool kept_records = false);

// Allocates the workspace (and carry), fills the window fields of `params` and
// enqueues the kernels on the current stream of `like`'s device, in windows of
// `window` slots. records: null, or fp32 [params.num_slots, H, kWsChunkFloats]
// that K1 fills instead of a workspace, every slot in its place (with the lo
// planes: params.lo_for_backward). A caller whose outputs share memory with its
// inputs must pass params.num_slots: a later window's K1 would read what an
// earlier window's K2
// wrote (one pass: K1 reads every input but v before K2 writes anything, and
// the caller gives K2 a v that shares no memory with the outputs).
void run_forward(FwdParams params, const at::Tensor& like, int64_t window, RecurrenceBlock block,
                 float* records = nullptr);

}  // namespace kda::cuda
