#include "checkpoints.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include <ATen/ops/empty.h>

#include "cuda/params.h"

namespace kda {
namespace {

// Backward windows hold at least this much scratch: fewer, longer windows.
constexpr int64_t kWindowScratch = int64_t{1} << 30;
constexpr int64_t kMinWindowSlots = 16;

c10::SymInt saved_slots(const Problem& p, bool varlen) {
  const c10::SymInt C = cuda::kChunk;
  if (varlen) {  // B == 1: T is the batch's tokens
    return p.T.min((p.T + C - 1) / C + p.N);
  }
  return p.B * ((p.T + C - 1) / C);
}

}  // namespace

int64_t backward_window_floor(int64_t H) {
  return std::max(kWindowScratch / (std::max<int64_t>(H, 1) * cuda::kBwdSlotScratchBytes), kMinWindowSlots);
}

bool save_states_enabled(const char* op) {
  const char* env = std::getenv("TORCH_KDA_SAVE_STATES");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "1") == 0) {
    return true;
  }
  TORCH_CHECK(std::strcmp(env, "0") == 0, op, ": TORCH_KDA_SAVE_STATES must be 0 or 1, got '", env, "'");
  return false;
}

bool save_records_enabled(const char* op, bool states) {
  const char* env = std::getenv("TORCH_KDA_SAVE_RECORDS");
  if (env == nullptr || *env == '\0') {
    return states;
  }
  if (std::strcmp(env, "0") == 0) {
    return false;
  }
  TORCH_CHECK(std::strcmp(env, "1") == 0, op, ": TORCH_KDA_SAVE_RECORDS must be 0 or 1, got '", env, "'");
  TORCH_CHECK(states, op, ": TORCH_KDA_SAVE_RECORDS=1 needs the states kept, but TORCH_KDA_SAVE_STATES=0 "
              "(the records are kept only with the states)");
  return true;
}

at::Tensor allocate_checkpoints(const Problem& p, const at::Tensor& q, bool varlen, bool save) {
  const c10::SymInt slots = save ? saved_slots(p, varlen) : c10::SymInt(0);
  return at::empty_symint({slots, p.H, cuda::kHeadDim, cuda::kHeadDim}, q.options().dtype(at::kBFloat16));
}

at::Tensor allocate_records(const Problem& p, const at::Tensor& q, bool varlen, bool save) {
  const c10::SymInt slots = save ? saved_slots(p, varlen) : c10::SymInt(0);
  return at::empty_symint({slots, p.H, cuda::kWsChunkFloats}, q.options().dtype(at::kFloat));
}

namespace {

void check_checkpoints(const char* op, const Problem& p, bool varlen, const at::Tensor& q,
                       const at::Tensor& checkpoints) {
  const c10::SymInt slots = saved_slots(p, varlen);
  const c10::SymInt D = cuda::kHeadDim;
  const bool ok = checkpoints.device() == q.device() && checkpoints.scalar_type() == at::kBFloat16 &&
                  checkpoints.dim() == 4 && checkpoints.sym_size(0) == slots && checkpoints.sym_size(1) == p.H &&
                  checkpoints.sym_size(2) == D && checkpoints.sym_size(3) == D && checkpoints.is_contiguous();
  TORCH_CHECK(ok, op, ": checkpoints must be what kda._fwd_checkpointed returned for the same inputs (contiguous "
              "bfloat16 [", sym_str(slots), ", ", sym_str(p.H), ", 128, 128] on q's device) or empty, got ",
              dtype_name(checkpoints.scalar_type()), " ", shape_str(checkpoints.sym_sizes()), " on ",
              checkpoints.device().str());
}

void check_records(const char* op, const Problem& p, bool varlen, const at::Tensor& q, const at::Tensor& records) {
  const c10::SymInt slots = saved_slots(p, varlen);
  const bool ok = records.device() == q.device() && records.scalar_type() == at::kFloat && records.dim() == 3 &&
                  records.sym_size(0) == slots && records.sym_size(1) == p.H &&
                  records.sym_size(2) == cuda::kWsChunkFloats && records.is_contiguous();
  TORCH_CHECK(ok, op, ": records must be what kda._fwd_checkpointed returned for the same inputs (contiguous "
              "float32 [", sym_str(slots), ", ", sym_str(p.H), ", ", std::to_string(cuda::kWsChunkFloats),
              "] on q's device) or empty, got ", dtype_name(records.scalar_type()), " ",
              shape_str(records.sym_sizes()), " on ", records.device().str());
}

bool given(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() && t->sym_numel() != 0;
}

}  // namespace

void check_saved(const char* op, const Problem& p, bool varlen, const at::Tensor& q,
                 const std::optional<at::Tensor>& checkpoints, const std::optional<at::Tensor>& records) {
  if (given(checkpoints)) {
    check_checkpoints(op, p, varlen, q, *checkpoints);
  }
  if (given(records)) {
    check_records(op, p, varlen, q, *records);
    TORCH_CHECK(given(checkpoints), op,
                ": records were given without checkpoints: pass both, as kda._fwd_checkpointed returned them");
  }
}

}  // namespace kda
