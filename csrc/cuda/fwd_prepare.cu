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
// sA's rows 16-byte aligned: the substitution reads them four entries a load.
constexpr int kAPitch = C + 4;

// Six blocks per SM (at most 80 registers a thread): the block's single
// round trip to memory hides behind the other blocks' arithmetic. Eight (64
// registers) measured no faster (K1 0.763 -> 0.776 ms at 8192 x 96, H200).
constexpr int kMinBlocksPerSm = 6;

// M's column d (d < 16) into the record at ws: (I + A_kk)^-1 times column d of
// diag(beta). Not inlined: inlined after the backward records' W and U0 solve,
// it spilled 644 bytes at 80 registers; called, it starts with nothing live.
__device__ __noinline__ void solve_m_column(const float (*sA)[kAPitch], const float* sBeta, unsigned char* ws, int d) {
  float x[C], y[C];
  forward_substitute(
      sA, [&](int i) { return make_float2(i == d ? sBeta[i] : 0.f, 0.f); }, x, y,
      [&](int i, float xi, float) { store_split(ws + kWsM, kAqkPlaneBytes, i * C + d, xi); });
}

// kForBackward: the backward's records (FwdParams::lo_for_backward), which
// also hold U0 and the lo planes of Qs and Aqk. Two kernels rather than a branch:
// the forward's then neither loads v nor holds it (one kernel for both spilled
// 612 bytes at the 80 registers of six blocks per SM).
template <bool kForBackward>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) prepare_kernel(const FwdParams p) {
  // sQe and sKe first hold the raw q and k rows (load_chunk_inputs), then
  // q^ exp(G) and k^ exp(G).
  __shared__ __align__(16) float sQe[C][kPad];  // q^ exp(G)
  __shared__ __align__(16) float sKe[C][kPad];  // k^ exp(G)
  __shared__ __align__(16) float sKi[C][kPad];  // k^ exp(-G)
  __shared__ __align__(16) float sA[C][kAPitch];  // A_kk, strictly lower
  __shared__ float sInvNorm[2][C];  // 1 / ||q_i||, 1 / ||k_i|| (with the epsilon)
  __shared__ float sBeta[C];

  ChunkPlace c;
  if (!place_chunk(p, c)) {
    return;
  }
  const int64_t H = p.H, h = c.h;
  const int d = threadIdx.x;
  float G2[C], v[C];
  // The forward's record has no U0 (params.h): v only for the backward's.
  load_chunk_inputs<kPad>(p, c, sQe, sKe, sBeta, sInvNorm, G2, v, nullptr, kForBackward);

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
    store_split(ws + kWsQs, kWsQsLo - kWsQs, record_index(i, d), p.scale * qn * e, kForBackward);
    store_split(ws + kWsKd, kPlaneBytes, record_index(i, d), kn * (e_last * e_inv));
  }
  reinterpret_cast<float*>(ws + kWsGl)[d] = e_last;
  __syncthreads();

  // The 16x16 matrices, A = diag(beta) k^ exp(G) (k^ exp(-G))^T (strictly
  // lower) and Aqk, over the key channels in two halves: half h = lane / 16 of
  // each warp takes channels [64h, 64h + 64) of a 2x2 block of both matrices,
  // rows i0 = r / 8 and i0 + 8, columns j0 = r % 8 and j0 + 8 (r = 16 warp +
  // lane % 16 in 0..63), and a shuffle adds the halves. Per 4 channels that is 6
  // loads of 16 bytes for 32 FMAs, where a 2x1 block over all channels took 5
  // for 16: shared memory, which serves 16-byte loads per half warp, bound K1
  // (94 % of its L1 throughput at 8192 x 96 heads, H200; the old loop issued
  // 59 % of its shared-memory wavefronts; this one, counted, half as many).
  // Entries above the diagonal are finite (|G| <= 80) and dropped.
  {
    const int lane = d % 32, half = lane / 16, r = 16 * (d / 32) + lane % 16;
    const int i0 = r / 8, j0 = r % 8;
    const float* ke[2] = {&sKe[i0][64 * half], &sKe[i0 + 8][64 * half]};
    const float* qe[2] = {&sQe[i0][64 * half], &sQe[i0 + 8][64 * half]};
    const float* ki[2] = {&sKi[j0][64 * half], &sKi[j0 + 8][64 * half]};
    float kk[2][2] = {}, qk[2][2] = {};  // [row i0, i0 + 8][column j0, j0 + 8]
    auto dot4 = [](float4 a, float4 b, float acc) {
      return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
    };
#pragma unroll 2  // 4 spilled at 80 registers
    for (int c = 0; c < D / 2; c += 4) {
      float4 kiv[2], kev[2], qev[2];
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        kiv[a] = *reinterpret_cast<const float4*>(ki[a] + c);
        kev[a] = *reinterpret_cast<const float4*>(ke[a] + c);
        qev[a] = *reinterpret_cast<const float4*>(qe[a] + c);
      }
#pragma unroll
      for (int a = 0; a < 2; ++a) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          kk[a][b] = dot4(kev[a], kiv[b], kk[a][b]);
          qk[a][b] = dot4(qev[a], kiv[b], qk[a][b]);
        }
      }
    }
