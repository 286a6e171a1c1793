// The state pool's kernels (params.h PoolParams): kda::fwd_pool_'s decode for
// requests of a few tokens, and the copies between the pool and the chunked
// forward's states for long ones.
//
// The decode is bound by the state's bytes: each (request, head) reads its
// 128 x 128 state once and writes it once (after every token with
// speculative decoding), while a token's arithmetic is 4 * 128 * 128 FMAs. So
// one block of eight warps per (request, head) holds the state in registers
// across the request's tokens, 16 rows (value channels) a warp, four key
// columns a lane: a row's loads and stores are one coalesced 512-byte (fp32)
// or 256-byte (bf16) access per warp, and the chunked forward's per-chunk
// record is never formed. With the V-first layout the rows evolve
// independently given the token's activations, which the block computes once
// into shared memory:
//   s <- s * alpha;  w = s . k^;  u = beta (v - w);  s <- s + u k^;  o = s . (scale q^)
// in fp32 throughout (the state is stored in the pool's dtype, rounded once).
#include <c10/cuda/CUDAException.h>

#include <string>

#include "cuda/device_utils.cuh"
#include "cuda/launch.h"

namespace kda::cuda {
namespace {

constexpr int D = kHeadDim;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = D / kWarps;  // state rows a warp carries
static_assert(D == 128 && kRows * kWarps == D, "four key columns a lane, whole rows a warp");

__device__ __forceinline__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : x > hi ? hi : x;
}

// Request n's tokens [bos, eos) and its start slot, -1 for a padding row.
struct Request {
  int64_t bos = 0, eos = 0, slot = -1;
};

__device__ __forceinline__ Request request_of(const PoolParams& p, int64_t n) {
  Request r;
  if (p.seq_offsets != nullptr) {
    r.bos = clamp64(p.seq_offsets[n], 0, p.T);
    r.eos = clamp64(p.seq_offsets[n + 1], r.bos, p.T);
  } else {
    r.bos = n * p.T;
    r.eos = r.bos + p.T;
  }
  int64_t col = 0;
  bool ok = true;
  if (p.accepted != nullptr) {
    const int64_t accepted = load_int(p.accepted, p.accepted_int32, n);
    ok = accepted >= 1 && accepted <= p.index_cols;
    col = ok ? accepted - 1 : 0;
  }
  const int64_t slot = load_int(p.indices, p.indices_int32, n * p.index_cols + col);
  r.slot = ok && slot >= 0 && slot < p.slots ? slot : -1;
  return r;
}

__device__ __forceinline__ void zero_out_rows(const PoolParams& p, const Request& r, int64_t h, int tid) {
  if (tid < D) {
    for (int64_t t = r.bos; t < r.eos; ++t) {
      static_cast<__nv_bfloat16*>(p.out)[(t * p.H + h) * D + tid] = __float2bfloat16_rn(0.f);
    }
  }
}

// Row `row` of head h in `slot`, at this lane's four key columns.
template <bool kFp32>
__device__ __forceinline__ void load_row(const PoolParams& p, int64_t slot, int64_t h, int row, int lane,
                                         float (&x)[4]) {
  const int64_t at = slot * p.pool_stride + (h * D + row) * D + 4 * lane;
  if constexpr (kFp32) {
    const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(p.pool) + at);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.pool) + at);
    const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&v.x);
    const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&v.y);
    x[0] = __low2float(a), x[1] = __high2float(a), x[2] = __low2float(b), x[3] = __high2float(b);
  }
}

template <bool kFp32>
__device__ __forceinline__ void store_row(const PoolParams& p, int64_t slot, int64_t h, int row, int lane,
                                          const float (&x)[4]) {
  const int64_t at = slot * p.pool_stride + (h * D + row) * D + 4 * lane;
  if constexpr (kFp32) {
    *reinterpret_cast<float4*>(static_cast<float*>(p.pool) + at) = make_float4(x[0], x[1], x[2], x[3]);
  } else {
    const __nv_bfloat162 a = __floats2bfloat162_rn(x[0], x[1]), b = __floats2bfloat162_rn(x[2], x[3]);
    uint2 v;
    v.x = *reinterpret_cast<const uint32_t*>(&a);
    v.y = *reinterpret_cast<const uint32_t*>(&b);
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.pool) + at) = v;
  }
}

