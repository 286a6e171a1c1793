// torch.ops.kda_testing: operators that exist for the test suite alone, apart
// from the library's API (torch.ops.kda). They run pieces of the computation
// on their own, so that a test can check each against the Python reference,
// and set the testing hook that forces the CUDA path's automatic choices.
#include <torch/library.h>

#include <string>

#include "testing/hook.h"

namespace {

// The part of the testing hook that both devices read (testing/hook.h): -1
// leaves the number of segments per sequence to the heuristics, P >= 1 forces
// it. Leaves the CUDA settings as they are.
void force_segments(int64_t segments) {
  TORCH_CHECK(segments == -1 || segments >= 1, "kda_testing.force_segments: segments must be -1 (automatic) or ",
              "a number of segments per sequence >= 1, got ", std::to_string(segments));
  const std::optional<int64_t> P = segments == -1 ? std::nullopt : std::optional<int64_t>(segments);
  kda::change_forced([&](kda::Forced& f) { f.segments = P; });
}

int64_t forced_segments_now() {
  return kda::forced().segments.value_or(-1);
}

}  // namespace

TORCH_LIBRARY(kda_testing, m) {
  m.def("force_segments(int segments=-1) -> ()", &force_segments);
  m.def("forced_segments() -> int", &forced_segments_now);
  // kda::bwd computed by the chunked ATen composition (chunked_backward.h) on
  // any device, so that the CPU tests can check the chunked form's backward.
  m.def(
      "bwd_chunked(Tensor grad_out, Tensor? grad_final_state, Tensor q, Tensor k, Tensor v, Tensor g, "
      "Tensor beta, Tensor A_log, Tensor dt_bias, float? scale=None, float? lower_bound=None, "
      "Tensor? initial_state=None, Tensor? cu_seqlens=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dg, "
      "Tensor dbeta, Tensor dA_log, Tensor ddt_bias, Tensor dinitial_state)");
  // K1's backward alone on CUDA (backward/input_gradients.cu), fixed length, against
  // torch_kda/reference.py chunk_record_backward. d_record: [B * ceil(T / 16),
  // H, 8576] fp32, the record gradients (params.h).
  m.def(
      "prepare_bwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor A_log, Tensor dt_bias, "
      "Tensor d_record, float? scale=None, float lower_bound=-5.0) -> (Tensor dqn, Tensor dkn, Tensor dv, "
      "Tensor dlam, Tensor dbeta)");
  // The backward sweep alone on CUDA (backward/ds_recurrence.cu, record_gradients.cu), fixed length, from given
  // chunk-start states ([B * ceil(T / 16), H, V, K] bf16, as K2 stores them),
  // against torch_kda/reference.py chunk_step_backward. Runs K1 for the
  // records first. Returns dS at each chunk's end as well (bf16, as the record
  // gradients read it).
  m.def(
      "sweep_bwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor A_log, Tensor dt_bias, "
      "Tensor states, Tensor grad_out, Tensor? grad_final_state=None, float? scale=None, "
      "float lower_bound=-5.0) -> (Tensor d_record, Tensor d_initial, Tensor d_states)");
}
