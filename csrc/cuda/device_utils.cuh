// Small device helpers shared by the forward kernels.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace kda::cuda {

__device__ __forceinline__ float load_bf16(const void* base, int64_t index) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
}

__device__ __forceinline__ float load_state(const void* base, int64_t index, bool fp32) {
  return fp32 ? static_cast<const float*>(base)[index] : load_bf16(base, index);
}

__device__ __forceinline__ void store_state(void* base, int64_t index, float value, bool fp32) {
  if (fp32) {
    static_cast<float*>(base)[index] = value;
  } else {
    static_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn(value);
  }
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// The sequence that owns chunk slot `slot`: the largest n with
// chunk_offsets[n] <= slot (offsets are non-decreasing; empty sequences share
// an offset with the next one, and the largest index skips them).
__device__ __forceinline__ int64_t sequence_of_slot(const int64_t* chunk_offsets, int64_t N, int64_t slot) {
  int64_t lo = 0, hi = N;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (chunk_offsets[mid] <= slot) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace kda::cuda
