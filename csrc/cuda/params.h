// The one interface between the host code (ops_cuda.cpp) and the CUDA
// kernels: plain sizes and pointers, passed by value to the launchers.
#pragma once

#include <cstdint>

#include "constants.h"

namespace kda::cuda {

constexpr int kHeadDim = 128;  // K = V = 128: the only head size the CUDA kernels serve
constexpr int kChunk = 16;     // tokens per chunk

// Per (chunk, head) the prepare kernel leaves these fp32 blocks in the
// workspace for the recurrence kernel (offsets in floats):
//   Qs  [16][128]  scale * exp(G) * q^          (reads the chunk-start state)
//   W   [16][128]  (I + A_kk)^-1 diag(beta) (exp(G) * k^)
//   U0  [16][128]  (I + A_kk)^-1 diag(beta) v
//   Kd  [16][128]  exp(G_last - G) * k^         (writes the next state)
//   Aqk [16][16]   scale * (q^_i . k^_j exp(G_i - G_j)), j <= i
//   gl  [128]      exp(G_last)
constexpr int kWsQs = 0;
constexpr int kWsW = kWsQs + kChunk * kHeadDim;
constexpr int kWsU0 = kWsW + kChunk * kHeadDim;
constexpr int kWsKd = kWsU0 + kChunk * kHeadDim;
constexpr int kWsAqk = kWsKd + kChunk * kHeadDim;
constexpr int kWsGl = kWsAqk + kChunk * kChunk;
constexpr int kWsChunkFloats = kWsGl + kHeadDim;

struct FwdParams {
  int64_t H = 0;  // heads
  int64_t N = 0;  // sequences

  // Inputs, contiguous. q, k, v, g: bf16 [tokens, H, 128]; beta: bf16 [tokens, H].
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* g = nullptr;
  const void* beta = nullptr;
  const float* A_log = nullptr;    // [H]
  const float* dt_bias = nullptr;  // [H, 128]

  // Sequence n spans tokens [seq_offsets[n], seq_offsets[n+1]) and chunk slots
  // [chunk_offsets[n], chunk_offsets[n+1]) of the workspace. Both are int64
  // [N + 1], non-decreasing and within bounds by construction on the host,
  // whatever the caller's cu_seqlens held.
  const int64_t* seq_offsets = nullptr;
  const int64_t* chunk_offsets = nullptr;
  int64_t num_slots = 0;        // workspace capacity in chunks (per head)
  float* workspace = nullptr;   // [num_slots, H, kWsChunkFloats]

  // States [N, H, V, K] (V-first), both in one dtype, bf16 or fp32; null when absent.
  const void* initial_state = nullptr;
  void* final_state = nullptr;
  bool state_fp32 = true;

  void* out = nullptr;  // bf16 [tokens, H, 128]

  float scale = 0.f;
  float lower_bound = 0.f;  // bounded gate, in [-5, 0)
};

}  // namespace kda::cuda
