// Sequence and chunk offsets of a varlen batch from cu_seqlens, on the device
// and in one launch (the host never reads cu_seqlens; a handful of ATen ops
// would cost more host time than the kernels of a small batch). One block
// walks [0, N] in tiles with two block-wide scans per tile:
//   seq[i]    = max over j <= i of clamp(cu_seqlens[j], 0, tokens)
//   chunks[0] = 0, chunks[i] = chunks[i-1] + ceil((seq[i] - seq[i-1]) / 16)
// so that a malformed cu_seqlens gives wrong numbers but never an access out
// of bounds (params.h). Then the sequences longest first (FwdParams::seq_order):
// a recurrence block runs its sequence's chunks one after the other, and blocks
// start in index order, so a long sequence at the end of a batch would start
// last and finish alone (the backward's dS recurrence takes the same order).
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>

#include "cuda/device_utils.cuh"
#include "cuda/launch.h"

namespace kda::cuda {
namespace {

constexpr int kThreads = 1024;

// Inclusive scan over the block with `op`; every thread calls it.
template <typename Op>
__device__ int64_t block_scan(int64_t x, int64_t* buf, Op op) {
  const int tid = threadIdx.x;
  buf[tid] = x;
  __syncthreads();
  for (int offset = 1; offset < kThreads; offset <<= 1) {
    const int64_t y = tid >= offset ? op(x, buf[tid - offset]) : x;
    __syncthreads();
    buf[tid] = x = y;
    __syncthreads();
  }
  return x;
}

__global__ void __launch_bounds__(kThreads)
    boundaries_kernel(const void* cu, bool cu_int32, int64_t N, int64_t tokens, int64_t* seq, int64_t* chunks,
                      int64_t* order) {
  __shared__ int64_t buf[kThreads];
  const int tid = threadIdx.x;
  int64_t carry_seq = 0, carry_chunks = 0;  // the previous tile's last values (uniform)
  const auto max_op = [](int64_t a, int64_t b) { return a > b ? a : b; };
  const auto sum_op = [](int64_t a, int64_t b) { return a + b; };
  for (int64_t base = 0; base <= N; base += kThreads) {
    const int64_t i = base + tid;
    int64_t x = 0;  // the identity of the max-scan: values are clamped to >= 0
    if (i <= N) {
      x = load_int(cu, cu_int32, i);
      x = x < 0 ? 0 : (x > tokens ? tokens : x);
    }
    int64_t s = block_scan(x, buf, max_op);
    if (base > 0) {
      s = max_op(s, carry_seq);
    }
    buf[tid] = s;
    __syncthreads();
    const int64_t prev = tid > 0 ? buf[tid - 1] : carry_seq;
    const int64_t last_seq = buf[kThreads - 1];
    __syncthreads();
    const int64_t count = (i >= 1 && i <= N) ? (s - prev + kChunk - 1) / kChunk : 0;
    const int64_t csum = block_scan(count, buf, sum_op) + carry_chunks;
    const int64_t last_chunks = buf[kThreads - 1] + carry_chunks;
    __syncthreads();
    if (i <= N) {
      seq[i] = s;
      chunks[i] = csum;
    }
    carry_seq = last_seq;
    carry_chunks = last_chunks;
  }
  // The order by rank: sequence i goes to place #{j : longer, or as long and
  // before i}. One pass of N comparisons a thread, so only up to kThreads
  // sequences; a larger batch keeps its own order (its blocks come in many
  // waves, and their order matters less).
  __syncthreads();  // this block's writes of chunks[] are visible to it
  if (N <= kThreads) {
    if (tid < N) {
      buf[tid] = chunks[tid + 1] - chunks[tid];
    }
    __syncthreads();
    if (tid < N) {
      const int64_t mine = buf[tid];
      int64_t rank = 0;
      for (int64_t j = 0; j < N; ++j) {
        const int64_t other = buf[j];
        rank += other > mine || (other == mine && j < tid);
      }
      order[rank] = tid;
    }
  } else {
    for (int64_t i = tid; i < N; i += kThreads) {
      order[i] = i;
    }
  }
}

// Block b: tokens [16 b, 16 b + 16) of the rows (`width` bf16 elements per
// token) outside [seq[0], seq[N]), the only tokens no chunk covers.
__global__ void __launch_bounds__(128) zero_uncovered_kernel(const int64_t* seq, int64_t N, int64_t tokens,
                                                             ZeroRows rows) {
  const int64_t lo = seq[0], hi = seq[N];
  const int64_t t0 = int64_t{blockIdx.x} * kChunk;
  if (t0 >= lo && t0 + kChunk <= hi) {
    return;  // the whole block covered: every block but a few
  }
  for (int r = 0; r < ZeroRows::kMax; ++r) {
    if (rows.base[r] == nullptr) {
      continue;
    }
    const int64_t width = rows.width[r];
    for (int64_t t = t0; t < t0 + kChunk && t < tokens; ++t) {
      if (t < lo || t >= hi) {
        for (int64_t e = threadIdx.x; e < width; e += blockDim.x) {
          static_cast<__nv_bfloat16*>(rows.base[r])[t * width + e] = __float2bfloat16_rn(0.f);
        }
      }
    }
  }
}

}  // namespace

void launch_zero_uncovered(const int64_t* seq, int64_t N, int64_t tokens, const ZeroRows& rows,
                           cudaStream_t stream) {
  const int64_t blocks = (tokens + kChunk - 1) / kChunk;
  if (blocks == 0) {
    return;
  }
  zero_uncovered_kernel<<<static_cast<unsigned int>(blocks), 128, 0, stream>>>(seq, N, tokens, rows);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_boundaries(const void* cu_seqlens, bool cu_int32, int64_t N, int64_t tokens, int64_t* seq,
                       int64_t* chunks, int64_t* order, cudaStream_t stream) {
  boundaries_kernel<<<1, kThreads, 0, stream>>>(cu_seqlens, cu_int32, N, tokens, seq, chunks, order);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kda::cuda
