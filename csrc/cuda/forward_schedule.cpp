#include "cuda/forward_schedule.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

namespace kda::cuda {
namespace {

// Windows bound the workspace where it grows large. They were first run with
// K1 of the next window on a side stream beside K2, to hide K1's time, but that
// hid none (H200, 65536 x 16 heads: K2 +42 %, K1 +81 % side by side; both
// kernels issue-bound, benchmarks/RESULTS.md), so they run in order. Nor did
// K2 beside a persistent K1 on SMs of its own: packed two
// blocks to an SM to leave K1 room, K2 steps 41 % slower (1.81 -> 2.55 ms at
// 65536 x 16 heads), which ate the overlap. Each
// window costs ~13 us beyond its share of the work (K1's last wave, K2's state
// reload and its first stages from memory, two launches): sixteen windows of
// 4096 tokens took the forward from 3.04-3.14 ms in one pass to 3.26 at 65536 x
// 16 heads, and from 2.37-2.45 to 2.62-2.67 at 32768 x 32, where two windows of
// the 1 GiB budget took 3.09-3.13 and 2.44-2.46 (H200). So
// the call runs in as few equal windows as keep each one's workspace within the
// budget. Only where K2 runs at most two warps per SM: with more (sequence,
// head) pairs the carry grows with them and the one-pass workspace of a batch
// that fits in memory is fine.
constexpr int64_t kWorkspaceLimit = int64_t{1} << 30;

}  // namespace

// TORCH_KDA_WINDOW_SLOTS=n forces windows of n slots on every call (tests use
// it to put window edges inside small problems); 0 forces one pass.
int64_t window_slots(const FwdParams& p, const char* op, bool kept_records) {
  if (const char* env = std::getenv("TORCH_KDA_WINDOW_SLOTS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(env, &end, 10);
    TORCH_CHECK(errno == 0 && *end == '\0' && n >= 0,
                op, ": TORCH_KDA_WINDOW_SLOTS must be a non-negative integer, got '", env, "'");
    return n == 0 ? p.num_slots : std::min<int64_t>(n, p.num_slots);
  }
  const int64_t slot_bytes = std::max<int64_t>(p.H, 1) * kWsChunkBytes;
  if (kept_records || recurrence_warps_per_sm(p) > 2 || p.num_slots * slot_bytes <= kWorkspaceLimit) {
    return p.num_slots;
  }
  const int64_t per_window = std::max<int64_t>(kWorkspaceLimit / slot_bytes, 1);
  const int64_t windows = (p.num_slots + per_window - 1) / per_window;
  return (p.num_slots + windows - 1) / windows;
}

void run_forward(FwdParams p, const at::Tensor& like, int64_t window, RecurrenceBlock block, float* records) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(like.device().index()).stream();
  const auto options = like.options().dtype(at::kFloat);
  if (window <= 0 || window > p.num_slots) {
    window = p.num_slots;
  }
  at::Tensor workspace;
  if (records == nullptr) {
    workspace = at::empty({window, p.H, kWsChunkFloats}, options);
    p.workspace = workspace.data_ptr<float>();
  }
  at::Tensor carry;
  if (window < p.num_slots) {
    carry = at::empty({p.N, p.H, kHeadDim, kHeadDim}, options);
    p.carry = carry.data_ptr<float>();
  }
  // One stream: K1 of window w + 1 overwrites the records only after K2 of
  // window w has read them. A call without slots (only empty sequences) still
  // runs one K2, which moves the initial states to the final ones.
  auto* const chunk_states = static_cast<unsigned char*>(p.chunk_states);  // all the call's slots, or null
  int64_t begin = 0;
  do {
    p.slot_begin = begin;
    p.slot_end = std::min(p.num_slots, begin + window);
    if (chunk_states != nullptr) {
      p.chunk_states = chunk_states + begin * p.H * kBwdStateBytes;
    }
    if (records != nullptr) {  // K1 and K2 index the records from the window's first slot
      p.workspace = records + begin * p.H * kWsChunkFloats;
    }
    launch_prepare(p, stream);
    launch_recurrence(p, stream, block);
    begin = p.slot_end;
  } while (begin < p.num_slots);
}

}  // namespace kda::cuda
