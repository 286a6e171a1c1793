// Warp-level tensor-core and asynchronous-copy primitives (sm_80+ PTX, used on
// sm_90a), and the bf16 hi/lo split that lets bf16 products keep fp32-level
// accuracy. Fragment layouts are those of mma.m16n8k16 in the PTX ISA; with
// g = lane / 4 and t = lane % 4:
//   A (16 x 16, row major), 4 x b32: (g, 2t..2t+1) (g+8, 2t..) (g, 2t+8..) (g+8, 2t+8..)
//   B (16 x 8, k by n), 2 x b32:     (k 2t..2t+1, n g) (k 2t+8.., n g)
//   C (16 x 8, fp32), 4 floats:      (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1)
// An accumulator pair of n-tiles (columns 8j..8j+15) is therefore already the
// A fragment of a product over those 16 columns.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace kda::cuda {

// d += a * b, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d = a * b: the zero accumulator is the C operand RZ, where zeroing four
// registers first costs four instructions (a tenth of K2's per-chunk count).
__device__ __forceinline__ void mma_bf16_zero(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%10,%10,%10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}

// d = a * b when `zero` (a constant once loops are unrolled), else d += a * b.
__device__ __forceinline__ void mma_bf16_into(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                              bool zero) {
  if (zero) {
    mma_bf16_zero(d, a, b0, b1);
  } else {
    mma_bf16(d, a, b0, b1);
  }
}

// d += (a_hi + a_lo) * (b_hi + b_lo) without the lo * lo term (below fp32's
// rounding of the sum).
__device__ __forceinline__ void mma_bf16x3(float (&d)[4], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                          uint32_t b_hi0, uint32_t b_hi1, uint32_t b_lo0, uint32_t b_lo1) {
  mma_bf16(d, a_lo, b_hi0, b_hi1);
  mma_bf16(d, a_hi, b_lo0, b_lo1);
  mma_bf16(d, a_hi, b_hi0, b_hi1);
}

// The same into a zero accumulator: d = (a_hi + a_lo) * (b_hi + b_lo).
__device__ __forceinline__ void mma_bf16x3_zero(float (&d)[4], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                               uint32_t b_hi0, uint32_t b_hi1, uint32_t b_lo0, uint32_t b_lo1) {
  mma_bf16_zero(d, a_lo, b_hi0, b_hi1);
  mma_bf16(d, a_hi, b_lo0, b_lo1);
  mma_bf16(d, a_hi, b_hi0, b_hi1);
}

// Four 8x8 bf16 matrices from shared memory; lanes 8i..8i+7 give the row
// addresses of matrix i, register i receives matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The same, each matrix transposed on the way (rows in memory become columns).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// U0^T = v^T M^T for 16 value rows and the chunk's 16 tokens, the two C tiles
// of tokens 0-7 and 8-15: v_row is this lane's ldmatrix row of v [t][v] (token
// (l / 16) * 8 + l % 8, value columns + (l / 8 % 2) * 8 of the 16), which
// ldmatrix.trans turns into v^T's A fragment (v is exact in bf16); m_hi and
// m_lo are the lane's rows of M [i][j] (row (l / 16) * 8 + l % 8, columns
// (l / 8 % 2) * 8), M^T's B fragments as they stand. The small term first.
__device__ __forceinline__ void form_u0_tiles(const void* v_row, const void* m_hi, const void* m_lo,
                                              float (&dst)[2][4]) {
  uint32_t va[4], mh[4], ml[4];
  ldmatrix_x4_trans(va, v_row);
  ldmatrix_x4(mh, m_hi);
  ldmatrix_x4(ml, m_lo);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    mma_bf16_zero(dst[nt], va, ml[2 * nt], ml[2 * nt + 1]);
    mma_bf16(dst[nt], va, mh[2 * nt], mh[2 * nt + 1]);
  }
}

// The inverse of ldmatrix_x4: register i of each lane (its row g, columns
// 2t..2t+1 of matrix i) to the rows whose addresses lanes 8i..8i+7 give (sm_90).
__device__ __forceinline__ void stmatrix_x4(void* smem_row, const uint32_t (&r)[4]) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}