// Shared memory of the decode block: one token's activations and its output.
struct TokenSmem {
  float q[D];      // scale q^
  float k[D];      // k^
  float alpha[D];  // exp(lambda)
  float v[D];
  float o[D];
  float sq[2][4];  // the four channel warps' sums of q^2 and k^2
};

// Threads 0..127 (channel d = tid): token th's activations into s. The scale
// is folded into q^.
__device__ __forceinline__ void token_activations(const PoolParams& p, int64_t th, float A, float bias, int tid,
                                                  TokenSmem& s) {
  const int lane = tid % 32, warp = tid / 32;
  float qd = 0.f, kd = 0.f;
  if (tid < D) {
    qd = load_bf16(p.q, th * D + tid);
    kd = load_bf16(p.k, th * D + tid);
    const float x = load_bf16(p.g, th * D + tid) + bias;
    // The gates in fp32: bounded lower_bound * sigmoid(A x); softplus -A softplus(x).
    const float lam = p.softplus ? -A * (fmaxf(x, 0.f) + log1pf(expf(-fabsf(x))))
                                 : p.lower_bound / (1.f + expf(-A * x));
    s.alpha[tid] = expf(lam);
    s.v[tid] = load_bf16(p.v, th * D + tid);
    const float a = warp_sum(qd * qd), b = warp_sum(kd * kd);
    if (lane == 0) {
      s.sq[0][warp] = a;
      s.sq[1][warp] = b;
    }
  }
  __syncthreads();
  if (tid < D) {
    const float sq = (s.sq[0][0] + s.sq[0][1]) + (s.sq[0][2] + s.sq[0][3]);
    const float sk = (s.sq[1][0] + s.sq[1][1]) + (s.sq[1][2] + s.sq[1][3]);
    s.q[tid] = qd * rsqrtf(sq + static_cast<float>(kNormEps)) * p.scale;
    s.k[tid] = kd * rsqrtf(sk + static_cast<float>(kNormEps));
  }
}

// kSpec: speculative decoding (PoolParams::accepted): the state after every
// token goes to that token's slot; else the final state goes to the start slot.
template <bool kFp32, bool kSpec>
__global__ void __launch_bounds__(kThreads) pool_decode_kernel(const PoolParams p) {
  __shared__ __align__(16) TokenSmem s;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t n = blockIdx.x / p.H, h = blockIdx.x % p.H;
  const Request r = request_of(p, n);
  if (r.slot < 0) {
    zero_out_rows(p, r, h, tid);
    return;
  }
  float x[kRows][4];  // rows warp * kRows + i, key columns 4 lane..
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    load_row<kFp32>(p, r.slot, h, warp * kRows + i, lane, x[i]);
  }
  const float A = expf(p.A_log[h]);
  const float bias = tid < D ? p.dt_bias[h * D + tid] : 0.f;
  for (int64_t t = r.bos; t < r.eos; ++t) {
    const int64_t th = t * p.H + h;
    // The previous token's rows have all been read (the barrier before the
    // output), so its activations may be overwritten.
    token_activations(p, th, A, bias, tid, s);
    const float beta = 1.f / (1.f + expf(-load_bf16(p.beta, th)));
    __syncthreads();
    const float4 al = *reinterpret_cast<const float4*>(&s.alpha[4 * lane]);
    const float4 kk = *reinterpret_cast<const float4*>(&s.k[4 * lane]);
    const float4 qq = *reinterpret_cast<const float4*>(&s.q[4 * lane]);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      float (&y)[4] = x[i];
      y[0] *= al.x, y[1] *= al.y, y[2] *= al.z, y[3] *= al.w;
      const float w = warp_sum(fmaf(y[3], kk.w, fmaf(y[2], kk.z, fmaf(y[1], kk.y, y[0] * kk.x))));
      const float u = beta * (s.v[warp * kRows + i] - w);
      y[0] = fmaf(u, kk.x, y[0]), y[1] = fmaf(u, kk.y, y[1]), y[2] = fmaf(u, kk.z, y[2]), y[3] = fmaf(u, kk.w, y[3]);
      const float o = warp_sum(fmaf(y[3], qq.w, fmaf(y[2], qq.z, fmaf(y[1], qq.y, y[0] * qq.x))));
      if (lane == 0) {
        s.o[warp * kRows + i] = o;
      }
    }
    __syncthreads();
    if (tid < D) {
      static_cast<__nv_bfloat16*>(p.out)[th * D + tid] = __float2bfloat16_rn(s.o[tid]);
    }
    if constexpr (kSpec) {
      const int64_t col = t - r.bos;
      const int64_t slot = col < p.index_cols ? load_int(p.indices, p.indices_int32, n * p.index_cols + col) : -1;
      if (slot >= 0 && slot < p.slots) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          store_row<kFp32>(p, slot, h, warp * kRows + i, lane, x[i]);
        }
      }
    }
  }
  if constexpr (!kSpec) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      store_row<kFp32>(p, r.slot, h, warp * kRows + i, lane, x[i]);
    }
  }
}

