#include "cuda/forward_schedule.h"

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <string>

#include "cuda/launch.h"

namespace kda::cuda {
namespace {

// Windows bound the workspace where it grows large and K2 leaves room on the
// SMs for K1 beside it. They were meant to hide K1's time too, but measured
// none: beside K1, K2 ran 42% slower and K1 81% (H200, 65536 x 16 heads; both
// kernels issue-bound, see benchmarks/RESULTS.md). So windows only where the
// one-pass workspace would pass 1 GiB; there they cost ~5 % of the time. Windows
// of 2048 to 8192 tokens keep the per-window costs (two launches, K2 reloading
// its state and refilling its staging) small against the work.
constexpr int64_t kOnePassWorkspaceLimit = int64_t{1} << 30;
constexpr int64_t kMinWindowSlots = 128;
constexpr int64_t kMaxWindowSlots = 512;
constexpr int64_t kTargetWindows = 16;
constexpr int kRing = 2;  // K1 one window ahead of K2

// TORCH_KDA_WINDOW_SLOTS=n forces windows of n slots on every call (tests use
// it to put window edges inside small problems); 0 forces one pass.
int64_t window_slots(const FwdParams& p) {
  if (const char* env = std::getenv("TORCH_KDA_WINDOW_SLOTS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(env, &end, 10);
    TORCH_CHECK(errno == 0 && *end == '\0' && n >= 0,
                "kda.fwd: TORCH_KDA_WINDOW_SLOTS must be a non-negative integer, got '", env, "'");
    return n == 0 ? p.num_slots : std::min<int64_t>(n, p.num_slots);
  }
  if (recurrence_warps_per_sm(p) > 2 || p.num_slots * p.H * kWsChunkBytes <= kOnePassWorkspaceLimit) {
    return p.num_slots;
  }
  const int64_t w = std::clamp((p.num_slots + kTargetWindows - 1) / kTargetWindows, kMinWindowSlots, kMaxWindowSlots);
  return 2 * w <= p.num_slots ? w : p.num_slots;
}

int greatest_stream_priority() {
  int least = 0, greatest = 0;
  C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  return greatest;
}

}  // namespace

void run_forward(FwdParams p, const at::Tensor& like, bool may_window) {
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(like.device().index());
  const auto options = like.options().dtype(at::kFloat);
  forced_recurrence_block();  // raises on a bad setting before anything is enqueued
  const int64_t window = may_window ? window_slots(p) : p.num_slots;
  if (window >= p.num_slots) {
    at::Tensor workspace = at::empty({p.num_slots, p.H, kWsChunkFloats}, options);
    p.slot_begin = 0;
    p.slot_end = p.num_slots;
    p.workspace = workspace.data_ptr<float>();
    p.carry = nullptr;
    launch_prepare(p, stream);
    launch_recurrence(p, stream);
    return;
  }

  const int64_t windows = (p.num_slots + window - 1) / window;
  at::Tensor ring = at::empty({kRing, window, p.H, kWsChunkFloats}, options);
  at::Tensor carry = at::empty({p.N, p.H, kHeadDim, kHeadDim}, options);
  auto window_params = [&](int64_t w) {
    FwdParams q = p;
    q.slot_begin = w * window;
    q.slot_end = std::min(p.num_slots, (w + 1) * window);
    q.workspace = ring.data_ptr<float>() + (w % kRing) * window * p.H * kWsChunkFloats;
    q.carry = carry.data_ptr<float>();
    return q;
  };
  static const int priority = greatest_stream_priority();

  // The side stream forks from the caller's stream and every K1 it runs is
  // waited on there (the last one before the last K2), so it is joined again
  // before this returns: stream capture accepts the pattern, and the ring and
  // carry, freed on the caller's stream, are reused only after both streams
  // are done with them.
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, like.device().index());
  at::cuda::CUDAEvent fork, ready;
  std::array<at::cuda::CUDAEvent, kRing> done;  // K2 of the window that last used each ring slot
  fork.record(stream);
  fork.block(side);
  try {
    launch_prepare(window_params(0), side);
    ready.record(side);
    for (int64_t w = 0; w < windows; ++w) {
      ready.block(stream);  // waits on the record made before this call: K1 of window w
      launch_recurrence(window_params(w), stream, priority);
      done[w % kRing].record(stream);
      if (w + 1 < windows) {
        if (w + 1 >= kRing) {
          done[(w + 1) % kRing].block(side);
        }
        launch_prepare(window_params(w + 1), side);
        ready.record(side);
      }
    }
  } catch (...) {
    // Join the side stream before the ring goes back to the allocator, on a best-effort
    // basis (the error being reported may be the device's own).
    cudaEvent_t join = nullptr;
    if (cudaEventCreateWithFlags(&join, cudaEventDisableTiming) == cudaSuccess) {
      if (cudaEventRecord(join, side) == cudaSuccess) {
        (void)cudaStreamWaitEvent(stream, join, 0);
      }
      (void)cudaEventDestroy(join);
    }
    throw;
  }
}

}  // namespace kda::cuda
