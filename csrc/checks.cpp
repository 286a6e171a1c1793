// Argument checks shared by all backends. Shapes are compared as SymInts so
// the same code serves the Meta kernels under symbolic shapes.
#include "kda.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace kda {
namespace {

std::string shape_str(const at::Tensor& t) {
  return kda::shape_str(t.sym_sizes());
}

void check_defined(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " must be a tensor, got None");
}

void check_rank(const char* op, const char* name, const at::Tensor& t, int64_t rank, const char* layout) {
  TORCH_CHECK(
      t.dim() == rank,
      op, ": ", name, " must be a ", int_str(rank), "-D tensor ", layout, ", got a ", int_str(t.dim()),
      "-D tensor of shape ",
      shape_str(t));
}

void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q) {
  TORCH_CHECK(
      t.device() == q.device(),
      op, ": ", name, " must be on the same device as q (", q.device().str(), "), got ", name, " on ",
      t.device().str());
}

void check_dtype_is(const char* op, const char* name, const at::Tensor& t, at::ScalarType expected, const char* why) {
  TORCH_CHECK(
      t.scalar_type() == expected,
      op, ": ", name, " must have dtype ", dtype_name(expected), " (", why, "), got ", dtype_name(t.scalar_type()));
}

void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim, const c10::SymInt& expected,
                const char* what, const char* layout) {
  TORCH_CHECK(
      t.sym_size(dim) == expected,
      op, ": ", name, " must have shape ", layout, " with ", what, " = ", sym_str(expected), " at dim ", int_str(dim),
      ", got shape ",
      shape_str(t));
}

// Rank, then each size in order, for a tensor whose layout names its dims.
void check_shape(const char* op, const char* name, const at::Tensor& t, const char* layout,
                 std::initializer_list<std::pair<const char*, c10::SymInt>> dims) {
  check_rank(op, name, t, static_cast<int64_t>(dims.size()), layout);
  int64_t d = 0;
  for (const auto& [what, size] : dims) {
    check_size(op, name, t, d++, size, what, layout);
  }
}

void check_state_shape(const char* op, const char* name, const at::Tensor& t, const Problem& p) {
  check_shape(op, name, t, "[N, HV, V, K]", {{"N", p.N}, {"HV", p.H}, {"V", p.V}, {"K", p.K}});
}

void check_token_output_shape(const char* op, const char* name, const at::Tensor& t, const Problem& p) {
  check_shape(op, name, t, "[B, T, HV, V]", {{"B", p.B}, {"T", p.T}, {"HV", p.H}, {"V", p.V}});
}

bool is_float_dtype(at::ScalarType s) {
  return s == at::kBFloat16 || s == at::kHalf || s == at::kFloat || s == at::kDouble;
}

bool is_state_dtype(at::ScalarType s) {
  return s == at::kBFloat16 || s == at::kFloat || s == at::kDouble;
}

}  // namespace

// PyTorch's Python names (float32, not Float), as users write them.
std::string dtype_name(at::ScalarType s) {
  switch (s) {
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(s);
  }
}

std::string int_str(int64_t x) {
  return std::to_string(x);
}

std::string float_str(double x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", x);  // what an ostream prints by default
  return buf;
}

std::string sym_str(const c10::SymInt& x) {
  if (auto concrete_value = x.maybe_as_int()) {
    return int_str(*concrete_value);
  }
  return x.toSymNode()->str();
}

std::string shape_str(c10::SymIntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    s += (i ? ", " : "") + sym_str(sizes[i]);
  }
  return s + "]";
}

void check_A_log_values(const char* op, const at::Tensor& A_log, bool in_double) {
  if (!A_log.defined() || A_log.numel() == 0) {
    return;
  }
  const double limit = in_double ? std::log(DBL_MAX) : std::log(FLT_MAX);
  const double largest = A_log.max().item<double>();
  TORCH_CHECK(largest <= limit, op, ": A_log must be at most ", float_str(limit), " so that exp(A_log) is finite in ",
              in_double ? "float64" : "float32", ", got a largest value of ", float_str(largest));
}

