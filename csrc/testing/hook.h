// The testing hook: settings that override the automatic choices of both
// devices for the whole process, so that tests can run every block shape and
// put window and segment edges inside small problems. kda_testing::force sets
// the CUDA path's, kda_testing::force_segments the segments
// (torch_kda.testing.forced wraps both). None changes a result's meaning: the
// block shapes and the segments change its low bits (they sum in different
// orders), the windows none (but a backward's in segments, which follow the
// window: heuristics.h). An op reads the settings once per call, before it
// enqueues the kernels whose shapes they set.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

namespace kda {

namespace cuda {
// The block shapes, declared in full beside their launchers (launch.h); opaque
// here, so that the hook builds without the CUDA headers.
enum class RecurrenceBlock;
enum class DsBlock;
}  // namespace cuda

// Each setting unset leaves its choice to the heuristics.
struct Forced {
  std::optional<cuda::RecurrenceBlock> recurrence_block;  // K2's block shape
  std::optional<cuda::DsBlock> ds_block;                  // the dS recurrence's
  std::optional<int64_t> window_slots;  // CUDA: 0 one pass; n > 0 windows of n chunk slots
  // Both devices: P >= 1 segments a sequence (segments.h); on CUDA also the
  // backward's dS recurrence (backward/schedule.cpp).
  std::optional<int64_t> segments;
};

// The settings now (a copy).
Forced forced();

// Applies `change` to the settings, under the lock that forced() takes, so
// that setting some leaves the others as they were.
void change_forced(const std::function<void(Forced&)>& change);

}  // namespace kda
