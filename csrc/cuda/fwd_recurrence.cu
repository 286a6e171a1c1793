// K2: the chunk-by-chunk recurrence. Value columns of the V-first state never
// interact, so each (sequence, head) is split into four blocks of 32 columns:
// four times the blocks of one-block-per-head designs when N * H is small.
//
// Block of 128 threads = 4 warps; warp w owns state rows k in [32w, 32w + 32),
// lane l owns column v0 + l; each thread keeps its 32 state values in
// registers in fp32 for the whole sequence (a bf16 state is rounded only when
// it is written out).
#include <c10/cuda/CUDAException.h>

#include <string>

#include "cuda/device_utils.cuh"
#include "cuda/launch.h"

namespace kda::cuda {
namespace {

constexpr int C = kChunk;
constexpr int D = kHeadDim;
constexpr int kCols = 32;  // value columns per block
constexpr int kSplits = D / kCols;
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = D / kWarps;  // state rows per thread
static_assert(kThreads == D, "one thread per key row when staging exp(G_last)");

struct __align__(16) Smem {
  float W[C][D];
  float Qs[C][D];
  float Kd[C][D];
  float U0[C][kCols];
  float Aqk[C][C];
  float gl[D];
  float redU[kWarps][C][kCols];
  float redO[kWarps][C][kCols];
  float U[C][kCols];
};

__device__ __forceinline__ float4 ld4(const float* ptr) {
  return *reinterpret_cast<const float4*>(ptr);
}

__global__ void __launch_bounds__(kThreads) recurrence_kernel(const FwdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

  const int64_t H = p.H;
  const int split = blockIdx.x % kSplits;
  const int64_t h = (blockIdx.x / kSplits) % H;
  const int64_t n = blockIdx.x / (kSplits * H);
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int row0 = warp * kRows;
  const int col = split * kCols + lane;  // this thread's state column v

  // State column `col`, rows row0..row0+31: state[n, h, col, row].
  const int64_t state_base = ((n * H + h) * D + col) * D + row0;
  float s[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    s[r] = p.initial_state != nullptr ? load_state(p.initial_state, state_base + r, p.state_fp32) : 0.f;
  }

  const int64_t seq_bos = p.seq_offsets[n], seq_eos = p.seq_offsets[n + 1];
  const int64_t c_begin = p.chunk_offsets[n];
  const int64_t c_end = min64(p.chunk_offsets[n + 1], p.num_slots);
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);

  for (int64_t slot = c_begin; slot < c_end; ++slot) {
    const int64_t bos = seq_bos + (slot - c_begin) * C;
    const int len = static_cast<int>(min64(C, seq_eos - bos));
    const float* ws = p.workspace + (slot * H + h) * kWsChunkFloats;

    // Stage this chunk's operands in shared memory (16-byte loads).
    for (int e = tid; e < C * D / 4; e += kThreads) {
      reinterpret_cast<float4*>(&sm.W[0][0])[e] = ld4(ws + kWsW + 4 * e);
      reinterpret_cast<float4*>(&sm.Qs[0][0])[e] = ld4(ws + kWsQs + 4 * e);
      reinterpret_cast<float4*>(&sm.Kd[0][0])[e] = ld4(ws + kWsKd + 4 * e);
    }
    for (int e = tid; e < C * kCols / 4; e += kThreads) {
      const int i = e / (kCols / 4), c4 = e % (kCols / 4);
      reinterpret_cast<float4*>(&sm.U0[i][0])[c4] = ld4(ws + kWsU0 + i * D + split * kCols + 4 * c4);
    }
    for (int e = tid; e < C * C; e += kThreads) {
      sm.Aqk[e / C][e % C] = ws[kWsAqk + e];
    }
    sm.gl[tid] = ws[kWsGl + tid];
    __syncthreads();

    // Partial products over this warp's 32 rows: W S and Qs S.
    float accU[C], accO[C];
#pragma unroll
    for (int i = 0; i < C; ++i) {
      accU[i] = 0.f;
      accO[i] = 0.f;
    }
#pragma unroll
    for (int r4 = 0; r4 < kRows / 4; ++r4) {
#pragma unroll
      for (int i = 0; i < C; ++i) {
        const float4 w = ld4(&sm.W[i][row0 + 4 * r4]);
        const float4 q = ld4(&sm.Qs[i][row0 + 4 * r4]);
        accU[i] += w.x * s[4 * r4] + w.y * s[4 * r4 + 1] + w.z * s[4 * r4 + 2] + w.w * s[4 * r4 + 3];
        accO[i] += q.x * s[4 * r4] + q.y * s[4 * r4 + 1] + q.z * s[4 * r4 + 2] + q.w * s[4 * r4 + 3];
      }
    }
#pragma unroll
    for (int i = 0; i < C; ++i) {
      sm.redU[warp][i][lane] = accU[i];
      sm.redO[warp][i][lane] = accO[i];
    }
    __syncthreads();

    // U = U0 - W S across the four warps; keep Qs S for the output.
    for (int e = tid; e < C * kCols; e += kThreads) {
      const int i = e / kCols, c = e % kCols;
      float ws_sum = 0.f, qs_sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        ws_sum += sm.redU[w][i][c];
        qs_sum += sm.redO[w][i][c];
      }
      sm.U[i][c] = sm.U0[i][c] - ws_sum;
      sm.redO[0][i][c] = qs_sum;
    }
    __syncthreads();