void check_precomputed_gate_values(const char* op, const Problem& p, const at::Tensor& g) {
  if (!p.precomputed_gate || g.numel() == 0) {
    return;
  }
  const auto [lowest, highest] = at::aminmax(g);  // one pass over g for both bounds
  const double largest = highest.item<double>();
  TORCH_CHECK(largest <= 0.0, op, ": g must be a log decay (at most 0) when A_log and dt_bias are None, got a "
              "largest value of ", float_str(largest));
  if (p.gate == Gate::kBounded) {
    const double smallest = lowest.item<double>();
    TORCH_CHECK(smallest >= p.lower_bound, op, ": g must be at least lower_bound = ", float_str(p.lower_bound),
                " (its promise for a precomputed gate), got a smallest value of ", float_str(smallest));
  }
}

bool debug_checks_enabled() {
  const char* env = std::getenv("TORCH_KDA_CHECK");
  return env != nullptr && std::string(env) == "1";
}

double resolved_scale(const Problem& p) {
  if (p.scale.has_value()) {
    return *p.scale;
  }
  return 1.0 / std::sqrt(static_cast<double>(concrete(p.K)));
}

Problem check_forward_args(
    const char* op,
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& g,
    const at::Tensor& beta,
    const at::Tensor& A_log,
    const at::Tensor& dt_bias,
    std::optional<double> scale,
    std::optional<double> lower_bound,
    const std::optional<at::Tensor>& initial_state,
    const std::optional<at::Tensor>& cu_seqlens) {
  check_defined(op, "q", q);
  check_defined(op, "k", k);
  check_defined(op, "v", v);
  check_defined(op, "g", g);
  check_defined(op, "beta", beta);
  TORCH_CHECK(
      A_log.defined() == dt_bias.defined(),
      op, ": A_log and dt_bias must both be tensors, or both None (then g is the log decay itself), got ",
      A_log.defined() ? "dt_bias None" : "A_log None");
  const bool gate_params = A_log.defined();

  // Devices first: a mismatch there explains every later surprise.
  TORCH_CHECK(
      q.device().is_cpu() || q.device().is_cuda() || q.device().is_meta(),
      op, ": q must be on a CPU or CUDA device, got q on ", q.device().str());
  check_same_device(op, "k", k, q);
  check_same_device(op, "v", v, q);
  check_same_device(op, "g", g, q);
  check_same_device(op, "beta", beta, q);
  if (gate_params) {
    check_same_device(op, "A_log", A_log, q);
    check_same_device(op, "dt_bias", dt_bias, q);
  }
  if (initial_state.has_value()) {
    check_same_device(op, "initial_state", *initial_state, q);
  }
  if (cu_seqlens.has_value()) {
    check_same_device(op, "cu_seqlens", *cu_seqlens, q);
  }

  // Dtypes.
  TORCH_CHECK(
      is_float_dtype(q.scalar_type()),
      op, ": q must have dtype bfloat16, float16, float32 or float64, got ", dtype_name(q.scalar_type()));
  check_dtype_is(op, "k", k, q.scalar_type(), "the dtype of q");
  check_dtype_is(op, "v", v, q.scalar_type(), "the dtype of q");
  if (gate_params) {
    check_dtype_is(op, "g", g, q.scalar_type(), "the dtype of q");
  } else {
    TORCH_CHECK(
        g.scalar_type() == q.scalar_type() || g.scalar_type() == at::kFloat,
        op, ": g must have the dtype of q (", dtype_name(q.scalar_type()), ") or float32 when A_log and dt_bias are "
        "None, got ", dtype_name(g.scalar_type()));
  }
  check_dtype_is(op, "beta", beta, q.scalar_type(), "the dtype of q");
  if (gate_params) {
    TORCH_CHECK(
        A_log.scalar_type() == at::kFloat || A_log.scalar_type() == at::kDouble,
        op, ": A_log must have dtype float32 (or float64), got ", dtype_name(A_log.scalar_type()));
    TORCH_CHECK(
        dt_bias.scalar_type() == at::kFloat || dt_bias.scalar_type() == at::kDouble,
        op, ": dt_bias must have dtype float32 (or float64), got ", dtype_name(dt_bias.scalar_type()));
  }
  if (initial_state.has_value()) {
    TORCH_CHECK(
        is_state_dtype(initial_state->scalar_type()),
        op, ": initial_state must have dtype bfloat16, float32 or float64, got ", dtype_name(initial_state->scalar_type()));
  }
  if (cu_seqlens.has_value()) {
    TORCH_CHECK(
        cu_seqlens->scalar_type() == at::kLong || cu_seqlens->scalar_type() == at::kInt,
        op, ": cu_seqlens must have dtype int64 or int32, got ", dtype_name(cu_seqlens->scalar_type()));
  }

  // Ranks and shapes.
  check_rank(op, "q", q, 4, "[B, T, H, K]");
  check_rank(op, "k", k, 4, "[B, T, H, K]");
  check_rank(op, "v", v, 4, "[B, T, HV, V]");
  check_rank(op, "g", g, 4, "[B, T, HV, K]");
  check_rank(op, "beta", beta, 3, "[B, T, HV]");
  if (gate_params) {
    check_rank(op, "A_log", A_log, 1, "[HV]");
    check_rank(op, "dt_bias", dt_bias, 2, "[HV, K]");
  }

  Problem p;
  p.B = q.sym_size(0);
  p.T = q.sym_size(1);
  p.H_qk = q.sym_size(2);
  p.H = v.sym_size(2);
  p.K = q.sym_size(3);
  p.V = v.sym_size(3);
  TORCH_CHECK(p.K > 0, op, ": q must have a positive head size K (dim 3), got shape ", shape_str(q));
  TORCH_CHECK(p.V > 0, op, ": v must have a positive head size V (dim 3), got shape ", shape_str(v));
  TORCH_CHECK(p.K <= kMaxHeadSize, op, ": q must have a head size K (dim 3) of at most ", int_str(kMaxHeadSize),
              ", got shape ", shape_str(q));
  TORCH_CHECK(p.V <= kMaxHeadSize, op, ": v must have a head size V (dim 3) of at most ", int_str(kMaxHeadSize),
              ", got shape ", shape_str(v));
  TORCH_CHECK(p.H_qk > 0, op, ": q must have at least one head (dim 2), got shape ", shape_str(q));

  TORCH_CHECK(
      k.sym_sizes() == q.sym_sizes(),
      op, ": k must have the shape of q ", shape_str(q), ", got ", shape_str(k));
  for (int64_t d = 0; d < 2; ++d) {
    check_size(op, "v", v, d, q.sym_size(d), d == 0 ? "B" : "T", "[B, T, HV, V]");
  }
  TORCH_CHECK(
      p.H >= p.H_qk && p.H % p.H_qk == 0,
      op, ": v must have a number of heads HV (dim 2) that is a multiple of q's H = ", sym_str(p.H_qk),
      " (value head j uses query/key head j // (HV / H)), got shape ", shape_str(v));
  check_shape(op, "g", g, "[B, T, HV, K]", {{"B", p.B}, {"T", p.T}, {"HV", p.H}, {"K", p.K}});
  check_shape(op, "beta", beta, "[B, T, HV]", {{"B", p.B}, {"T", p.T}, {"HV", p.H}});
  if (gate_params) {
    check_size(op, "A_log", A_log, 0, p.H, "HV", "[HV]");
    check_size(op, "dt_bias", dt_bias, 0, p.H, "HV", "[HV, K]");
    check_size(op, "dt_bias", dt_bias, 1, p.K, "K", "[HV, K]");
  }
  p.precomputed_gate = !gate_params;

  if (cu_seqlens.has_value()) {
    TORCH_CHECK(
        cu_seqlens->dim() == 1,
        op, ": cu_seqlens must be a 1-D tensor [N + 1], got a ", int_str(cu_seqlens->dim()), "-D tensor of shape ",
        shape_str(*cu_seqlens));
    TORCH_CHECK(
        cu_seqlens->sym_size(0) >= 1,
        op, ": cu_seqlens must hold at least one offset (N + 1 >= 1), got shape ", shape_str(*cu_seqlens));
    TORCH_CHECK(
        p.B == 1,
        op, ": q must have batch size B = 1 when cu_seqlens is given (sequences are packed along T), got shape ",
        shape_str(q));
    p.N = cu_seqlens->sym_size(0) - 1;
  } else {
    p.N = p.B;
  }

  if (initial_state.has_value()) {
    check_state_shape(op, "initial_state", *initial_state, p);
  }

  // Scalars.
  if (scale.has_value()) {
    TORCH_CHECK(std::isfinite(*scale), op, ": scale must be a finite number, got ", float_str(*scale));
  }
  p.scale = scale;
  if (lower_bound.has_value()) {
    TORCH_CHECK(
        std::isfinite(*lower_bound) && *lower_bound < 0.0,
        op, ": lower_bound must be a finite negative number (or None for the softplus gate), got ", float_str(*lower_bound));
    p.gate = Gate::kBounded;
    p.lower_bound = *lower_bound;
  } else {
    p.gate = Gate::kSoftplus;
  }

  p.input_dtype = q.scalar_type();
  if (initial_state.has_value()) {
    p.state_dtype = initial_state->scalar_type();
  } else {
    p.state_dtype = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  }
  return p;
}

