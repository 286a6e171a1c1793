// K2: the chunk-by-chunk recurrence, on the tensor cores.
//
// The rows of the V-first state (one per value channel) evolve independently
// given a chunk's operands, so a warp owns 16 value rows x all 128 key columns
// of one (sequence, head) state, as fp32 mma accumulators for the whole
// sequence, and never waits for another warp. A block is kWarps such warps of
// one (sequence, head): they share the chunk's operands, which the block stages
// in shared memory one or two chunks ahead with cp.async. The launcher sizes
// blocks to the warps each SM must run, so one long sequence with few heads
// spreads over the GPU a warp per block, and many heads share each staged
// chunk among up to eight warps.
//
// Per chunk, per warp (v: its 16 rows; c: the 16 tokens), products in bf16x3
// (mma.cuh), so an fp32 state stays fp32-accurate:
//   U^T = U0^T - S W^T
//   O^T = S Qs^T + U^T Aqk^T       -> out
//   S   = S diag(gl) + U^T Kd
#include <c10/cuda/CUDAException.h>

#include <cstddef>
#include <string>

#include "cuda/device_utils.cuh"
#include "cuda/launch.h"
#include "cuda/mma.cuh"

namespace kda::cuda {
namespace {

constexpr int C = kChunk;
constexpr int D = kHeadDim;
// Chunks staged ahead: three hide L2 latency behind a warp's step; an
// eight-warp block (one per SM, by registers) steps slowly enough for two.
template <int kWarps>
constexpr int kStages = kWarps == 8 ? 2 : 3;
constexpr int kOutPad = 16 + 8;
static_assert(C == 16, "the fragments below assume 16-token chunks");

// The bf16 planes of a record, in record order (params.h), then Aqk's two: the
// first kWsU0 bytes of a record are copied verbatim.
enum Plane { kQsHi, kQsLo, kWHi, kWLo, kKdHi, kKdLo, kPlanes };
static_assert(kWsW == 2 * kPlaneBytes && kWsKd == 4 * kPlaneBytes && kWsAqk == kPlanes * kPlaneBytes &&
                  kWsU0 == kWsAqk + 2 * kAqkPlaneBytes,
              "the record's bf16 part is contiguous");

template <int kWarps>
struct __align__(16) Stage {
  static constexpr int kCols = 16 * kWarps;  // value channels of the block
  static constexpr int kU0Pad = kCols + 4;   // rows 2t and 2t + 1 apart by 8 banks
  __nv_bfloat16 mat[kPlanes][C * D];         // swizzled planes (plane_index)
  __nv_bfloat16 aqk[2][C * C];
  float u0[C][kU0Pad];
  float gl[D];
};

template <int kWarps>
constexpr size_t smem_bytes() {
  return kStages<kWarps> * sizeof(Stage<kWarps>) + kWarps * C * kOutPad * sizeof(__nv_bfloat16);
}

// Issues the copies of one record into a stage. Every thread's pieces sit at
// fixed offsets from its first, so the fully unrolled loops cost one
// instruction per 16 bytes.
template <int kWarps>
__device__ __forceinline__ void load_stage(Stage<kWarps>& st, const unsigned char* rec, int vcol0, int tid) {
  using St = Stage<kWarps>;
  constexpr int kThreads = 32 * kWarps;
  static_assert(offsetof(St, aqk) == kWsAqk, "mat and aqk are one verbatim copy");
  constexpr int kBf16Pieces = kWsU0 / 16;
  const uint32_t mat = smem_u32(&st.mat[0][0]) + tid * 16;
#pragma unroll
  for (int it = 0; it < kBf16Pieces / kThreads; ++it) {
    cp_async_16(mat + it * kThreads * 16, rec + tid * 16 + it * kThreads * 16);
  }
  constexpr int kRest = kBf16Pieces % kThreads, kDone = kBf16Pieces / kThreads * kThreads;
  if (kRest != 0 && tid < kRest) {
    cp_async_16(mat + kDone * 16, rec + tid * 16 + kDone * 16);
  }
  // U0: the block's kCols columns of 16 rows, kCols / 4 pieces per row; as
  // many pieces in all as twice the threads.
  constexpr int kU0Pieces = St::kCols / 4;
  static_assert(C * kU0Pieces == 2 * kThreads, "two U0 pieces per thread");
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int e = tid + it * kThreads, r = e / kU0Pieces, piece = e % kU0Pieces;
    cp_async_16(smem_u32(&st.u0[r][piece * 4]), rec + kWsU0 + (r * D + vcol0 + piece * 4) * 4);
  }
  if (tid < D / 4) {
    cp_async_16(smem_u32(&st.gl[tid * 4]), rec + kWsGl + tid * 16);
  }
}

// Address of the 16-byte piece (row, piece) of a swizzled plane.
__device__ __forceinline__ const __nv_bfloat16* plane_piece(const __nv_bfloat16* plane, int row, int piece) {
  return plane + row * D + ((piece ^ (row & 7)) << 3);
}

__device__ __forceinline__ void load_state_pair(const void* base, int64_t index, bool fp32, float& x, float& y) {
  if (fp32) {
    const float2 v = *reinterpret_cast<const float2*>(static_cast<const float*>(base) + index);
    x = v.x;
    y = v.y;
  } else {
    const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(static_cast<const __nv_bfloat16*>(base) + index);
    x = __low2float(v);
    y = __high2float(v);
  }
}

__device__ __forceinline__ void store_state_pair(void* base, int64_t index, bool fp32, float x, float y) {
  if (fp32) {
    *reinterpret_cast<float2*>(static_cast<float*>(base) + index) = make_float2(x, y);
  } else {
    *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(base) + index) = __floats2bfloat162_rn(x, y);
  }
}

