// Small device helpers shared by the forward and backward kernels.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/params.h"

namespace kda::cuda {

// Where a value head's q and k rows are (grouped value heads, FwdParams::group):
// value head h reads query/key head h / group, of H / group. A kernel takes
// its place once, not per token, and with no division where group is 1: a
// division takes tens of instructions, and the decode kernel's time is a chain
// of latencies a block (docs/performance-notes.md, "Head sizes below 128 and
// grouped value heads").
struct QkPlace {
  int64_t heads;  // H / group
  int head;       // h / group
};

__device__ __forceinline__ QkPlace qk_place(const FwdParams& p, int h) {
  if (p.group == 1) {
    return {p.H, h};
  }
  const int group = static_cast<int>(p.group);
  return {static_cast<int>(p.H) / group, h / group};
}

// Where the head's q or k row (of D channels) starts at token t.
template <int D>
__device__ __forceinline__ int64_t qk_row(const QkPlace& x, int64_t t) {
  return (t * x.heads + x.head) * D;
}

__device__ __forceinline__ float load_bf16(const void* base, int64_t index) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
}

__device__ __forceinline__ float load_state(const void* base, int64_t index, bool fp32) {
  return fp32 ? static_cast<const float*>(base)[index] : load_bf16(base, index);
}

__device__ __forceinline__ void store_state(void* base, int64_t index, float value, bool fp32) {
  if (fp32) {
    static_cast<float*>(base)[index] = value;
  } else {
    static_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn(value);
  }
}

// Position of element (row, col) in a swizzled plane of D-wide rows (the
// backward's own tiles; a record's planes: record_index).
template <int D>
__device__ __forceinline__ int plane_index(int row, int col) {
  return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// A record's [16][D] planes (params.h) in blocks of 64 columns, each [16][64]
// with 128-byte rows whose 16-byte piece j sits at j ^ (row % 8): the
// 128-byte swizzle of wgmma's shared-memory operands, which ldmatrix reads
// without bank conflicts too. Position of element (row, col):
__device__ __forceinline__ int record_index(int row, int col) {
  return (col >> 6) * (kChunk * 64) + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7);
}

// Element offset of the 16-byte piece (row, piece) of a record plane (piece < D / 8).
__device__ __forceinline__ int record_piece_index(int row, int piece) {
  return (piece >> 3) * (kChunk * 64) + row * 64 + (((piece & 7) ^ (row & 7)) << 3);
}

// Address of that piece, for ldmatrix.
__device__ __forceinline__ const __nv_bfloat16* record_piece(const __nv_bfloat16* plane, int row, int piece) {
  return plane + record_piece_index(row, piece);
}

// Address of the 16-byte piece (row, piece) of a swizzled plane of D-wide
// rows (any number of rows), for ldmatrix.
template <int D>
__device__ __forceinline__ const __nv_bfloat16* plane_piece(const __nv_bfloat16* plane, int row, int piece) {
  return plane + row * D + ((piece ^ (row & 7)) << 3);
}

// x as hi = bf16(x) in the plane at `planes` and, with `lo`, lo = bf16(x - hi)
// in the plane `lo_bytes` after it (see the workspace layout in params.h).
__device__ __forceinline__ void store_split(unsigned char* planes, int lo_bytes, int index, float x, bool lo = true) {
  const __nv_bfloat16 hi = __float2bfloat16_rn(x);
  reinterpret_cast<__nv_bfloat16*>(planes)[index] = hi;
  if (lo) {
    reinterpret_cast<__nv_bfloat16*>(planes + lo_bytes)[index] = __float2bfloat16_rn(x - __bfloat162float(hi));
  }
}

// 2^x and 1 / x in one special-function instruction each (max relative error
// about 2^-22 and 1 ulp; subnormal results flush to zero). expf and
// __fdividef cost 9 and 5 instructions with their range fix-ups, which K1 and
// its backward ran ~100 times per thread and chunk; every value they take
// there is well inside the normal range (|G| <= 16 x 5 = 80 nats within a
// chunk, as lower_bound >= -5).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The bounded gate's log decay in base 2, lower_bound sigmoid(A (g + dt_bias))
// log2(e), as lb2 / (1 + 2^(a2 g + b2)) with a2 = -A log2(e), b2 = a2 dt_bias
// and lb2 = lower_bound log2(e), which callers form once a head.
__device__ __forceinline__ float bounded_lam2(float g, float a2, float b2, float lb2) {
  return lb2 * fast_rcp(1.f + fast_exp2(fmaf(a2, g, b2)));
}