void check_inplace_buffers(
    const char* op,
    const Problem& p,
    const at::Tensor& q,
    const at::Tensor& out,
    const std::optional<at::Tensor>& final_state,
    const std::optional<at::Tensor>& initial_state) {
  check_defined(op, "out", out);
  check_same_device(op, "out", out, q);
  TORCH_CHECK(
      at::has_internal_overlap(out) != at::MemOverlap::Yes,
      op, ": out must not have elements that share memory (an expanded tensor, say), got strides ",
      shape_str(out.sym_strides()));
  check_dtype_is(op, "out", out, q.scalar_type(), "the dtype of q");
  check_token_output_shape(op, "out", out, p);
  if (final_state.has_value()) {
    const at::Tensor& fs = *final_state;
    check_defined(op, "final_state", fs);
    check_same_device(op, "final_state", fs, q);
    TORCH_CHECK(
        at::has_internal_overlap(fs) != at::MemOverlap::Yes,
        op, ": final_state must not have elements that share memory (an expanded tensor, say), got strides ",
        shape_str(fs.sym_strides()));
    TORCH_CHECK(
        is_state_dtype(fs.scalar_type()),
        op, ": final_state must have dtype bfloat16, float32 or float64, got ", dtype_name(fs.scalar_type()));
    if (initial_state.has_value()) {
      TORCH_CHECK(
          fs.scalar_type() == initial_state->scalar_type(),
          op, ": final_state must have the dtype of initial_state (", dtype_name(initial_state->scalar_type()),
          "), got ", dtype_name(fs.scalar_type()));
    }
    check_state_shape(op, "final_state", fs, p);
  }
}

