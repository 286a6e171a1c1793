#include "cuda/padded_heads.h"

#include <ATen/ops/empty.h>

#include <vector>

#include "cuda/params.h"

namespace kda::cuda {

bool pads_heads(const Problem& p, int64_t D) {
  return concrete(p.K) != D || concrete(p.V) != D;
}

at::Tensor padded_to(const at::Tensor& t, std::initializer_list<int64_t> sizes) {
  const int64_t first = t.dim() - static_cast<int64_t>(sizes.size());
  std::vector<int64_t> shape = t.sizes().vec();
  bool any = false;
  int64_t dim = first;
  for (int64_t size : sizes) {
    TORCH_INTERNAL_ASSERT(size >= shape[dim], "padded_to pads, it does not crop");
    any = any || shape[dim] != size;
    shape[dim++] = size;
  }
  if (!any) {
    return t;
  }
  // Every byte written once: the zero margins, then t into the leading block
  // (constant_pad_nd fills the whole output first and then copies t over it,
  // 1.5x the writes at half padding). The margin of each padded dimension
  // spans the leading block of the ones before it.
  at::Tensor out = at::empty(shape, t.options()), block = out;
  for (dim = first; dim < t.dim(); ++dim) {
    const int64_t kept = t.size(dim);
    if (kept < shape[dim]) {
      block.narrow(dim, kept, shape[dim] - kept).zero_();
    }
    block = block.narrow(dim, 0, kept);
  }
  block.copy_(t);
  return out;
}

at::Tensor leading_block(const at::Tensor& t, std::initializer_list<int64_t> sizes) {
  at::Tensor b = t;
  int64_t dim = t.dim() - static_cast<int64_t>(sizes.size());
  for (int64_t size : sizes) {
    b = b.narrow(dim++, 0, size);
  }
  return b.contiguous();
}

PaddedInputs padded_inputs(const Problem& p, int64_t D, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& g, const at::Tensor& dt_bias,
                           const std::optional<at::Tensor>& initial_state) {
  TORCH_INTERNAL_ASSERT(concrete(p.K) <= D && concrete(p.V) <= D, "padding to ", std::to_string(D), " would crop");
  const int64_t K = D, V = D;
  PaddedInputs x;
  x.p = p;
  x.p.K = K;
  x.p.V = V;
  x.p.scale = resolved_scale(p);  // the default 1 / sqrt(K) of the caller's K
  x.q = padded_to(q, {K});
  x.k = padded_to(k, {K});
  x.v = padded_to(v, {V});
  x.g = padded_to(g, {K});
  x.dt_bias = dt_bias.defined() ? padded_to(dt_bias, {K}) : dt_bias;
  if (initial_state.has_value()) {
    x.initial_state = padded_to(*initial_state, {V, K});
  }
  return x;
}

}  // namespace kda::cuda
