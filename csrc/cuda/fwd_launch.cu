// Forward launcher. The kernels (K1: token-parallel prepare, K2: chunked
// recurrence) are not in this build yet, so the launcher refuses clearly
// instead of returning unwritten outputs.
#include <c10/util/Exception.h>

#include "cuda/launch.h"

namespace kda::cuda {

void launch_forward(FwdParams params, cudaStream_t stream) {
  (void)stream;
  TORCH_CHECK_NOT_IMPLEMENTED(
      false,
      "kda.fwd: the CUDA forward kernels are not implemented yet in this version of torch_kda (asked for B = ",
      params.B, ", T = ", params.T, ", H = ", params.H, "); run the op on CPU tensors for now");
}

}  // namespace kda::cuda