// The softplus gate's log decay in base 2, -A softplus(x) log2(e), for any
// finite x: softplus(x) log2(e) = max(x, 0) log2(e) + log2(1 + 2^(-|x| log2(e))),
// the last term by its series where 1 + e would round e's bits away. Zero
// where softplus underflows and at least -1e30 (whose 2^ is zero as well), so
// that an A beyond fp32's range (A_log > 88.7, which the ops reject where they
// can check it) gives neither NaN nor an infinity that a split into bf16 parts
// would turn into NaN.
__device__ __forceinline__ float softplus_lam2(float x, float A) {
  const float e = fast_exp2(-fabsf(x) * kLog2e);
  const float l = e < 0.015625f ? e * (kLog2e - e * (0.5f * kLog2e - e * (kLog2e / 3.f))) : __log2f(1.f + e);
  const float sp2 = fmaf(fmaxf(x, 0.f), kLog2e, l);
  return sp2 > 0.f ? fmaxf(-A * sp2, -1e30f) : 0.f;
}

// Element i of an int32 or int64 tensor (cu_seqlens, slot indices), as int64.
__device__ __forceinline__ int64_t load_int(const void* base, bool int32, int64_t i) {
  return int32 ? static_cast<int64_t>(static_cast<const int32_t*>(base)[i]) : static_cast<const int64_t*>(base)[i];
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// Sequence and chunk boundaries (params.h): from the offset tensors, or by
// arithmetic for a fixed-length batch.
__device__ __forceinline__ int64_t seq_offset(const FwdParams& p, int64_t n) {
  return p.seq_offsets != nullptr ? p.seq_offsets[n] : n * p.T;
}

// The sequence that the recurrences' b-th group of blocks serves (params.h).
__device__ __forceinline__ int64_t sequence_of_block_group(const FwdParams& p, int64_t b) {
  return p.seq_order != nullptr ? p.seq_order[b] : b;
}

__device__ __forceinline__ int64_t chunk_offset(const FwdParams& p, int64_t n) {
  return p.chunk_offsets != nullptr ? p.chunk_offsets[n] : n * ((p.T + kChunk - 1) / kChunk);
}

// Sequence n's part of a launch's window of chunk slots [slot_begin,
// slot_end): its chunks [lo, hi) (none where hi <= lo), and whether its state
// starts in this window (where the sequence starts; an empty sequence: where its
// offset falls, the last window for one at the very end) and ends in it (where
// it ends, or the last window). K2 carries the state through the parts forward,
// the backward's dS recurrence carries dS through them backward.
struct WindowPart {
  int64_t c_begin = 0;  // the sequence's first chunk slot
  int64_t lo = 0, hi = 0;
  bool starts_here = false, ends_here = false;
  __device__ __forceinline__ int64_t chunks() const { return hi > lo ? hi - lo : 0; }
};

__device__ __forceinline__ WindowPart window_part(const FwdParams& p, int64_t n) {
  WindowPart w;
  w.c_begin = chunk_offset(p, n);
  const int64_t c_end = min64(chunk_offset(p, n + 1), p.num_slots);
  const bool last_window = p.slot_end >= p.num_slots;
  w.starts_here = w.c_begin >= p.slot_begin && (w.c_begin < p.slot_end || last_window);
  w.ends_here = c_end <= p.slot_end || last_window;
  w.lo = w.c_begin > p.slot_begin ? w.c_begin : p.slot_begin;
  w.hi = min64(c_end, p.slot_end);
  return w;
}

// The sequence that owns chunk slot `slot` < chunk_offset(p, N): the largest n
// with chunk_offset(p, n) <= slot (offsets are non-decreasing; empty sequences
// share an offset with the next one, and the largest index skips them).
__device__ __forceinline__ int64_t sequence_of_slot(const FwdParams& p, int64_t slot) {
  if (p.chunk_offsets == nullptr) {
    return slot / ((p.T + kChunk - 1) / kChunk);
  }
  int64_t lo = 0, hi = p.N;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (p.chunk_offsets[mid] <= slot) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace kda::cuda