template <int kWarps>
__global__ void __launch_bounds__(kWarps * 32) recurrence_kernel(const FwdParams p) {
  using St = Stage<kWarps>;
  constexpr int kSt = kStages<kWarps>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  St* stages = reinterpret_cast<St*>(smem_raw);
  auto* out_tile = reinterpret_cast<__nv_bfloat16(*)[C][kOutPad]>(smem_raw + kSt * sizeof(St));

  constexpr int kGroups = D / St::kCols;
  const int64_t H = p.H;
  const int group = blockIdx.x % kGroups;
  const int64_t h = (blockIdx.x / kGroups) % H;
  const int64_t n = blockIdx.x / (kGroups * H);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int vcol0 = group * St::kCols;  // the block's first value channel
  const int vloc = warp * 16;           // the warp's first row within the block
  const int v0 = vcol0 + vloc;
  // ldmatrix: lane l addresses row l % 8 of matrix l / 8.
  const int mi = lane / 8, mr = lane % 8;

  const int64_t seq_bos = seq_offset(p, n), seq_eos = seq_offset(p, n + 1);
  const int64_t c_begin = chunk_offset(p, n);
  const int64_t c_end = min64(chunk_offset(p, n + 1), p.num_slots);
  const int64_t nchunks = c_end > c_begin ? c_end - c_begin : 0;
  // Record of chunk c of this sequence: first + c * stride.
  const unsigned char* first = reinterpret_cast<const unsigned char*>(p.workspace) + (c_begin * H + h) * kWsChunkBytes;
  const int64_t stride = H * kWsChunkBytes;

#pragma unroll
  for (int s = 0; s < kSt - 1; ++s) {
    if (s < nchunks) {
      load_stage<kWarps>(stages[s], first + s * stride, vcol0, tid);
    }
    cp_async_commit();
  }

  // s[j][e]: state rows v0 + g (e = 0, 1) and v0 + g + 8 (e = 2, 3), key
  // columns 8j + 2t (e even) and 8j + 2t + 1 (e odd); [n, h, v, k] layout.
  const int64_t row_g = ((n * H + h) * D + v0 + g) * D;
  const int64_t row_g8 = row_g + 8 * D;
  float s[16][4];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int k0 = 8 * j + 2 * t;
    if (p.initial_state != nullptr) {
      load_state_pair(p.initial_state, row_g + k0, p.state_fp32, s[j][0], s[j][1]);
      load_state_pair(p.initial_state, row_g8 + k0, p.state_fp32, s[j][2], s[j][3]);
    } else {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    }
  }

  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);
  for (int64_t c = 0; c < nchunks; ++c) {
    if (c + kSt - 1 < nchunks) {
      load_stage<kWarps>(stages[(c + kSt - 1) % kSt], first + (c + kSt - 1) * stride, vcol0, tid);
    }
    cp_async_commit();
    cp_async_wait<kSt - 1>();
    __syncthreads();
    const St& st = stages[c % kSt];

    // S W^T and S Qs^T over the 128 key columns, 16 at a time; each of the
    // three bf16x3 terms has its own accumulators, so no mma waits on the
    // previous one's result for more than 8 steps.
    float acc_w[3][2][4] = {}, acc_o[3][2][4] = {};
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      uint32_t a_hi[4], a_lo[4];
      split_pack(s[2 * kk][0], s[2 * kk][1], a_hi[0], a_lo[0]);
      split_pack(s[2 * kk][2], s[2 * kk][3], a_hi[1], a_lo[1]);
      split_pack(s[2 * kk + 1][0], s[2 * kk + 1][1], a_hi[2], a_lo[2]);
      split_pack(s[2 * kk + 1][2], s[2 * kk + 1][3], a_hi[3], a_lo[3]);
      // Matrices: tokens 0-7 | 8-15 (n-tiles) x key columns 16kk.. | 16kk+8..
      const int row = (mi / 2) * 8 + mr, piece = 2 * kk + mi % 2;
      uint32_t wh[4], wl[4], qh[4], ql[4];
      ldmatrix_x4(wh, plane_piece(st.mat[kWHi], row, piece));
      ldmatrix_x4(wl, plane_piece(st.mat[kWLo], row, piece));
      ldmatrix_x4(qh, plane_piece(st.mat[kQsHi], row, piece));
      ldmatrix_x4(ql, plane_piece(st.mat[kQsLo], row, piece));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_bf16(acc_w[0][nt], a_lo, wh[2 * nt], wh[2 * nt + 1]);
        mma_bf16(acc_w[1][nt], a_hi, wl[2 * nt], wl[2 * nt + 1]);
        mma_bf16(acc_w[2][nt], a_hi, wh[2 * nt], wh[2 * nt + 1]);
        mma_bf16(acc_o[0][nt], a_lo, qh[2 * nt], qh[2 * nt + 1]);
        mma_bf16(acc_o[1][nt], a_hi, ql[2 * nt], ql[2 * nt + 1]);
        mma_bf16(acc_o[2][nt], a_hi, qh[2 * nt], qh[2 * nt + 1]);
      }
    }
    float sw[2][4], so[2][4];  // the small terms first, as mma_bf16x3 sums them
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sw[nt][e] = (acc_w[0][nt][e] + acc_w[1][nt][e]) + acc_w[2][nt][e];
        so[nt][e] = (acc_o[0][nt][e] + acc_o[1][nt][e]) + acc_o[2][nt][e];
      }
    }

    // U^T = U0^T - S W^T; as an A operand its two n-tiles are the 16 tokens.
    float u[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int i0 = 8 * nt + 2 * t;
      u[nt][0] = st.u0[i0][vloc + g] - sw[nt][0];
      u[nt][1] = st.u0[i0 + 1][vloc + g] - sw[nt][1];
      u[nt][2] = st.u0[i0][vloc + g + 8] - sw[nt][2];
      u[nt][3] = st.u0[i0 + 1][vloc + g + 8] - sw[nt][3];
    }
    uint32_t ua_hi[4], ua_lo[4];
    split_pack(u[0][0], u[0][1], ua_hi[0], ua_lo[0]);
    split_pack(u[0][2], u[0][3], ua_hi[1], ua_lo[1]);
    split_pack(u[1][0], u[1][1], ua_hi[2], ua_lo[2]);
    split_pack(u[1][2], u[1][3], ua_hi[3], ua_lo[3]);

    // O^T += U^T Aqk^T: Aqk stored [i][j] is Aqk^T's B fragment as it stands.
    {
      const int row = (mi / 2) * 8 + mr, col = (mi % 2) * 8;
      uint32_t ah[4], al[4];
      ldmatrix_x4(ah, &st.aqk[0][row * C + col]);
      ldmatrix_x4(al, &st.aqk[1][row * C + col]);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_bf16x3(so[nt], ua_hi, ua_lo, ah[2 * nt], ah[2 * nt + 1], al[2 * nt], al[2 * nt + 1]);
      }
    }

    // Out through a per-warp tile, so that each token row leaves as two 16-byte stores.
    const int64_t bos = seq_bos + c * C;
    const int len = static_cast<int>(min64(C, seq_eos - bos));
    auto& tile = out_tile[warp];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int i0 = 8 * nt + 2 * t;
      tile[i0][g] = __float2bfloat16_rn(so[nt][0]);
      tile[i0 + 1][g] = __float2bfloat16_rn(so[nt][1]);
      tile[i0][g + 8] = __float2bfloat16_rn(so[nt][2]);
      tile[i0 + 1][g + 8] = __float2bfloat16_rn(so[nt][3]);
    }
    __syncwarp();
    {
      const int i = lane / 2, half = lane % 2;
      if (i < len) {
        *reinterpret_cast<uint4*>(out + ((bos + i) * H + h) * D + v0 + 8 * half) =
            *reinterpret_cast<const uint4*>(&tile[i][8 * half]);
      }
    }

    // S <- S diag(gl) + U^T Kd; ldmatrix.trans turns Kd's rows (tokens) into the k dimension.
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 decay = *reinterpret_cast<const float2*>(&st.gl[8 * j + 2 * t]);
      s[j][0] *= decay.x;
      s[j][1] *= decay.y;
      s[j][2] *= decay.x;
      s[j][3] *= decay.y;
    }
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      // Matrices: tokens 0-7 | 8-15 (k dimension) x key columns 16jj.. | 16jj+8.. (n-tiles)
      const int row = (mi % 2) * 8 + mr, piece = 2 * jj + mi / 2;
      uint32_t kh[4], kl[4];
      ldmatrix_x4_trans(kh, plane_piece(st.mat[kKdHi], row, piece));
      ldmatrix_x4_trans(kl, plane_piece(st.mat[kKdLo], row, piece));
      mma_bf16x3(s[2 * jj], ua_hi, ua_lo, kh[0], kh[1], kl[0], kl[1]);
      mma_bf16x3(s[2 * jj + 1], ua_hi, ua_lo, kh[2], kh[3], kl[2], kl[3]);
    }
    __syncthreads();  // the stage and the out tile are rewritten next iteration
  }

  if (p.final_state != nullptr) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int k0 = 8 * j + 2 * t;
      store_state_pair(p.final_state, row_g + k0, p.state_fp32, s[j][0], s[j][1]);
      store_state_pair(p.final_state, row_g8 + k0, p.state_fp32, s[j][2], s[j][3]);
    }
  }
}