#pragma unroll
    for (int a = 0; a < 2; ++a) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        kk[a][b] += __shfl_xor_sync(0xffffffffu, kk[a][b], 16);
        qk[a][b] += __shfl_xor_sync(0xffffffffu, qk[a][b], 16);
      }
    }
    // Half h stores row i0 + 8h of the block.
    const int i = i0 + 8 * half;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int j = j0 + 8 * b;
      const float kkv = half ? kk[1][b] : kk[0][b], qkv = half ? qk[1][b] : qk[0][b];
      sA[i][j] = j < i ? sBeta[i] * kkv : 0.f;
      store_split(ws + kWsAqk, kWsAqkLo - kWsAqk, i * C + j, j <= i ? p.scale * qkv : 0.f, kForBackward);
    }
  }
  __syncthreads();

  // Forward substitution with the unit lower triangular (I + A_kk), column d
  // of two right-hand sides: diag(beta) k^ exp(G) (W), and, in the forward,
  // column d of diag(beta) (M's column d, stored by threads d < 16) or, for
  // the backward, diag(beta) v (U0; M's columns then in a pass of their own).
  float x[C], y[C];
  if constexpr (!kForBackward) {
    auto rhs = [&](int i) { return make_float2(sBeta[i] * sKe[i][d], i == d ? sBeta[i] : 0.f); };
    auto row = [&](int i, float xi, float yi) {
      store_split(ws + kWsW, kPlaneBytes, record_index(i, d), xi);
      if (d < C) {
        store_split(ws + kWsM, kAqkPlaneBytes, i * C + d, yi);
      }
    };
    // M's columns are the first warp's (d < 16): the other warps' second
    // right-hand side is zero, and they skip it (a warp-uniform branch).
    if (d < 32) {
      forward_substitute<kAPitch, true>(sA, rhs, x, y, row);
    } else {
      forward_substitute<kAPitch, false>(sA, rhs, x, y, row);
    }
  } else {
    forward_substitute(
        sA, [&](int i) { return make_float2(sBeta[i] * sKe[i][d], sBeta[i] * v[i]); }, x, y,
        [&](int i, float xi, float yi) {
          store_split(ws + kWsW, kPlaneBytes, record_index(i, d), xi);
          ws_u0[i * D + d] = yi;
        });
    if (d < C) {
      solve_m_column(sA, sBeta, ws, d);
    }
  }
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
  if (p.lo_for_backward) {
    prepare_kernel<true><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(p);
  } else {
    prepare_kernel<false><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kda::cuda