// Two 8x8 bf16 matrices: lanes 8i..8i+7 give the row addresses of matrix i
// (lanes 16-31 too, unread).
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem_row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// (x, y) -> the packed bf16 pairs hi = (bf16(x), bf16(y)) and lo = the remainders
// (x in the low halves), rounded to nearest. The hi halves go back to floats by a
// shift and a mask: six instructions, where the bf16x2 intrinsics compiled to
// eight (two byte permutes more), and K2 splits 12 to 36 pairs a step.
__device__ __forceinline__ uint32_t pack_bf16x2_rn(float x, float y) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(y), "f"(x));
  return r;
}

// The same bf16 values (an infinity becomes the largest finite bf16) by an
// instruction that ptxas does not merge with pack_bf16x2_rn of the same inputs:
// for a store of values that are split again later (merged, the packs stay live
// in between).
__device__ __forceinline__ uint32_t pack_bf16x2_satfinite(float x, float y) {
  uint32_t r;
  asm volatile("cvt.rn.satfinite.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(y), "f"(x));
  return r;
}

// One row's bf16 pairs of two adjacent accumulator n-tiles (columns 2t, 2t + 1
// and 8 + 2t, 9 + 2t of 16) as one 8-byte piece per lane: lanes t and t ^ 1
// swap a pair, so that each lane holds four consecutive columns, from
// quad_piece_column(t). A quad then writes each 32-byte sector of the row whole
// in one store, where two 4-byte stores per lane wrote it in halves.
__device__ __forceinline__ uint2 quad_piece(uint32_t lo_tile, uint32_t hi_tile, bool odd) {
  const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? lo_tile : hi_tile, 1);
  return odd ? make_uint2(got, hi_tile) : make_uint2(lo_tile, got);
}

__device__ __forceinline__ int quad_piece_column(int t) {
  return 2 * t + (t & 1) * 6;
}

// The low and high bf16 of a packed pair, as floats.
__device__ __forceinline__ float lo_half(uint32_t x) {
  return __uint_as_float(x << 16);
}

__device__ __forceinline__ float hi_half(uint32_t x) {
  return __uint_as_float(x & 0xffff0000u);
}

__device__ __forceinline__ void split_pack(float x, float y, uint32_t& hi, uint32_t& lo) {
  hi = pack_bf16x2_rn(x, y);
  const float hx = lo_half(hi), hy = hi_half(hi);
  lo = pack_bf16x2_rn(x - hx, y - hy);
}

// Rows g and g + 8 of two adjacent accumulator n-tiles (C fragments a, b) in
// bf16, one 8-byte store per lane and row (quad_piece): `row_g` is row g's
// element at column quad_piece_column(t) of the tiles' 16, the rows `pitch`
// elements apart. kSatfinite: packed by pack_bf16x2_satfinite (values that are
// split again later), else pack_bf16x2_rn.
template <bool kSatfinite>
__device__ __forceinline__ void store_tile_pair_bf16(__nv_bfloat16* row_g, int pitch, const float (&a)[4],
                                                     const float (&b)[4], bool odd) {
  auto pack = [](float x, float y) { return kSatfinite ? pack_bf16x2_satfinite(x, y) : pack_bf16x2_rn(x, y); };
  *reinterpret_cast<uint2*>(row_g) = quad_piece(pack(a[0], a[1]), pack(b[0], b[1]), odd);
  *reinterpret_cast<uint2*>(row_g + 8 * pitch) = quad_piece(pack(a[2], a[3]), pack(b[2], b[3]), odd);
}

__device__ __forceinline__ uint32_t smem_u32(const void* smem_ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
}

// 16 bytes global -> shared without passing through registers. The shared
// address is a 32-bit shared-window address (smem_u32), so that unrolled loops
// fold their offsets into the instruction.
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_dst), "l"(gmem_src));
}

// The same, or 16 zero bytes where !valid (src is then not read).
__device__ __forceinline__ void cp_async_16_or_zero(uint32_t smem_dst, const void* gmem_src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}

// Waits until at most `kPending` of this thread's committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Bulk copy shared -> global by the copy engine (sm_90): `bytes` a multiple of
// 16, both addresses 16-byte aligned. The shared writes it copies must be made
// visible to it first (fence_proxy_async_shared by the threads that wrote them,
// then a barrier), and the shared memory must not be released or rewritten
// before bulk_commit_and_wait_read returns.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void bulk_store(void* gmem_dst, uint32_t smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(gmem_dst), "r"(smem_src),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit_and_wait_read() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

}  // namespace kda::cuda
