// Two blocks that share a (chunk slot, head) at head size 256, where one block
// would not fit an SM (the record gradients, which split the value rows) or
// would run alone on it (K1's backward, which splits the key channels): a
// cluster of two, whose blocks meet at cluster barriers and read each other's
// shared memory.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <string>

#include "cuda/params.h"

namespace kda::cuda {

// blocks_of_head_size (params.h) as a constant of the kernels' head size.
template <int D>
constexpr int kBlocksOf = blocks_of_head_size(D);
template <int D>
constexpr bool kPairOf = kBlocksOf<D> > 1;

// The pair meets: every write of one block's shared memory by the other (or
// by itself, for the other to read) before it is visible after it (the
// cluster barrier's release and acquire, which ptxas implements as a GPU-wide
// memory barrier: it waits for the thread's global stores too).
__device__ __forceinline__ void pair_sync() {
  cooperative_groups::this_cluster().sync();
}

// The same without ordering memory: both blocks run after it (a block's shared
// memory may be written by the other only then), while the loads issued
// before it stay in flight.
__device__ __forceinline__ void pair_start() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}

// The last reads of the partner's shared memory are done (pair_arrive, by
// every thread) before either block may exit (pair_wait): the stores between
// the two go on meanwhile.
__device__ __forceinline__ void pair_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void pair_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

__device__ __forceinline__ unsigned pair_rank() {
  return cooperative_groups::this_cluster().block_rank();
}

// The partner block's copy of a shared array (distributed shared memory).
template <typename T>
__device__ __forceinline__ T* partner_of(T* local) {
  auto cluster = cooperative_groups::this_cluster();
  return cluster.map_shared_rank(local, cluster.block_rank() ^ 1u);
}

// Launches kernel for the (chunk slot, head)s of f's window, `parts` blocks
// each (two: a pair, as a cluster), each with `smem` bytes of dynamic shared
// memory and the largest carveout, so that several blocks fit an SM.
template <typename Args>
void launch_chunk_heads(void (*kernel)(Args), const Args& args, const FwdParams& f, int parts, unsigned int threads,
                        size_t smem, cudaStream_t stream) {
  const int64_t units = (f.slot_end - f.slot_begin) * f.H;
  TORCH_CHECK(units <= INT32_MAX / parts, "kda.bwd: ", std::to_string(f.slot_end - f.slot_begin), " chunks x ",
              std::to_string(f.H), " heads is more blocks than one launch takes");
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  const auto grid = static_cast<unsigned int>(units * parts);
  if (parts == 1) {
    kernel<<<grid, threads, smem, stream>>>(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute cluster = {};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 2;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args));
}

}  // namespace kda::cuda