void check_pool_args(
    const char* op,
    Problem& p,
    const at::Tensor& q,
    bool varlen,
    const at::Tensor& state_pool,
    const at::Tensor& state_indices,
    const std::optional<at::Tensor>& num_accepted_tokens,
    const at::Tensor& out) {
  check_defined(op, "state_pool", state_pool);
  check_defined(op, "state_indices", state_indices);
  check_same_device(op, "state_pool", state_pool, q);
  check_same_device(op, "state_indices", state_indices, q);
  TORCH_CHECK(
      is_state_dtype(state_pool.scalar_type()),
      op, ": state_pool must have dtype bfloat16, float32 or float64, got ", dtype_name(state_pool.scalar_type()));
  check_rank(op, "state_pool", state_pool, 4, "[slots, HV, V, K]");
  check_size(op, "state_pool", state_pool, 1, p.H, "HV", "[slots, HV, V, K]");
  check_size(op, "state_pool", state_pool, 2, p.V, "V", "[slots, HV, V, K]");
  check_size(op, "state_pool", state_pool, 3, p.K, "K", "[slots, HV, V, K]");
  // A slot's [H, V, K] is contiguous; the slots may lie apart (a view of a larger cache).
  const c10::SymInt hvk = p.H * p.V * p.K;
  TORCH_CHECK(
      state_pool.sym_stride(3) == 1 && state_pool.sym_stride(2) == p.K && state_pool.sym_stride(1) == p.V * p.K &&
          (state_pool.sym_size(0) <= 1 || state_pool.sym_stride(0) >= hvk),
      op, ": state_pool's slots must each be contiguous [H, V, K] (strides [>= H*V*K, V*K, K, 1]), got strides ",
      shape_str(state_pool.sym_strides()));
  TORCH_CHECK(
      state_indices.scalar_type() == at::kLong || state_indices.scalar_type() == at::kInt,
      op, ": state_indices must have dtype int64 or int32, got ", dtype_name(state_indices.scalar_type()));
  if (num_accepted_tokens.has_value()) {
    check_defined(op, "num_accepted_tokens", *num_accepted_tokens);
    check_same_device(op, "num_accepted_tokens", *num_accepted_tokens, q);
    TORCH_CHECK(
        num_accepted_tokens->scalar_type() == at::kLong || num_accepted_tokens->scalar_type() == at::kInt,
        op, ": num_accepted_tokens must have dtype int64 or int32, got ",
        dtype_name(num_accepted_tokens->scalar_type()));
    check_rank(op, "num_accepted_tokens", *num_accepted_tokens, 1, "[N]");
    check_size(op, "num_accepted_tokens", *num_accepted_tokens, 0, p.N, "N", "[N]");
    check_rank(op, "state_indices", state_indices, 2, "[N, T_max] with num_accepted_tokens");
    check_size(op, "state_indices", state_indices, 0, p.N, "N", "[N, T_max]");
    // Fixed length: T_max covers every request's tokens. With cu_seqlens a
    // request's tokens past T_max update no slot (documented; checked where
    // the lengths are read).
    if (!varlen) {
      TORCH_CHECK(
          state_indices.sym_size(1) >= p.T,
          op, ": state_indices must have a column for each of the T = ", sym_str(p.T),
          " tokens of a request (shape [N, T_max], T_max >= T), got shape ", shape_str(state_indices));
    }
    TORCH_CHECK(
        state_indices.sym_size(1) >= 1,
        op, ": state_indices must have at least one column, got shape ", shape_str(state_indices));
  } else {
    check_rank(op, "state_indices", state_indices, 1, "[N] (or [N, T_max] with num_accepted_tokens)");
    check_size(op, "state_indices", state_indices, 0, p.N, "N", "[N]");
  }
  check_inplace_buffers(op, p, q, out, std::nullopt, std::nullopt);
  p.state_dtype = state_pool.scalar_type();
}

