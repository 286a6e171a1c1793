// K1: one block of 128 threads per (chunk, head); thread d owns key channel d.
// Everything here is token-parallel, so it runs at full width; the sequential
// kernel then only does the state products.
#include <c10/cuda/CUDAException.h>

#include <string>

#include "cuda/chunk_inputs.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/launch.h"

namespace kda::cuda {
namespace {

constexpr int C = kChunk;
constexpr int D = kHeadDim;
constexpr int kThreads = D;
static_assert(kThreads == C * C / 2, "two entries of each 16x16 matrix per thread");
// Row stride of the shared tiles: 16-byte aligned rows, and the 8 rows that a
// quarter warp reads with 16-byte loads fall in distinct banks.
constexpr int kPad = D + 4;

// Six blocks per SM (at most 80 registers a thread): the block's single
// round trip to memory hides behind the other blocks' arithmetic. Eight (64
// registers) measured no faster (K1 0.763 -> 0.776 ms at 8192 x 96, H200).
constexpr int kMinBlocksPerSm = 6;

__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) prepare_kernel(const FwdParams p) {
  // sQe and sKe first hold the raw q and k rows (load_chunk_inputs), then
  // q^ exp(G) and k^ exp(G).
  __shared__ __align__(16) float sQe[C][kPad];  // q^ exp(G)
  __shared__ __align__(16) float sKe[C][kPad];  // k^ exp(G)
  __shared__ __align__(16) float sKi[C][kPad];  // k^ exp(-G)
  __shared__ float sA[C][C + 1];    // A_kk, strictly lower
  __shared__ float sInvNorm[2][C];  // 1 / ||q_i||, 1 / ||k_i|| (with the epsilon)
  __shared__ float sBeta[C];

  ChunkPlace c;
  if (!place_chunk(p, c)) {
    return;
  }
  const int64_t H = p.H, h = c.h;
  const int d = threadIdx.x;
  float G2[C], v[C];
  load_chunk_inputs<kPad>(p, c, sQe, sKe, sBeta, sInvNorm, G2, v);

  unsigned char* ws = reinterpret_cast<unsigned char*>(p.workspace) + ((c.slot - p.slot_begin) * H + h) * kWsChunkBytes;
  float* ws_u0 = reinterpret_cast<float*>(ws + kWsU0);
  const float e_last = fast_exp2(G2[C - 1]);
  // Column d of every tile is this thread's alone until the next barrier.
#pragma unroll
  for (int i = 0; i < C; ++i) {
    const float qn = sQe[i][d] * sInvNorm[0][i];
    const float kn = sKe[i][d] * sInvNorm[1][i];
    // |G| <= 16 * 5 = 80 here: exp(G) >= e^-80 is a normal float and its
    // reciprocal exp(-G) <= e^80 stays finite.
    const float e = fast_exp2(G2[i]);
    const float e_inv = fast_exp2(-G2[i]);
    sQe[i][d] = qn * e;
    sKe[i][d] = kn * e;
    sKi[i][d] = kn * e_inv;
    store_split(ws + kWsQs, kWsQsLo - kWsQs, plane_index(i, d), p.scale * qn * e, p.lo_for_backward);
    store_split(ws + kWsKd, kPlaneBytes, plane_index(i, d), kn * (e_last * e_inv));
  }
  reinterpret_cast<float*>(ws + kWsGl)[d] = e_last;
  __syncthreads();

  // The 16x16 matrices: thread d computes rows i0 = d / 16 and i0 + 8 of
  // column j = d % 16, so that each piece of row j of k^ exp(-G) it reads
  // serves four dot products. Entries above the diagonal are finite (|G| <= 80)
  // and dropped.
  {
    const int j = d % C, i0 = d / C, i1 = i0 + C / 2;
    float kk0 = 0.f, kk1 = 0.f, qk0 = 0.f, qk1 = 0.f;
#pragma unroll 4
    for (int c = 0; c < D; c += 4) {
      const float4 ki = *reinterpret_cast<const float4*>(&sKi[j][c]);
      const float4 ke0 = *reinterpret_cast<const float4*>(&sKe[i0][c]);
      const float4 ke1 = *reinterpret_cast<const float4*>(&sKe[i1][c]);
      const float4 qe0 = *reinterpret_cast<const float4*>(&sQe[i0][c]);
      const float4 qe1 = *reinterpret_cast<const float4*>(&sQe[i1][c]);
      kk0 += ke0.x * ki.x + ke0.y * ki.y + ke0.z * ki.z + ke0.w * ki.w;
      kk1 += ke1.x * ki.x + ke1.y * ki.y + ke1.z * ki.z + ke1.w * ki.w;
      qk0 += qe0.x * ki.x + qe0.y * ki.y + qe0.z * ki.z + qe0.w * ki.w;
      qk1 += qe1.x * ki.x + qe1.y * ki.y + qe1.z * ki.z + qe1.w * ki.w;
    }
    sA[i0][j] = j < i0 ? sBeta[i0] * kk0 : 0.f;
    sA[i1][j] = j < i1 ? sBeta[i1] * kk1 : 0.f;
    store_split(ws + kWsAqk, kWsAqkLo - kWsAqk, i0 * C + j, j <= i0 ? p.scale * qk0 : 0.f, p.lo_for_backward);
    store_split(ws + kWsAqk, kWsAqkLo - kWsAqk, i1 * C + j, j <= i1 ? p.scale * qk1 : 0.f, p.lo_for_backward);
  }
  __syncthreads();

  // Forward substitution with the unit lower triangular (I + A_kk), column d
  // of both right-hand sides: diag(beta) k^ exp(G) and diag(beta) v.
  float x[C], y[C];
  forward_substitute(
      sA, [&](int i) { return make_float2(sBeta[i] * sKe[i][d], sBeta[i] * v[i]); }, x, y,
      [&](int i, float xi, float yi) {
        store_split(ws + kWsW, kPlaneBytes, plane_index(i, d), xi);
        ws_u0[i * D + d] = yi;
      });
}

}  // namespace

void launch_prepare(const FwdParams& p, cudaStream_t stream) {
  const int64_t slots = p.slot_end - p.slot_begin;
  if (slots <= 0 || p.H == 0) {
    return;
  }
  const int64_t blocks = slots * p.H;
  TORCH_CHECK(blocks <= INT32_MAX, "kda.fwd: ", std::to_string(slots), " chunks x ", std::to_string(p.H),
              " heads is more blocks than one launch takes");
  prepare_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kda::cuda
