// Launchers of the CUDA kernels (defined in the .cu files of this folder).
// Each takes the params by value and enqueues on the given stream; scratch
// memory comes from PyTorch's caching allocator.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/params.h"

namespace kda::cuda {

void launch_forward(FwdParams params, cudaStream_t stream);

}  // namespace kda::cuda