void check_pool_indices(
    const char* op,
    const at::Tensor& state_indices,
    const std::optional<at::Tensor>& num_accepted_tokens,
    int64_t slots) {
  const at::Tensor idx = state_indices.to(at::kCPU, at::kLong).contiguous();
  const int64_t* x = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i) {
    TORCH_CHECK(
        x[i] < slots,
        op, ": state_indices must name slots below the pool's ", int_str(slots), " (or be negative: padding), got ",
        int_str(x[i]), " at flat position ", int_str(i));
  }
  if (num_accepted_tokens.has_value()) {
    const at::Tensor acc = num_accepted_tokens->to(at::kCPU, at::kLong).contiguous();
    const int64_t t_max = state_indices.size(1);
    const int64_t* a = acc.data_ptr<int64_t>();
    for (int64_t n = 0; n < acc.numel(); ++n) {
      TORCH_CHECK(
          a[n] >= 1 && a[n] <= t_max,
          op, ": num_accepted_tokens must be in [1, T_max = ", int_str(t_max), "], got ", int_str(a[n]),
          " for request ", int_str(n));
    }
  }
}

std::vector<int64_t> sequence_offsets(const char* op, const Problem& p, const std::optional<at::Tensor>& cu_seqlens) {
  const int64_t B = concrete(p.B), T = concrete(p.T);
  if (cu_seqlens.has_value()) {
    return read_and_check_cu_seqlens(op, *cu_seqlens, T);
  }
  std::vector<int64_t> offsets(B + 1);
  for (int64_t b = 0; b <= B; ++b) {
    offsets[b] = b * T;
  }
  return offsets;
}

