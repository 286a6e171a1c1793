#include "checkpoints.h"

#include <string>
#include <vector>

#include <ATen/ops/empty.h>

#include "constants.h"

namespace kda {

Save parse_save(const char* op, c10::string_view save) {
  if (save == "states_and_records") {
    return Save::kStatesAndRecords;
  }
  if (save == "states") {
    return Save::kStates;
  }
  TORCH_CHECK(save == "none", op, ": save must be one of 'states_and_records', 'states', 'none', got '",
              std::string(save), "'");
  return Save::kNone;
}

namespace {

// The kept states' head size, from concrete sizes (a compiled graph
// specialises on them).
int64_t saved_head_size(const Problem& p) {
  return chunked_head_size(p.K.guard_int(__FILE__, __LINE__), p.V.guard_int(__FILE__, __LINE__));
}

// The shapes of the two outputs for `slots` chunk slots: what the forward
// allocates is what the backward accepts.
std::vector<c10::SymInt> checkpoints_shape(const Problem& p, const c10::SymInt& slots) {
  const int64_t D = saved_head_size(p);
  return {slots, p.H, D, D};
}

std::vector<c10::SymInt> records_shape(const Problem& p, const c10::SymInt& slots) {
  return {slots, p.H, record_bytes(static_cast<int>(saved_head_size(p))) / 4};
}

// `name` as the forward returned it for these shapes: contiguous, of this
// dtype and shape, on q's device.
void check_kept(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q, at::ScalarType dtype,
                c10::SymIntArrayRef shape) {
  const bool ok = t.device() == q.device() && t.scalar_type() == dtype && t.sym_sizes() == shape && t.is_contiguous();
  TORCH_CHECK(ok, op, ": ", name, " must be what kda._fwd_checkpointed returned for the same inputs (contiguous ",
              dtype_name(dtype), " ", shape_str(shape), " on q's device) or empty, got ", dtype_name(t.scalar_type()),
              " ", shape_str(t.sym_sizes()), " on ", t.device().str());
}

bool given(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() && t->sym_numel() != 0;
}

}  // namespace

SavedForBackward allocate_saved(const Problem& p, const at::Tensor& q, bool varlen, Save save) {
  const bool states = save != Save::kNone;
  const bool records = save == Save::kStatesAndRecords;
  const c10::SymInt slots = states ? chunk_slots(p.B, p.T, p.N, varlen) : c10::SymInt(0);  // records only with states
  return {at::empty_symint(checkpoints_shape(p, slots), q.options().dtype(at::kBFloat16)),
          at::empty_symint(records_shape(p, records ? slots : c10::SymInt(0)), q.options().dtype(at::kFloat))};
}

void check_saved(const char* op, const Problem& p, bool varlen, const at::Tensor& q,
                 const std::optional<at::Tensor>& checkpoints, const std::optional<at::Tensor>& records) {
  const c10::SymInt slots = chunk_slots(p.B, p.T, p.N, varlen);
  if (given(checkpoints)) {
    check_kept(op, "checkpoints", *checkpoints, q, at::kBFloat16, checkpoints_shape(p, slots));
  }
  if (given(records)) {
    check_kept(op, "records", *records, q, at::kFloat, records_shape(p, slots));
    TORCH_CHECK(given(checkpoints), op,
                ": records were given without checkpoints: pass both, as kda._fwd_checkpointed returned them");
  }
}

}  // namespace kda