template <int kWarps>
void launch(const FwdParams& p, cudaStream_t stream) {
  constexpr size_t smem = smem_bytes<kWarps>();
  static_assert(smem <= 227 * 1024, "over the per-block shared memory of sm_90");
  auto* kernel = recurrence_kernel<kWarps>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t blocks = p.N * p.H * (D / (16 * kWarps));
  TORCH_CHECK(blocks <= INT32_MAX, "kda.fwd: ", std::to_string(p.N), " sequences x ", std::to_string(p.H),
              " heads is more blocks than one launch takes");
  kernel<<<static_cast<unsigned int>(blocks), kWarps * 32, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_recurrence(const FwdParams& p, cudaStream_t stream) {
  if (p.N == 0 || p.H == 0) {
    return;
  }
  // An SM runs at most eight of these warps at once (registers), and a step
  // takes as long as its busiest SM: the warps per block are the warps per SM
  // the problem needs (8 per head over the SMs, rounded up to a power of two),
  // so that blocks share staged chunks as widely as the balance allows.
  const int64_t warps_per_sm = (p.N * p.H * (D / 16) + p.num_sms - 1) / p.num_sms;
  if (warps_per_sm > 4) {
    launch<8>(p, stream);
  } else if (warps_per_sm > 2) {
    launch<4>(p, stream);
  } else if (warps_per_sm > 1) {
    launch<2>(p, stream);
  } else {
    launch<1>(p, stream);
  }
}

}  // namespace kda::cuda