void check_outputs_disjoint(const char* op, const at::Tensor& out, const std::optional<at::Tensor>& final_state) {
  if (!final_state.has_value()) {
    return;
  }
  const at::MemOverlapStatus status = at::get_overlap_status(out, *final_state);
  TORCH_CHECK(
      status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial,
      op, ": out and final_state must not share memory (each element is written once, by one of them)");
}

void check_pool_disjoint(const char* op, const at::Tensor& out, const at::Tensor& state_pool) {
  const bool shared = out.storage().is_alias_of(state_pool.storage()) &&
                      at::get_overlap_status(out, state_pool) != at::MemOverlapStatus::No;
  TORCH_CHECK(!shared, op, ": out and state_pool must not share memory (each element is written once, by one of them)");
}

void check_backward_grads(
    const char* op,
    const Problem& p,
    const at::Tensor& q,
    const at::Tensor& grad_out,
    const std::optional<at::Tensor>& grad_final_state) {
  check_defined(op, "grad_out", grad_out);
  check_same_device(op, "grad_out", grad_out, q);
  TORCH_CHECK(
      is_float_dtype(grad_out.scalar_type()),
      op, ": grad_out must have a floating dtype, got ", dtype_name(grad_out.scalar_type()));
  check_token_output_shape(op, "grad_out", grad_out, p);
  if (grad_final_state.has_value()) {
    const at::Tensor& gs = *grad_final_state;
    check_same_device(op, "grad_final_state", gs, q);
    TORCH_CHECK(
        is_float_dtype(gs.scalar_type()),
        op, ": grad_final_state must have a floating dtype, got ", dtype_name(gs.scalar_type()));
    check_state_shape(op, "grad_final_state", gs, p);
  }
}

std::vector<int64_t> read_and_check_cu_seqlens(const char* op, const at::Tensor& cu_seqlens, int64_t total_tokens) {
  at::Tensor host = cu_seqlens.to(at::kCPU, at::kLong).contiguous();
  const int64_t* ptr = host.data_ptr<int64_t>();
  std::vector<int64_t> offsets(ptr, ptr + host.numel());
  TORCH_CHECK(!offsets.empty(), op, ": cu_seqlens must hold at least one offset");
  TORCH_CHECK(offsets.front() == 0, op, ": cu_seqlens must start at 0, got cu_seqlens[0] = ", int_str(offsets.front()));
  for (size_t i = 1; i < offsets.size(); ++i) {
    TORCH_CHECK(
        offsets[i] >= offsets[i - 1],
        op, ": cu_seqlens must be non-decreasing, got cu_seqlens[", int_str(static_cast<int64_t>(i)), "] = ",
        int_str(offsets[i]), " < cu_seqlens[", int_str(static_cast<int64_t>(i - 1)), "] = ", int_str(offsets[i - 1]));
  }
  TORCH_CHECK(
      offsets.back() == total_tokens,
      op, ": cu_seqlens must end at the number of tokens T = ", int_str(total_tokens), ", got cu_seqlens[-1] = ",
      int_str(offsets.back()));
  return offsets;
}

}  // namespace kda
