// The one interface between the host code (ops_cuda.cpp) and the CUDA
// kernels: plain sizes and pointers, passed by value to the launchers.
#pragma once

#include <cstdint>

namespace kda::cuda {

constexpr int kHeadDim = 128;  // K = V = 128: the only head size the CUDA kernels serve

struct FwdParams {
  int64_t B = 0, T = 0, H = 0;  // q is [B, T, H, K]
  int64_t N = 0;                // sequences: B, or len(cu_seqlens) - 1
  int64_t total_tokens = 0;     // B * T

  // Inputs, contiguous. q, k, v, g: bf16 [B*T, H, 128]; beta: bf16 [B*T, H].
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* g = nullptr;
  const void* beta = nullptr;
  const float* A_log = nullptr;    // [H]
  const float* dt_bias = nullptr;  // [H, 128]

  // Sequence boundaries: null for fixed length (sequence n = batch row n).
  const void* cu_seqlens = nullptr;  // [N + 1]
  bool cu_seqlens_int64 = true;

  // States [N, H, V, K] (V-first), bf16 or fp32; null when absent.
  const void* initial_state = nullptr;
  void* final_state = nullptr;
  bool state_fp32 = true;

  void* out = nullptr;  // bf16 [B*T, H, 128]

  float scale = 0.f;
  float lower_bound = 0.f;  // bounded gate, in [-5, 0)
};

}  // namespace kda::cuda
