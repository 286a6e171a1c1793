// The scan of the segmented forward (segments.h): each segment's start state
// from the segments before it in its sequence, X_{j+1} = X_j A_j + B_j, one
// block per (sequence, head, 16 value rows), a thread per key column, the rows
// in float64 in shared memory. Its own kernel rather than batched matmuls:
// one launch instead of a few per segment, and no cuBLAS, which a caller's
// TF32 or deterministic-mode settings would otherwise reach.
#include <c10/cuda/CUDAException.h>

#include <string>

#include "cuda/device_utils.cuh"
#include "cuda/launch.h"

namespace kda::cuda {
namespace {

constexpr int kRows = 16;

// maps [N * P, H, K, K], ends and starts [N * P, H, V, K] fp32; initial
// [N, H, V, K] in the state's dtype, or null (zeros); K = V = D. reverse: the
// scan takes each sequence's segments last to first (the backward's dS runs
// from a sequence's end), so that none of the three is copied flipped.
template <int D>
__global__ void __launch_bounds__(D)
    segment_scan_kernel(const float* maps, const float* ends, const void* initial, bool initial_fp32,
                        float* starts, int64_t P, int64_t H, bool reverse) {
  constexpr int kRowGroups = D / kRows;
  __shared__ double x[kRows][D];
  const int64_t pair = blockIdx.x / kRowGroups;  // n * H + h
  const int r0 = static_cast<int>(blockIdx.x % kRowGroups) * kRows;
  const int64_t n = pair / H, h = pair % H;
  const int c = threadIdx.x;
  constexpr int64_t kState = int64_t{D} * D;
  // The scan's j-th segment, as the tensors lie.
  const auto seg = [&](int64_t j) { return ((n * P + (reverse ? P - 1 - j : j)) * H + h) * kState; };
  const auto at = [&](int64_t j, int row) { return seg(j) + int64_t{r0 + row} * D + c; };

  for (int i = 0; i < kRows; ++i) {
    float s = 0.f;
    if (initial != nullptr) {
      const int64_t e = pair * kState + int64_t{r0 + i} * D + c;
      s = load_state(initial, e, initial_fp32);
    }
    starts[at(0, i)] = s;
    x[i][c] = ends[at(0, i)];  // segment 0 ran from the initial state: its end
  }
  for (int64_t j = 1; j < P; ++j) {
    for (int i = 0; i < kRows; ++i) {
      starts[at(j, i)] = static_cast<float>(x[i][c]);
    }
    if (j + 1 == P) {
      break;
    }
    double acc[kRows];
    for (int i = 0; i < kRows; ++i) {
      acc[i] = ends[at(j, i)];
    }
    __syncthreads();  // every column of x written
    const float* a = maps + seg(j) + c;
    for (int k = 0; k < D; ++k) {
      const double a_kc = a[int64_t{k} * D];
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        acc[i] = fma(x[i][k], a_kc, acc[i]);
      }
    }
    __syncthreads();  // every column of x read
    for (int i = 0; i < kRows; ++i) {
      x[i][c] = acc[i];
    }
  }
}

}  // namespace

void launch_segment_scan(const float* maps, const float* ends, const void* initial, bool initial_fp32, float* starts,
                         int64_t N, int64_t P, int64_t H, int head_size, cudaStream_t stream, bool reverse) {
  ChunkedHeadSizes::dispatch(head_size, [&](auto size) {
    constexpr int D = decltype(size)::value;
    const int64_t blocks = N * H * (D / kRows);
    if (blocks == 0) {
      return;
    }
    TORCH_CHECK(blocks <= INT32_MAX, "kda.fwd: ", std::to_string(N), " sequences x ", std::to_string(H),
                " heads is more blocks than one launch takes");
    segment_scan_kernel<D>
        <<<static_cast<unsigned int>(blocks), D, 0, stream>>>(maps, ends, initial, initial_fp32, starts, P, H,
                                                              reverse);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace kda::cuda
