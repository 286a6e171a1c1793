// K1: one block of 128 threads per (chunk, head); thread d owns key channel d.
// Everything here is token-parallel, so it runs at full width; the sequential
// kernel then only does the state products.
#include <c10/cuda/CUDAException.h>

#include <string>

#include "cuda/chunk_inputs.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/launch.h"
#include "cuda/mma.cuh"

namespace kda::cuda {
namespace {

constexpr int C = kChunk;
constexpr int D = kHeadDim;
constexpr int kThreads = D;
static_assert(kThreads == 128 && D == 4 * 32 && C == 16,
              "the 16x16 products: four warps of 32 key channels, each warp one of their four fragments");
// Row stride of the shared tiles: 16-byte aligned rows, 8 banks apart, so that
// the 16x16 products' 8-byte fragment loads (a half warp: rows g = 0-3 or 4-7 x
// 8 bytes at 2t) fall in distinct banks; at D + 4 rows g and g + 1 shared
// banks, 48 of a warp's ~400 shared-memory wavefronts (ncu, eleventh session).
// reduce_rows32 reads the rows conflict-free at either pitch.
constexpr int kPad = D + 8;
// sA's rows 16-byte aligned: the substitution reads them four entries a load.
constexpr int kAPitch = C + 4;

// Six blocks per SM (at most 80 registers a thread): the block's single
// round trip to memory hides behind the other blocks' arithmetic. Eight (64
// registers) measured no faster (K1 0.763 -> 0.776 ms at 8192 x 96, H200).
constexpr int kMinBlocksPerSm = 6;

// kForBackward: the backward's records (FwdParams::lo_for_backward), which
// also hold the lo planes of Qs and Aqk (the dS recurrence reads them).
// kWKdLo: the lo planes of W and Kd (all but a forward with bf16 products,
// FwdParams::bf16_products, whose recurrence does not read them). Neither
// record holds U0 = M v: K2 and the backward's record gradients form it from v
// and M on the tensor cores (K1 writing U0 for the backward read v and wrote
// 8 KB more per chunk and head, which the record gradients read back).
template <bool kForBackward, bool kWKdLo>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) prepare_kernel(const FwdParams p) {
  static_assert(kWKdLo || !kForBackward, "the backward reads every plane");
  // sQe and sKe first hold the raw q and k rows (load_chunk_inputs), then
  // q^ exp(G) and k^ exp(G).
  __shared__ __align__(16) float sQe[C][kPad];  // q^ exp(G)
  __shared__ __align__(16) float sKe[C][kPad];  // k^ exp(G)
  __shared__ __align__(16) float sKi[C][kPad];  // k^ exp(-G)
  __shared__ __align__(16) float sA[C][kAPitch];  // A_kk, strictly lower
  __shared__ __align__(16) float sInvNorm[2][C];  // 1 / ||q_i||, 1 / ||k_i|| (with the epsilon)
  __shared__ float4 sRed[4][4][32];  // the 16x16 products' partial sums: [warp][fragment][lane]
  __shared__ float sBeta[C];

  ChunkPlace c;
  if (!place_chunk(p, c)) {
    return;
  }
  const int64_t H = p.H, h = c.h;
  const int d = threadIdx.x;
  float G2[C], v[C];
  // The records have no U0 (params.h): no v.
  load_chunk_inputs<kPad>(p, c, sQe, sKe, sBeta, sInvNorm, G2, v, nullptr, false);

  unsigned char* ws = reinterpret_cast<unsigned char*>(p.workspace) + ((c.slot - p.slot_begin) * H + h) * kWsChunkBytes;
  const float e_last = fast_exp2(G2[C - 1]);
  // Column d of every tile is this thread's alone until the next barrier. The
  // inverse norms four rows a load, ahead of each four rows' record stores:
  // every thread reads the same entries, so a load costs per instruction, and
  // ptxas does not move loads across the stores (through a generic pointer),
  // so as scalars they were 32 loads a thread.
  float4 inv_q, inv_k;
#pragma unroll
  for (int i = 0; i < C; ++i) {
    if (i % 4 == 0) {
      inv_q = *reinterpret_cast<const float4*>(&sInvNorm[0][i]);
      inv_k = *reinterpret_cast<const float4*>(&sInvNorm[1][i]);
    }
    const float qn = sQe[i][d] * (&inv_q.x)[i % 4];
    const float kn = sKe[i][d] * (&inv_k.x)[i % 4];
    // |G| <= 16 * 5 = 80 here: exp(G) >= e^-80 is a normal float and its
    // reciprocal exp(-G) <= e^80 stays finite.
    const float e = fast_exp2(G2[i]);
    const float e_inv = fast_exp2(-G2[i]);
    sQe[i][d] = qn * e;
    sKe[i][d] = kn * e;
    sKi[i][d] = kn * e_inv;
    store_split(ws + kWsQs, kWsQsLo - kWsQs, record_index(i, d), p.scale * qn * e, kForBackward);
    store_split(ws + kWsKd, kPlaneBytes, record_index(i, d), kn * (e_last * e_inv), kWKdLo);
  }
  reinterpret_cast<float*>(ws + kWsGl)[d] = e_last;
  __syncthreads();

  // The 16x16 matrices, A = diag(beta) k^ exp(G) (k^ exp(-G))^T (strictly
  // lower) and Aqk, on the tensor cores in bf16x3 (fp32-level, as K2's state
  // products): warp w takes key channels [32w, 32w + 32), two k-steps of both
  // matrices with k^ exp(-G) as the shared B operand, and the four warps'
  // partial sums meet in shared memory, added in warp order (deterministic).
  // As 2x2 blocks of FMAs the same products took ~680 of the ~2,260
  // instructions a thread executed, bound by shared memory's 16-byte loads; these
  // take ~220 (K1 -3 to -5 %: 0.630 -> 0.612 ms at 8192 x 96 heads, 0.931 -> 0.884
  // at 65536 x 16; H200; fp32 state error unchanged). Entries above the diagonal
  // are finite (|G| <= 80) and dropped.
  {
    const int warp = d / 32, lane = d % 32, g = lane / 4, t = lane % 4;
    float acc[2][2][4] = {};  // [A_kk, Aqk][n-tile: tokens j 0-7, 8-15][C fragment]
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const int c0 = 32 * warp + 16 * kk + 2 * t;
      // B fragments (tokens 8 nt + g; channels c0, c0 + 8) of k^ exp(-G), then
      // the A fragments (rows g, g + 8; the same channels) of k^ exp(G) and q^ exp(G).
      uint32_t kih[2][2], kil[2][2];
      split_b_fragments(sKi, g, c0, kih, kil);
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        uint32_t ah[4], al[4];
        split_a_fragment(m == 0 ? sKe : sQe, g, c0, ah, al);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          mma_bf16x3(acc[m][nt], ah, al, kih[nt][0], kih[nt][1], kil[nt][0], kil[nt][1]);
        }
      }
    }
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      sRed[warp][f][lane] = make_float4(acc[f / 2][f % 2][0], acc[f / 2][f % 2][1], acc[f / 2][f % 2][2],
                                        acc[f / 2][f % 2][3]);
    }
    __syncthreads();
    // Warp w now sums fragment f = w (matrix w / 2, n-tile w % 2) over the warps.
    float4 sum = sRed[0][warp][lane];
