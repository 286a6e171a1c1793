// The backward sweep: one block of 256 threads per (sequence, head) walks the
// sequence's chunks backward, carrying dS (the gradient of the chunk-start
// state) in shared memory, and leaves per chunk the gradients of its record
// (params.h kDRec*) for K1's backward (bwd_prepare.cu). Per chunk, with the
// state S0 at its start, its record and dO (torch_kda/reference.py
// chunk_step_backward):
//   U  = U0 - W S0^T,  dU = Aqk^T dO + Kd dS1^T,
//   dQs = dO S0, dW = -dU S0, dKd = U dS1, dAqk = dO U^T, dgl = sum_v S0 * dS1, dU0 = dU,
//   dS0 = dS1 diag(gl) + dO^T Qs - dU^T W.
// First version: fp32 FMAs from shared memory, every sum in a fixed order
// (deterministic); correctness first, far from the tensor cores' speed. Not yet
// run on a GPU.
#include <c10/cuda/CUDAException.h>

#include <string>

#include "cuda/device_utils.cuh"
#include "cuda/launch.h"

namespace kda::cuda {
namespace {

constexpr int C = kChunk;
constexpr int D = kHeadDim;
constexpr int kThreads = 256;
constexpr int kSPad = D + 1;  // [v][k] tiles: a warp's 16 rows v at one k fall in distinct banks

struct SweepSmem {
  float s0[D][kSPad];  // S0[v][k]
  float ds[D][kSPad];  // dS[v][k], carried from chunk to chunk
  float w[C][D], qs[C][D], kd[C][D], u0[C][D];  // the record, hi + lo
  float aqk[C][C];
  float gl[D];
  float dout[C][D];  // dO[t][v], zero past the sequence's end
  float u[C][D];     // U[t][v]
  float du[C][D];    // dU[t][v]
};

// hi + lo of element (row, col) of a swizzled bf16 plane pair (params.h).
__device__ __forceinline__ float plane_value(const unsigned char* rec, int offset, int row, int col) {
  const auto* hi = reinterpret_cast<const __nv_bfloat16*>(rec + offset);
  const auto* lo = reinterpret_cast<const __nv_bfloat16*>(rec + offset + kPlaneBytes);
  const int idx = plane_index(row, col);
  return __bfloat162float(hi[idx]) + __bfloat162float(lo[idx]);
}

__global__ void __launch_bounds__(kThreads) sweep_backward_kernel(const SweepBwdParams bp) {
  const FwdParams& p = bp.fwd;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SweepSmem& sm = *reinterpret_cast<SweepSmem*>(smem_raw);

  const int64_t H = p.H;
  const int64_t h = blockIdx.x % H;
  const int64_t n = blockIdx.x / H;
  const int tid = threadIdx.x;
  // Thread (v, half) owns row v of the [v][k] tiles, key columns 64 half.. +64.
  const int v = tid / 2, half = tid % 2, k0 = 64 * half;

  const int64_t seq_bos = seq_offset(p, n), seq_eos = seq_offset(p, n + 1);
  const int64_t c_begin = chunk_offset(p, n);
  const int64_t c_end = min64(chunk_offset(p, n + 1), p.num_slots);
  const int64_t state_base = (n * H + h) * D * D;

  for (int k = k0; k < k0 + 64; ++k) {
    sm.ds[v][k] = bp.grad_final != nullptr ? bp.grad_final[state_base + v * D + k] : 0.f;
  }

  for (int64_t slot = c_end - 1; slot >= c_begin; --slot) {
    const int64_t bos = seq_bos + (slot - c_begin) * C;
    const int len = static_cast<int>(min64(C, seq_eos - bos));
    const unsigned char* rec = reinterpret_cast<const unsigned char*>(p.workspace) + (slot * H + h) * kWsChunkBytes;
    const float* s0 = bp.states + (slot * H + h) * D * D;
    for (int e = tid; e < C * D; e += kThreads) {
      const int t = e / D, col = e % D;
      sm.w[t][col] = plane_value(rec, kWsW, t, col);
      sm.qs[t][col] = plane_value(rec, kWsQs, t, col);
      sm.kd[t][col] = plane_value(rec, kWsKd, t, col);
      sm.u0[t][col] = reinterpret_cast<const float*>(rec + kWsU0)[t * D + col];
      sm.dout[t][col] = t < len ? bp.grad_out[((bos + t) * H + h) * D + col] : 0.f;
    }
    if (tid < C * C) {
      const auto* hi = reinterpret_cast<const __nv_bfloat16*>(rec + kWsAqk);
      const auto* lo = reinterpret_cast<const __nv_bfloat16*>(rec + kWsAqk + kAqkPlaneBytes);
      sm.aqk[tid / C][tid % C] = __bfloat162float(hi[tid]) + __bfloat162float(lo[tid]);
    }
    if (tid < D) {
      sm.gl[tid] = reinterpret_cast<const float*>(rec + kWsGl)[tid];
    }
    for (int k = k0; k < k0 + 64; ++k) {
      sm.s0[v][k] = s0[v * D + k];
    }
    __syncthreads();

    // U[t][v] and dU[t][v]: partial sums over this thread's 64 key columns, the
    // pair of threads of row v adding theirs (adjacent lanes).
    {
      float pu[C], pdu[C];
#pragma unroll
      for (int t = 0; t < C; ++t) {
        pu[t] = 0.f;
        pdu[t] = 0.f;
      }
      for (int k = k0; k < k0 + 64; ++k) {
        const float s = sm.s0[v][k], ds = sm.ds[v][k];
#pragma unroll
        for (int t = 0; t < C; ++t) {
          pu[t] += sm.w[t][k] * s;
          pdu[t] += sm.kd[t][k] * ds;
        }
      }
#pragma unroll
      for (int t = 0; t < C; ++t) {
        pu[t] += __shfl_xor_sync(0xffffffffu, pu[t], 1);
        pdu[t] += __shfl_xor_sync(0xffffffffu, pdu[t], 1);
      }
      if (half == 0) {
#pragma unroll
        for (int t = 0; t < C; ++t) {
          float a = 0.f;
#pragma unroll
          for (int i = 0; i < C; ++i) {
            a += sm.aqk[i][t] * sm.dout[i][v];
          }
          sm.u[t][v] = sm.u0[t][v] - pu[t];
          sm.du[t][v] = a + pdu[t];
        }
      }
    }
    __syncthreads();

    // The record's gradients, summed over the value rows in order: thread
    // (col = tid % 128, group = tid / 128) computes tokens 8 group.. +8 of key
    // column col.
    float* dr = bp.d_record + (slot * H + h) * kDRecFloats;
    {
      const int col = tid % D, t0 = 8 * (tid / D);
      float dqs[8], dw[8], dkd[8];
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        dqs[t] = 0.f;
        dw[t] = 0.f;
        dkd[t] = 0.f;
      }
      float dgl = 0.f;
      for (int r = 0; r < D; ++r) {
        const float s = sm.s0[r][col], ds = sm.ds[r][col];
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          dqs[t] += sm.dout[t0 + t][r] * s;
          dw[t] -= sm.du[t0 + t][r] * s;
          dkd[t] += sm.u[t0 + t][r] * ds;
        }
        dgl += s * ds;
      }
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        dr[kDRecQs + (t0 + t) * D + col] = dqs[t];
        dr[kDRecW + (t0 + t) * D + col] = dw[t];
        dr[kDRecKd + (t0 + t) * D + col] = dkd[t];
        dr[kDRecU0 + (t0 + t) * D + col] = sm.du[t0 + t][col];
      }
      if (tid < D) {
        dr[kDRecGl + col] = dgl;
      }
      // dAqk[i][j] = sum_v dO[i][v] U[j][v].
      const int i = tid / C, j = tid % C;
      float a = 0.f;
      for (int r = 0; r < D; ++r) {
        a += sm.dout[i][r] * sm.u[j][r];
      }
      dr[kDRecAqk + i * C + j] = a;
    }
    __syncthreads();  // every read of dS for this chunk is done

