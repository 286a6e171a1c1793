// Warpgroup tensor-core products of sm_90a (wgmma.mma_async): four warps
// multiply together, A from each warp's registers in mma.cuh's fragment layout
// (the warp's 16 rows), B straight from shared memory through a matrix
// descriptor, the accumulators in each warp's registers as mma.cuh's C
// fragments of consecutive 8-column n-tiles. The products run asynchronously:
// wgmma_commit closes a group, wgmma_wait<0> waits for every group, and the
// accumulators must not be read (nor their A registers changed) before it.
#pragma once

#include <cstdint>

namespace kda::cuda {

// A bf16 operand in shared memory in the 128-byte swizzle (128-byte rows whose
// 16-byte piece j of row r sits at j ^ (r % 8), 1024-byte aligned groups of 8
// rows): start address, leading and stride byte offsets (bits 0-13, 16-29,
// 32-45, each >> 4), swizzle mode 1 in bits 62-63. Operands at fixed offsets
// from one another differ only in the start address: sw128_desc_at adds a byte
// offset to it (no carry out of its 14 bits while the address stays below
// 256 KB), so that a step's descriptors cost one integer add each.
struct Sw128Desc {
  uint32_t lo, hi;
};

__device__ __forceinline__ Sw128Desc sw128_desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  return {((smem_addr & 0x3FFFFu) >> 4) | ((lbo >> 4) << 16), (sbo >> 4) | (1u << 30)};
}

__device__ __forceinline__ uint64_t sw128_desc_at(Sw128Desc d, uint32_t offset_bytes) {
  return (static_cast<uint64_t>(d.hi) << 32) | (d.lo + (offset_bytes >> 4));
}

// Orders this thread's earlier register writes (A operands, accumulators)
// before the products issued next.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving reads of x above the wait before it.
__device__ __forceinline__ void fence_operand(float& x) {
  asm volatile("" : "+f"(x)::"memory");
}

// d (+)= a * B for a 64 x 16 x 16 product: B (k = 16, n = 16) K-major (each
// n's 16 k contiguous) at `desc`; without `accumulate` d = a * B.
__device__ __forceinline__ void wgmma_m64n16k16(float (&d)[2][4], const uint32_t (&a)[4], uint64_t desc,
                                               bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(static_cast<int>(accumulate)));
}

// d (+)= a * B for a 64 x 32 x 16 product, B K-major at `desc` (4 n-tiles of 8).
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[4][4], const uint32_t (&a)[4], uint64_t desc,
                                               bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(static_cast<int>(accumulate)));
}

// d (+)= a * B for a 64 x 128 x 16 product: B (k = 16, n = 128) MN-major (each
// k's 128 n contiguous, as two 64-wide swizzle atoms) at `desc`.
__device__ __forceinline__ void wgmma_m64n128k16_mn(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc,
                                                   bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(static_cast<int>(accumulate)));
}

}  // namespace kda::cuda
