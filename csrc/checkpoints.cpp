#include "checkpoints.h"

#include <algorithm>

#include <ATen/ops/empty.h>

#include "cuda/params.h"

namespace kda {
namespace {

// Backward windows hold at least this much scratch: fewer, longer windows.
constexpr int64_t kWindowScratch = int64_t{1} << 30;
constexpr int64_t kMinWindowSlots = 16;

}  // namespace

int64_t backward_window_floor(int64_t H) {
  return std::max(kWindowScratch / (std::max<int64_t>(H, 1) * cuda::kBwdSlotScratchBytes), kMinWindowSlots);
}

CheckpointPlan checkpoint_plan(const Problem& p, bool varlen) {
  CheckpointPlan plan;
  // Specializes B: 1 or not (as dynamic shapes do for sizes 0 and 1 anyway).
  if (varlen || p.B != 1) {
    return plan;
  }
  // Heads are part of the model: specializing them costs no recompiles in practice.
  const int64_t H = p.H.guard_int(__FILE__, __LINE__);
  plan.every = backward_window_floor(H);
  plan.count = ((p.T + cuda::kChunk - 1) / cuda::kChunk + plan.every - 1) / plan.every;
  return plan;
}

at::Tensor allocate_checkpoints(const Problem& p, const at::Tensor& q, const CheckpointPlan& plan) {
  return at::empty_symint({plan.count, p.H, cuda::kHeadDim, cuda::kHeadDim}, q.options().dtype(at::kFloat));
}

void check_checkpoints(const char* op, const Problem& p, bool varlen, const at::Tensor& q,
                       const at::Tensor& checkpoints) {
  if (checkpoints.sym_numel() == 0) {
    return;
  }
  const CheckpointPlan plan = checkpoint_plan(p, varlen);
  const c10::SymInt D = cuda::kHeadDim;
  const bool ok = checkpoints.device() == q.device() && checkpoints.scalar_type() == at::kFloat &&
                  checkpoints.dim() == 4 && checkpoints.sym_size(0) == plan.count && checkpoints.sym_size(1) == p.H &&
                  checkpoints.sym_size(2) == D && checkpoints.sym_size(3) == D && checkpoints.is_contiguous();
  TORCH_CHECK(ok, op, ": checkpoints must be what kda._fwd_checkpointed returned for the same inputs (contiguous "
              "float32 [", sym_str(plan.count), ", ", sym_str(p.H), ", 128, 128] on q's device) or empty, got ",
              dtype_name(checkpoints.scalar_type()), " ", shape_str(checkpoints.sym_sizes()), " on ",
              checkpoints.device().str());
}

}  // namespace kda
