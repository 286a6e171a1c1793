// K1: one block of 128 threads per (chunk, head); thread d owns key channel d.
// Everything here is token-parallel, so it runs at full width; the sequential
// kernel then only does the state products.
#include <c10/cuda/CUDAException.h>

#include <string>

#include "cuda/device_utils.cuh"
#include "cuda/launch.h"

namespace kda::cuda {
namespace {

constexpr int C = kChunk;
constexpr int D = kHeadDim;
constexpr int kThreads = D;
constexpr int kWarps = kThreads / 32;
constexpr int kPad = D + 1;  // row stride of the shared tiles: column reads hit distinct banks

__global__ void __launch_bounds__(kThreads) prepare_kernel(const FwdParams p) {
  __shared__ float sQe[C][kPad];    // q^ exp(G)
  __shared__ float sKe[C][kPad];    // k^ exp(G)
  __shared__ float sKi[C][kPad];    // k^ exp(-G)
  __shared__ float sA[C][C + 1];    // A_kk, strictly lower
  __shared__ float sSq[2][C][kWarps];
  __shared__ float sBeta[C];

  const int64_t H = p.H;
  const int64_t slot = blockIdx.x / H;
  const int64_t h = blockIdx.x % H;
  const int64_t total_chunks = p.chunk_offsets[p.N];
  // The grid covers the capacity; the live chunks are fewer when sequences end
  // in partial chunks or are empty.
  if (slot >= total_chunks) {
    return;
  }
  const int64_t n = sequence_of_slot(p.chunk_offsets, p.N, slot);
  const int64_t bos = p.seq_offsets[n] + (slot - p.chunk_offsets[n]) * C;
  const int len = static_cast<int>(min64(C, p.seq_offsets[n + 1] - bos));

  const int d = threadIdx.x;
  const int warp = d / 32, lane = d % 32;

  float q[C], k[C], gsum[C];
#pragma unroll
  for (int i = 0; i < C; ++i) {
    const int64_t idx = ((bos + i) * H + h) * D + d;
    const bool valid = i < len;
    q[i] = valid ? load_bf16(p.q, idx) : 0.f;
    k[i] = valid ? load_bf16(p.k, idx) : 0.f;
    gsum[i] = valid ? load_bf16(p.g, idx) : 0.f;
  }
  if (d < C) {
    sBeta[d] = d < len ? 1.f / (1.f + expf(-load_bf16(p.beta, (bos + d) * H + h))) : 0.f;
  }

  // Squared norms of q_i and k_i: warp partial sums, then across warps.
#pragma unroll
  for (int i = 0; i < C; ++i) {
    const float sq = warp_sum(q[i] * q[i]);
    const float sk = warp_sum(k[i] * k[i]);
    if (lane == 0) {
      sSq[0][i][warp] = sq;
      sSq[1][i][warp] = sk;
    }
  }

  // Gate: lambda = lower_bound * sigmoid(exp(A_log) (g + dt_bias)); padded
  // rows get lambda = 0 so that G_last is the last real row's G.
  const float A = expf(p.A_log[h]);
  const float bias = p.dt_bias[h * D + d];
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < C; ++i) {
    const float lam = i < len ? p.lower_bound / (1.f + expf(-A * (gsum[i] + bias))) : 0.f;
    acc += lam;
    gsum[i] = acc;  // now G_i, the cumulative log decay
  }
  __syncthreads();

  float* ws = p.workspace + (slot * H + h) * kWsChunkFloats;
  const float g_last = gsum[C - 1];
#pragma unroll
  for (int i = 0; i < C; ++i) {
    float nq = 0.f, nk = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      nq += sSq[0][i][w];
      nk += sSq[1][i][w];
    }
    const float qn = q[i] * rsqrtf(nq + static_cast<float>(kNormEps));
    const float kn = k[i] * rsqrtf(nk + static_cast<float>(kNormEps));
    // |G| <= 16 * 5 = 80 here, so exp(-G) <= e^80 stays finite in fp32.
    const float e = expf(gsum[i]);
    sQe[i][d] = qn * e;
    sKe[i][d] = kn * e;
    sKi[i][d] = kn * expf(-gsum[i]);
    ws[kWsQs + i * D + d] = p.scale * qn * e;
    ws[kWsKd + i * D + d] = kn * expf(g_last - gsum[i]);
  }
  ws[kWsGl + d] = expf(g_last);
  __syncthreads();

  // The 16x16 matrices: thread d computes entries d and d + 128 of each.
#pragma unroll
  for (int e = d; e < C * C; e += kThreads) {
    const int i = e / C, j = e % C;
    float dot_kk = 0.f, dot_qk = 0.f;
    if (j <= i) {
#pragma unroll 8
      for (int c = 0; c < D; ++c) {
        dot_kk += sKe[i][c] * sKi[j][c];
        dot_qk += sQe[i][c] * sKi[j][c];
      }
    }
    sA[i][j] = j < i ? sBeta[i] * dot_kk : 0.f;
    ws[kWsAqk + e] = j <= i ? p.scale * dot_qk : 0.f;
  }
  __syncthreads();

  // Forward substitution with the unit lower triangular (I + A_kk), column d
  // of both right-hand sides: diag(beta) k^ exp(G) and diag(beta) v.
  float x[C], y[C];
#pragma unroll
  for (int i = 0; i < C; ++i) {
    const float vi = i < len ? load_bf16(p.v, ((bos + i) * H + h) * D + d) : 0.f;
    float xi = sBeta[i] * sKe[i][d];
    float yi = sBeta[i] * vi;
#pragma unroll
    for (int j = 0; j < i; ++j) {
      xi -= sA[i][j] * x[j];
      yi -= sA[i][j] * y[j];
    }
    x[i] = xi;
    y[i] = yi;
    ws[kWsW + i * D + d] = xi;
    ws[kWsU0 + i * D + d] = yi;
  }
}

}  // namespace

void launch_prepare(const FwdParams& p, cudaStream_t stream) {
  if (p.num_slots == 0 || p.H == 0) {
    return;
  }
  const int64_t blocks = p.num_slots * p.H;
  TORCH_CHECK(blocks <= INT32_MAX, "kda.fwd: ", std::to_string(p.num_slots), " chunks x ", std::to_string(p.H),
              " heads is more blocks than one launch takes");
  prepare_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kda::cuda