#pragma unroll
    for (int w = 1; w < 4; ++w) {
      const float4 x = sRed[w][warp][lane];
      sum = make_float4(sum.x + x.x, sum.y + x.y, sum.z + x.z, sum.w + x.w);
    }
    const float e[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = g + 8 * (r / 2), j = 8 * (warp % 2) + 2 * t + r % 2;
      if (warp < 2) {
        sA[i][j] = j < i ? sBeta[i] * e[r] : 0.f;
      } else {
        store_split(ws + kWsAqk, kWsAqkLo - kWsAqk, i * C + j, j <= i ? p.scale * e[r] : 0.f, kForBackward);
      }
    }
  }
  __syncthreads();

  // Forward substitution with the unit lower triangular (I + A_kk), column d
  // of two right-hand sides: diag(beta) k^ exp(G) (W) and column d of diag(beta)
  // (M's column d, stored by threads d < 16).
  float x[C], y[C];
  auto rhs = [&](int i) { return make_float2(sBeta[i] * sKe[i][d], i == d ? sBeta[i] : 0.f); };
  auto row = [&](int i, float xi, float yi) {
    store_split(ws + kWsW, kPlaneBytes, record_index(i, d), xi, kWKdLo);
    if (d < C) {
      store_split(ws + kWsM, kAqkPlaneBytes, i * C + d, yi);
    }
  };
  // M's columns are the first warp's (d < 16): the other warps' second
  // right-hand side is zero, and they skip it (a warp-uniform branch; with
  // sA's four-entry loads K1 -3 to -5 %: 0.655 -> 0.631 ms at 8192 x 96 heads,
  // H200).
  if (d < 32) {
    forward_substitute<kAPitch, true>(sA, rhs, x, y, row);
  } else {
    forward_substitute<kAPitch, false>(sA, rhs, x, y, row);
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
    prepare_kernel<true, true><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(p);
  } else if (p.bf16_products) {
    prepare_kernel<false, false><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(p);
  } else {
    prepare_kernel<false, true><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kda::cuda
