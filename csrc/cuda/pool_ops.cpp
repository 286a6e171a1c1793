// kda::fwd_pool_ on CUDA, and the decode path of kda::fwd_ (forward_call.h):
// the host side of serving from a state pool (pool.cu has the kernels).
#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "cuda/forward_call.h"
#include "cuda/heuristics.h"
#include "cuda/launch.h"
#include "cuda/padded_heads.h"
#include "cuda/staging.h"
#include "kda.h"

namespace kda::cuda {

using at::Tensor;
using std::optional;

void decode_forward(const FwdParams& params, const Tensor& initial_state, const Tensor& final_state, bool state_fp32,
                    cudaStream_t stream) {
  PoolParams pp;
  pp.fwd = params;
  pp.pool = final_state.defined() ? final_state.data_ptr() : nullptr;
  pp.pool_stride = params.H * kHeadDim * kHeadDim;
  pp.slots = params.N;
  pp.pool_fp32 = state_fp32;
  pp.start = initial_state.defined() ? initial_state.data_ptr() : nullptr;
  pp.zero_start = !initial_state.defined();
  launch_pool_decode(pp, stream);
}

namespace {

// Speculative decoding runs only on the decode kernel, 128 wide: K and V at most 128.
void check_speculative_head_sizes(const char* op, const Problem& p) {
  const int64_t K = concrete(p.K), V = concrete(p.V);
  const auto message = [&](const char* what, const char* name, int64_t size) {
    return std::string(op) + ": on CUDA, speculative decoding (num_accepted_tokens) from the state pool takes " +
           what + " with a head size " + name + " (dim 3) of at most " + int_str(kHeadDim) + ", got " + name +
           " = " + int_str(size) + " (the pool without num_accepted_tokens takes up to " + int_str(kMaxHeadSize) +
           "; the CPU kernels any)";
  };
  TORCH_CHECK(K <= kHeadDim, message("q and k", "K", K));
  TORCH_CHECK(V <= kHeadDim, message("v", "V", V));
}

// kda::fwd_pool_: the decode kernel (pool.cu) for speculative calls and short
// requests, else the chunked forward from the pool's states, copied out first,
// with the final states copied back (heuristics.h, pool_by_decode). The decode
// kernel's tile is 128 x 128: heads wider than 128 (K or V) always take the
// chunked forward (its 256-wide kernels), and speculative decoding, which only
// the decode kernel does, is refused for them. Nothing waits on the host:
// padding rows and indices past the pool are found on the device (checked
// under TORCH_KDA_CHECK=1, which reads them).
void fwd_pool(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
              const optional<Tensor>& A_log_, const optional<Tensor>& dt_bias_,
              Tensor& state_pool, const Tensor& state_indices, Tensor& out,
              optional<double> scale, optional<double> lower_bound, const optional<Tensor>& cu_seqlens,
              const optional<Tensor>& num_accepted_tokens) {
  const Tensor A_log = or_undefined(A_log_), dt_bias = or_undefined(dt_bias_);
  const char* op = "kda.fwd_pool_";
  Problem p = check_all(op, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, std::nullopt, cu_seqlens);
  const int64_t K = concrete(p.K), V = concrete(p.V);
  const bool wide = K > kHeadDim || V > kHeadDim;
  if (num_accepted_tokens.has_value()) {
    check_speculative_head_sizes(op, p);
  }
  check_pool_args(op, p, q, cu_seqlens.has_value(), state_pool, state_indices, num_accepted_tokens, out);
  TORCH_CHECK(p.state_dtype == at::kBFloat16 || p.state_dtype == at::kFloat,
              op, ": on CUDA, state_pool must have dtype bfloat16 or float32, got ", dtype_name(p.state_dtype));
  const int64_t N = concrete(p.N), H = concrete(p.H), tokens = concrete(p.B) * concrete(p.T);
  const bool by_decode = !wide && pool_by_decode(tokens, N, num_accepted_tokens.has_value());
  // Head sizes below 128 on the decode kernel (padded_heads.h): it reads
  // zero-padded copies of the tokens' inputs and writes a padded out, while the
  // pool is read and written in place at its own sizes (PoolParams::K, V),
  // element by element; so do the chunked path's copies at any size.
  const bool narrow = !wide && pads_heads(p, kHeadDim);
  const int64_t elem = state_pool.element_size();
  // The decode kernel's 16-byte rows at 128 x 128 (the copies take any alignment).
  const bool slots_aligned =
      aligned16(state_pool) && (state_pool.size(0) <= 1 || state_pool.stride(0) * elem % 16 == 0);
  TORCH_CHECK(narrow || wide || slots_aligned, op, ": on CUDA, state_pool's slots must start on 16-byte boundaries "
              "(its data and its slot stride in bytes multiples of 16)");
  check_pool_disjoint(op, out, state_pool);
  if (debug_checks_enabled()) {
    check_pool_indices(op, state_indices, num_accepted_tokens, state_pool.size(0));
  }
  c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  std::vector<int64_t> padded_out = out.sizes().vec();
  padded_out.back() = kHeadDim;
  Tensor out_c = by_decode && narrow ? at::empty(padded_out, out.options())
                 : out.is_contiguous() && aligned16(out) ? out
                                                         : at::empty_like(out, at::MemoryFormat::Contiguous);
  // What the kernels read while they write the pool and out comes from a copy
  // where it shares memory with either (the chunked path's forward makes its
  // own copies as kda::fwd_ does, and its copies of the pool run in order);
  // the decode kernel's vector loads want 16-byte aligned rows.
  auto read_safely = [&](const Tensor& t) {
    Tensor c = staged16(t);
    if (!c.defined()) {
      return c;  // a precomputed gate's A_log and dt_bias
    }
    for (const Tensor* written : {&state_pool, &out_c}) {
      if (c.storage().is_alias_of(written->storage()) &&
          at::get_overlap_status(c, *written) != at::MemOverlapStatus::No) {
        return c.clone();
      }
    }
    return c;
  };
  const Tensor indices = read_safely(state_indices);
  const Tensor accepted = num_accepted_tokens.has_value() ? read_safely(*num_accepted_tokens) : Tensor();
  // A varlen batch's request boundaries as the forward takes them (boundaries.cu:
  // clamped, non-decreasing), so that no two requests share a row of out.
  const Boundaries bounds = sequence_boundaries(op, p, q, cu_seqlens, stream);

  PoolParams pp;
  pp.fwd.out = out_c.data_ptr();
  pp.pool = state_pool.data_ptr();
  pp.pool_stride = state_pool.size(0) <= 1 ? H * V * K : state_pool.stride(0);
  pp.K = K;
  pp.V = V;
  pp.slots = state_pool.size(0);
  pp.pool_fp32 = p.state_dtype == at::kFloat;
  pp.indices = indices.data_ptr();
  pp.indices_int32 = indices.scalar_type() == at::kInt;
  pp.index_cols = indices.dim() == 2 ? indices.size(1) : 1;
  pp.accepted = accepted.defined() ? accepted.data_ptr() : nullptr;
  pp.accepted_int32 = accepted.defined() && accepted.scalar_type() == at::kInt;
  pp.fwd.seq_offsets = bounds.offsets.defined() ? bounds.offsets.data_ptr<int64_t>() : nullptr;  // row 0: seq
  pp.fwd.T = cu_seqlens.has_value() ? tokens : concrete(p.T);
  pp.fwd.N = N;
  pp.fwd.H = H;
  pp.fwd.group = value_head_group(p);
  // The decode kernel's tile (narrow pools sit inside it); else out's rows,
  // which the padding rows' zeros cover.
  pp.fwd.head_size = by_decode ? kHeadDim : static_cast<int>(V);
  pp.fwd.scale = static_cast<float>(resolved_scale(p));
  set_gate(pp.fwd, p, g);

  if (by_decode) {
    const PaddedInputs x = narrow ? padded_inputs(p, kHeadDim, q, k, v, g, dt_bias, std::nullopt)
                                  : PaddedInputs{p, q, k, v, g, dt_bias, std::nullopt};
    const Tensor qc = read_safely(x.q), kc = read_safely(x.k), vc = read_safely(x.v), gc = read_safely(x.g);
    const Tensor bc = read_safely(beta), ac = read_safely(A_log), dc = read_safely(x.dt_bias);
    pp.fwd.q = qc.data_ptr();
    pp.fwd.k = kc.data_ptr();
    pp.fwd.v = vc.data_ptr();
    pp.fwd.g = gc.data_ptr();
    pp.fwd.beta = bc.data_ptr();
    pp.fwd.A_log = float_data_or_null(ac);
    pp.fwd.dt_bias = float_data_or_null(dc);
    launch_pool_decode(pp, stream);
  } else {
    Tensor states = at::empty({N, H, V, K}, state_pool.options().dtype(p.state_dtype));
    Tensor final_states = at::empty_like(states);
    pp.states = states.data_ptr();
    launch_pool_gather(pp, stream);
    forward_served(op, p, q, k, v, g, beta, A_log, dt_bias, states, cu_seqlens, out_c, final_states);
    pp.states = final_states.data_ptr();
    launch_pool_scatter(pp, stream);
    launch_pool_zero_padding(pp, stream);
  }
  if (!out_c.is_same(out)) {
    out.copy_(out_c.size(-1) != V ? out_c.narrow(-1, 0, V) : out_c);
  }
}


}  // namespace

TORCH_LIBRARY_IMPL(kda, CUDA, m) {
  m.impl("fwd_pool_", &fwd_pool);
}

}  // namespace kda::cuda
