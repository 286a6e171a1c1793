// Constants shared by the host code and the CUDA kernels (no ATen here, so the
// .cu files can include it cheaply).
#pragma once

namespace kda {

// Epsilon inside the L2 norm of q and k: x / sqrt(sum(x^2) + kNormEps) (as the model defines it).
constexpr double kNormEps = 1e-6;

}  // namespace kda
