// How one forward call's two kernels are enqueued, and the memory between them.
//
// In one pass, K1 fills a record for every chunk slot of the call (34,304 bytes
// per chunk and head), then K2 walks them. When that workspace would pass
// 1 GiB and K2 leaves room on the SMs (few (sequence, head) pairs: at most two
// of its warps per SM), the slots are cut into windows instead: K1 prepares
// window w + 1 on a side stream while K2 advances the states through window w
// on the caller's stream, launched at a higher priority so that its blocks are
// placed ahead of K1's waiting ones. Records then live in a ring of two
// windows and the states between windows in an fp32 carry, so the results are
// bitwise those of one pass.
#pragma once

#include <ATen/core/Tensor.h>

#include "cuda/params.h"

namespace kda::cuda {

// Allocates the workspace (and carry), fills the window fields of `params` and
// enqueues the kernels on the current stream of `like`'s device. may_window =
// false keeps the call in one pass: the caller's outputs share memory with its
// inputs, which a later window's K1 would read after an earlier window's K2
// wrote there (one pass reads every input before it writes anything).
void run_forward(FwdParams params, const at::Tensor& like, bool may_window);

}  // namespace kda::cuda