// One block per (request, head): the head's state between the pool and
// p.states, 16 bytes a thread and step; zeros into p.states for a padding row
// (kToPool: nothing for it).
template <bool kToPool>
__global__ void __launch_bounds__(kThreads) pool_copy_kernel(const PoolParams p) {
  const int64_t n = blockIdx.x / p.H, h = blockIdx.x % p.H;
  const Request r = request_of(p, n);
  const int64_t elem = p.pool_fp32 ? 4 : 2;
  constexpr int64_t kElems = int64_t{D} * D;
  auto* states = reinterpret_cast<uint4*>(static_cast<unsigned char*>(p.states) + (n * p.H + h) * kElems * elem);
  const int64_t pieces = kElems * elem / 16;
  if (r.slot < 0) {
    if (!kToPool) {
      for (int64_t i = threadIdx.x; i < pieces; i += kThreads) {
        states[i] = make_uint4(0, 0, 0, 0);
      }
    }
    return;
  }
  auto* pool = reinterpret_cast<uint4*>(static_cast<unsigned char*>(p.pool) + (r.slot * p.pool_stride + h * kElems) * elem);
  for (int64_t i = threadIdx.x; i < pieces; i += kThreads) {
    if (kToPool) {
      pool[i] = states[i];
    } else {
      states[i] = pool[i];
    }
  }
}

__global__ void __launch_bounds__(kThreads) pool_zero_padding_kernel(const PoolParams p) {
  const int64_t n = blockIdx.x / p.H, h = blockIdx.x % p.H;
  const Request r = request_of(p, n);
  if (r.slot < 0) {
    zero_out_rows(p, r, h, threadIdx.x);
  }
}

unsigned int grid_of(const PoolParams& p) {
  const int64_t blocks = p.N * p.H;
  TORCH_CHECK(blocks <= INT32_MAX, "kda.fwd_pool_: ", std::to_string(p.N), " requests x ", std::to_string(p.H),
              " heads is more blocks than one launch takes");
  return static_cast<unsigned int>(blocks);
}

}  // namespace

void launch_pool_decode(const PoolParams& p, cudaStream_t stream) {
  if (p.N == 0 || p.H == 0) {
    return;
  }
  const unsigned int grid = grid_of(p);
  auto* kernel = p.pool_fp32 ? (p.accepted != nullptr ? pool_decode_kernel<true, true> : pool_decode_kernel<true, false>)
                             : (p.accepted != nullptr ? pool_decode_kernel<false, true> : pool_decode_kernel<false, false>);
  kernel<<<grid, kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_pool_gather(const PoolParams& p, cudaStream_t stream) {
  if (p.N == 0 || p.H == 0) {
    return;
  }
  pool_copy_kernel<false><<<grid_of(p), kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_pool_scatter(const PoolParams& p, cudaStream_t stream) {
  if (p.N == 0 || p.H == 0) {
    return;
  }
  pool_copy_kernel<true><<<grid_of(p), kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_pool_zero_padding(const PoolParams& p, cudaStream_t stream) {
  if (p.N == 0 || p.H == 0) {
    return;
  }
  pool_zero_padding_kernel<<<grid_of(p), kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kda::cuda
