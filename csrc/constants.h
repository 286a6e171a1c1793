// Constants shared by the host code and the CUDA kernels (no ATen here, so the
// .cu files can include it cheaply).
#pragma once

#include <cstdint>

namespace kda {

// Epsilon inside the L2 norm of q and k: x / sqrt(sum(x^2) + kNormEps) (as the model defines it).
constexpr double kNormEps = 1e-6;

// The largest key or value head size the op takes, on every device: what
// models built on KDA use (64 to 256), where a head's fp32 state is at most 256 KB.
constexpr int kMaxHeadSize = 256;

// The CUDA kernels' sizes, which also shape what every backend allocates for
// them (checkpoints.h) and where segments may start (segments.h).
// The head size of the decode kernel (smaller ones run zero-padded to it); the
// chunked kernels, forward and backward, also come 64 and 256 wide
// (cuda/launch.h).
constexpr int kHeadDim = 128;
// Heads of at most this many channels (K and V) run the 64-wide chunked
// kernels, zero-padded to 64 (cuda/padded_heads.h).
constexpr int kNarrowHead = 64;
constexpr int kChunk = 16;     // tokens per chunk

// The head size of the CUDA chunked kernels, forward and backward, for K and V
// (1 to kMaxHeadSize): the smallest of 64, 128 and 256 that holds both (the
// kernels take K = V). What the forward keeps for the backward has this size
// (checkpoints.h).
constexpr int64_t chunked_head_size(int64_t K, int64_t V) {
  const int64_t size = K > V ? K : V;
  return size <= kNarrowHead ? kNarrowHead : size <= kHeadDim ? kHeadDim : kMaxHeadSize;
}

// The bytes of one record, K1's output per (chunk slot, head), at head size D:
// six [16][D] bf16 planes, D fp32 decays and four [16][16] bf16 planes. Its
// layout is the CUDA kernels' own (params.h, which checks it against this size).
constexpr int record_bytes(int D) {
  return 6 * kChunk * D * 2 + D * 4 + 4 * kChunk * kChunk * 2;
}
static_assert(record_bytes(kHeadDim) == 27136, "the record at D = 128");

}  // namespace kda
