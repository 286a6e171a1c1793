// Head sizes the kernels have no instances for, served by zero padding: K and
// V run on the kernels of one served size D (the chunked kernels':
// chunked_head_size in constants.h; the decode kernel's: 128)
// over zero-padded copies of the inputs, and the outputs are the leading block
// of the padded ones.
//
// Zero channels are inert. A zero key and query channel adds nothing to the
// rows' L2 norms or to any product over channels, so the state's column for it
// stays what it started as (zero: the padded initial state), whatever that
// channel's decay; a zero value channel gives a zero row of the state and of
// out. The gradients that reach the real channels are therefore those of the
// unpadded problem, and those of the padding are dropped.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>
#include <optional>

#include "kda.h"

namespace kda::cuda {

// Whether p's K or V is served by padding to D.
bool pads_heads(const Problem& p, int64_t D);

// The inputs at head size D (at least p's K and V): q, k, g padded to D, v to
// D, dt_bias [H, D] and the initial state [N, H, D, D] (zeros added), and p
// with those sizes and with the scale resolved from its own K.
struct PaddedInputs {
  Problem p;
  at::Tensor q, k, v, g, dt_bias;
  std::optional<at::Tensor> initial_state;
};
PaddedInputs padded_inputs(const Problem& p, int64_t D, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& g, const at::Tensor& dt_bias,
                           const std::optional<at::Tensor>& initial_state);

// t with its trailing dimensions zero-padded to `sizes` (t itself where they match).
at::Tensor padded_to(const at::Tensor& t, std::initializer_list<int64_t> sizes);

// The leading block of t's trailing dimensions of `sizes`, contiguous (a copy).
at::Tensor leading_block(const at::Tensor& t, std::initializer_list<int64_t> sizes);

}  // namespace kda::cuda
