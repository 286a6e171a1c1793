#include "segments.h"

namespace kda {

at::Tensor segment_offsets(const at::Tensor& seq_offsets, int64_t P) {
  TORCH_INTERNAL_ASSERT(P >= 1 && seq_offsets.dim() == 1 && seq_offsets.scalar_type() == at::kLong);
  const int64_t N = seq_offsets.size(0) - 1;
  const at::Tensor start = seq_offsets.narrow(0, 0, N), len = seq_offsets.narrow(0, 1, N) - start;
  const int64_t unit = kSegmentAlign * P;
  const at::Tensor seg_len = at::div(len + (unit - 1), unit, "floor") * kSegmentAlign;
  const at::Tensor j = at::arange(P, seq_offsets.options());
  const at::Tensor starts =
      start.unsqueeze(1) + at::minimum(j.unsqueeze(0) * seg_len.unsqueeze(1), len.unsqueeze(1));
  return at::cat({starts.reshape({N * P}), seq_offsets.narrow(0, N, 1)});
}

at::Tensor first_segment_states(const at::Tensor& initial, int64_t N, int64_t P, int64_t H, int64_t V, int64_t K,
                                const at::TensorOptions& options) {
  at::Tensor x = at::zeros({N, P, H, V, K}, options);
  if (initial.defined()) {
    x.select(1, 0).copy_(initial);
  }
  return x.view({N * P, H, V, K});
}

at::Tensor identity_states(int64_t N, int64_t P, int64_t H, int64_t K, const at::TensorOptions& options) {
  return at::eye(K, options).expand({N * P, H, K, K}).contiguous();
}

// In float64, so that the scan adds nothing to an fp32 state's error; its few
// small products cost little.
at::Tensor segment_start_states(const at::Tensor& maps, const at::Tensor& ends_from_zero,
                                const at::Tensor& initial, int64_t P) {
  const int64_t S = ends_from_zero.size(0), H = ends_from_zero.size(1), V = ends_from_zero.size(2),
                K = ends_from_zero.size(3), N = S / P;
  const at::Tensor A = maps.view({N, P, H, K, K});
  const at::Tensor B = ends_from_zero.view({N, P, H, V, K});
  at::Tensor starts = at::empty_like(B);
  if (initial.defined()) {
    starts.select(1, 0).copy_(initial);
  } else {
    starts.select(1, 0).zero_();
  }
  // Segment 0's B ran from the initial state: it is that segment's end.
  at::Tensor x = B.select(1, 0).to(at::kDouble);
  for (int64_t j = 1; j < P; ++j) {
    starts.select(1, j).copy_(x);
    if (j + 1 < P) {
      x = at::matmul(x, A.select(1, j).to(at::kDouble)).add_(B.select(1, j).to(at::kDouble));
    }
  }
  return starts.view({S, H, V, K});
}

at::Tensor last_segment_states(const at::Tensor& segment_states, int64_t P) {
  const int64_t S = segment_states.size(0);
  return segment_states.view({S / P, P, segment_states.size(1), segment_states.size(2), segment_states.size(3)})
      .select(1, P - 1);
}

}  // namespace kda