    // dS0 = dS1 diag(gl) + dO^T Qs - dU^T W, this thread's entries.
    {
      float dov[C], duv[C];
#pragma unroll
      for (int t = 0; t < C; ++t) {
        dov[t] = sm.dout[t][v];
        duv[t] = sm.du[t][v];
      }
      for (int k = k0; k < k0 + 64; ++k) {
        float x = sm.ds[v][k] * sm.gl[k];
#pragma unroll
        for (int t = 0; t < C; ++t) {
          x += dov[t] * sm.qs[t][k] - duv[t] * sm.w[t][k];
        }
        sm.ds[v][k] = x;
      }
    }
    __syncthreads();  // the next chunk overwrites the record tiles and S0
  }

  if (bp.d_initial != nullptr) {
    for (int k = k0; k < k0 + 64; ++k) {
      bp.d_initial[state_base + v * D + k] = sm.ds[v][k];
    }
  }
}

}  // namespace

void launch_sweep_backward(const SweepBwdParams& bp, cudaStream_t stream) {
  if (bp.fwd.N == 0 || bp.fwd.H == 0) {
    return;
  }
  constexpr size_t kSmem = sizeof(SweepSmem);
  static_assert(kSmem <= 227 * 1024, "over the per-block shared memory of sm_90");
  C10_CUDA_CHECK(cudaFuncSetAttribute(sweep_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(kSmem)));
  const int64_t blocks = bp.fwd.N * bp.fwd.H;
  TORCH_CHECK(blocks <= INT32_MAX, "kda.bwd: ", std::to_string(bp.fwd.N), " sequences x ",
              std::to_string(bp.fwd.H), " heads is more blocks than one launch takes");
  sweep_backward_kernel<<<static_cast<unsigned int>(blocks), kThreads, kSmem, stream>>>(bp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kda::cuda
