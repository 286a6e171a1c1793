// The measurement knobs that force the recurrences' block shapes
// (TORCH_KDA_RECURRENCE_BLOCK for K2, TORCH_KDA_DS_BLOCK for the dS
// recurrence) and K1's warps (TORCH_KDA_K1_WARPS): read on the host before
// the kernels they shape are enqueued, so a bad value raises before any writes.
#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>
#include <utility>

#include "cuda/launch.h"

namespace kda::cuda {
namespace {

// The shape that environment variable `var` names, `automatic` where it is
// unset or empty; any other value raises, naming the op and the choices.
template <typename Shape, size_t N>
Shape forced_shape(const char* op, const char* var, const std::pair<const char*, Shape> (&shapes)[N], Shape automatic) {
  const char* env = std::getenv(var);
  if (env == nullptr || *env == '\0') {
    return automatic;
  }
  std::string names;
  for (const auto& [name, shape] : shapes) {
    if (name == std::string(env)) {
      return shape;
    }
    names += names.empty() ? name : std::string(", ") + name;
  }
  TORCH_CHECK(false, op, ": ", var, " must be one of ", names, ", got '", env, "'");
}

}  // namespace

RecurrenceBlock forced_recurrence_block(const char* op) {
  static constexpr std::pair<const char*, RecurrenceBlock> kShapes[] = {
      {"8x1", RecurrenceBlock::k8x1}, {"4x1", RecurrenceBlock::k4x1}, {"4x1w", RecurrenceBlock::k4x1w},
      {"2x1", RecurrenceBlock::k2x1}, {"2x2", RecurrenceBlock::k2x2}, {"4x4", RecurrenceBlock::k4x4}};
  return forced_shape(op, "TORCH_KDA_RECURRENCE_BLOCK", kShapes, RecurrenceBlock::kAuto);
}

DsBlock forced_ds_block(const char* op) {
  static constexpr std::pair<const char*, DsBlock> kShapes[] = {
      {"1x1", DsBlock::k1x1}, {"2x1", DsBlock::k2x1}, {"4x1", DsBlock::k4x1},
      {"2x2", DsBlock::k2x2}, {"4x2", DsBlock::k4x2}, {"8x2", DsBlock::k8x2}};
  return forced_shape(op, "TORCH_KDA_DS_BLOCK", kShapes, DsBlock::kAuto);
}

int forced_prepare_warps(const char* op) {
  static constexpr std::pair<const char*, int> kWarps[] = {{"1", 1}, {"2", 2}};
  return forced_shape(op, "TORCH_KDA_K1_WARPS", kWarps, 2);
}

}  // namespace kda::cuda
