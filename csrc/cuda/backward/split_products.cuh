// What the backward sweep's two kernels (ds_recurrence.cu,
// record_gradients.cu) share: the record's planes and the split products.
#pragma once

#include "cuda/device_utils.cuh"
#include "cuda/mma.cuh"

namespace kda::cuda {
namespace {

constexpr int C = kChunk;
static_assert(C == 16, "the fragments below assume 16-token chunks");

// The record's [16][D] planes before Aqk's hi plane, in order (params.h).
constexpr int kQsHi = 0, kWHi = 1, kWLo = 2, kKdHi = 3, kKdLo = 4;

// One product of A and B, each split (hi, lo) or an exact bf16 (hi alone): the
// terms into separate accumulators, the small ones first (lo * hi, hi * lo,
// then hi * hi), so that consecutive mmas rarely wait on each other. With `zero`
// (a constant once loops are unrolled) the products start the sums. The terms
// go to acc[kFirst] on: a product whose lo * hi term is known to be zero skips
// it (kFirst = 1) and leaves its other terms where a full one puts them.
template <bool kALo, bool kBLo, int kFirst = 0, int kTerms>
__device__ __forceinline__ void mma_split(float (&acc)[kTerms][2][4], int nt, const uint32_t (&ah)[4],
                                          const uint32_t (&al)[4], uint32_t bh0, uint32_t bh1, uint32_t bl0,
                                          uint32_t bl1, bool zero) {
  static_assert(kFirst + 1 + kALo + kBLo == kTerms, "every accumulator is one term's");
  if constexpr (kALo) {
    mma_bf16_into(acc[kFirst][nt], al, bh0, bh1, zero);
  }
  if constexpr (kBLo) {
    mma_bf16_into(acc[kFirst + kALo][nt], ah, bl0, bl1, zero);
  }
  mma_bf16_into(acc[kFirst + kALo + kBLo][nt], ah, bh0, bh1, zero);
}

template <int kTerms>
__device__ __forceinline__ float sum_terms(const float (&acc)[kTerms][2][4], int nt, int e) {
  if constexpr (kTerms == 1) {
    return acc[0][nt][e];
  } else if constexpr (kTerms == 2) {
    return acc[0][nt][e] + acc[1][nt][e];
  } else {
    return (acc[0][nt][e] + acc[1][nt][e]) + acc[2][nt][e];  // the small terms first, as mma_bf16x3
  }
}

}  // namespace
}  // namespace kda::cuda