    // O = Qs S + Aqk U for the rows that are real tokens.
    for (int e = tid; e < C * kCols; e += kThreads) {
      const int i = e / kCols, c = e % kCols;
      if (i < len) {
        float o = sm.redO[0][i][c];
#pragma unroll
        for (int j = 0; j < C; ++j) {
          o += sm.Aqk[i][j] * sm.U[j][c];
        }
        out[((bos + i) * H + h) * D + split * kCols + c] = __float2bfloat16_rn(o);
      }
    }

    // S <- Diag(exp(G_last)) S + Kd^T U.
    float u[C];
#pragma unroll
    for (int i = 0; i < C; ++i) {
      u[i] = sm.U[i][lane];
    }
#pragma unroll
    for (int r4 = 0; r4 < kRows / 4; ++r4) {
      const float4 gl = ld4(&sm.gl[row0 + 4 * r4]);
      float a0 = gl.x * s[4 * r4], a1 = gl.y * s[4 * r4 + 1], a2 = gl.z * s[4 * r4 + 2], a3 = gl.w * s[4 * r4 + 3];
#pragma unroll
      for (int i = 0; i < C; ++i) {
        const float4 kd = ld4(&sm.Kd[i][row0 + 4 * r4]);
        a0 += kd.x * u[i];
        a1 += kd.y * u[i];
        a2 += kd.z * u[i];
        a3 += kd.w * u[i];
      }
      s[4 * r4] = a0;
      s[4 * r4 + 1] = a1;
      s[4 * r4 + 2] = a2;
      s[4 * r4 + 3] = a3;
    }
    __syncthreads();  // the next chunk overwrites the shared operands
  }

  if (p.final_state != nullptr) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      store_state(p.final_state, state_base + r, s[r], p.state_fp32);
    }
  }
}

}  // namespace

void launch_recurrence(const FwdParams& p, cudaStream_t stream) {
  if (p.N == 0 || p.H == 0) {
    return;
  }
  constexpr size_t smem = sizeof(Smem);
  static_assert(smem <= 48 * 1024, "needs cudaFuncSetAttribute for more than 48 KB of shared memory");
  const int64_t blocks = p.N * p.H * kSplits;
  TORCH_CHECK(blocks <= INT32_MAX, "kda.fwd: ", std::to_string(p.N), " sequences x ", std::to_string(p.H),
              " heads is more blocks than one launch takes");
  recurrence_kernel<<<static_cast<unsigned int>(blocks), kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kda::cuda
