// The validated description of one KDA call, shared by every backend
// (CPU, CUDA, Meta). Argument checks live in checks.cpp and nowhere else, so
// that torch.ops.kda.* callers and Python callers see the same errors.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "constants.h"

namespace kda {

enum class Gate { kBounded, kSoftplus };

// Shapes are SymInts so that the Meta kernels serve symbolic shapes; real
// kernels read them through concrete().
struct Problem {
  // H: the value heads (v, g, beta, A_log, dt_bias, the states, out); H_qk:
  // q's and k's, of which H is a multiple (grouped value heads: value head j
  // uses query/key head j / (H / H_qk)).
  c10::SymInt B, T, H, K, V;
  c10::SymInt H_qk;
  c10::SymInt N;  // number of sequences: B, or len(cu_seqlens) - 1
  Gate gate = Gate::kBounded;
  double lower_bound = 0.0;  // only meaningful for Gate::kBounded
  // A_log and dt_bias None: g is the log decay itself (the gate's formula is
  // not applied; lower_bound, if given, is the caller's promise g >= lower_bound).
  bool precomputed_gate = false;
  std::optional<double> scale;
  at::ScalarType input_dtype = at::kBFloat16;
  at::ScalarType state_dtype = at::kFloat;  // dtype of the state the op returns
};

// An optional tensor argument as the checks and kernels take it: undefined for None.
inline at::Tensor or_undefined(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

// Checks every argument of a forward call; raises with a message that names
// the argument. `op` is the name used in messages (e.g. "kda.fwd"). A_log and
// dt_bias undefined (None): a precomputed gate.
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
    const std::optional<at::Tensor>& cu_seqlens);

// The caller-provided buffers of the in-place forward.
void check_inplace_buffers(
    const char* op,
    const Problem& p,
    const at::Tensor& q,
    const at::Tensor& out,
    const std::optional<at::Tensor>& final_state,
    const std::optional<at::Tensor>& initial_state);

// out and final_state of the in-place op must not overlap (a real-kernel
// check: it reads storage, which shape-only Meta tensors do not have).
void check_outputs_disjoint(const char* op, const at::Tensor& out, const std::optional<at::Tensor>& final_state);

// The state-pool call's own arguments (kda::fwd_pool_): state_pool [slots, H,
// V, K] (bf16, fp32 or fp64; each slot contiguous, any slot stride),
// state_indices (int32 or int64) [N], or [N, T_max] with num_accepted_tokens
// [N], and out as the in-place forward's. Sets p.state_dtype to the pool's.
void check_pool_args(
    const char* op,
    Problem& p,
    const at::Tensor& q,
    bool varlen,
    const at::Tensor& state_pool,
    const at::Tensor& state_indices,
    const std::optional<at::Tensor>& num_accepted_tokens,
    const at::Tensor& out);

// Reads the indices (a device sync on CUDA): every slot below `slots` (negative:
// padding), every num_accepted_tokens in [1, T_max]. The CPU kernel always
// checks; CUDA under debug_checks_enabled.
void check_pool_indices(
    const char* op,
    const at::Tensor& state_indices,
    const std::optional<at::Tensor>& num_accepted_tokens,
    int64_t slots);

// out and state_pool of kda::fwd_pool_ must not overlap: in the same storage, any
// overlap but a proven disjoint one (a real-kernel check).
void check_pool_disjoint(const char* op, const at::Tensor& out, const at::Tensor& state_pool);

// The incoming gradients of the backward.
void check_backward_grads(
    const char* op,
    const Problem& p,
    const at::Tensor& q,
    const at::Tensor& grad_out,
    const std::optional<at::Tensor>& grad_final_state);

// Reads cu_seqlens (host copy; syncs on CUDA) and checks its contents: starts
// at 0, non-decreasing, ends at total_tokens. Returns the boundaries.
std::vector<int64_t> read_and_check_cu_seqlens(const char* op, const at::Tensor& cu_seqlens, int64_t total_tokens);

// The N + 1 token offsets of the sequences on the host: from cu_seqlens (read
// and checked, a device sync on CUDA) or, for a fixed-length batch, b * T.
std::vector<int64_t> sequence_offsets(const char* op, const Problem& p, const std::optional<at::Tensor>& cu_seqlens);

// Numbers in error messages are formatted with these (or std::to_string), never
// by inserting them into a std::ostream, as TORCH_CHECK and c10::str do with
// their arguments: streaming an int or a double from inside this extension
// crashes in libstdc++'s locale code (torch 2.11, GCC 13).
// tests/test_error_messages.py holds every message to this.
std::string int_str(int64_t x);
std::string float_str(double x);
std::string sym_str(const c10::SymInt& x);
std::string shape_str(c10::SymIntArrayRef sizes);

// A dtype as users write it in Python: float32, bfloat16, int64, ...
std::string dtype_name(at::ScalarType s);

// True when TORCH_KDA_CHECK=1: checks that need a device sync run on CUDA too.
bool debug_checks_enabled();

// Reads A_log (a device sync on CUDA) and checks that exp(A_log) is finite in
// the dtype the gate is computed in (float64, or float32): beyond it, A = inf
// turns the gate into NaN. The CPU kernels always check; CUDA under
// debug_checks_enabled.
void check_A_log_values(const char* op, const at::Tensor& A_log, bool in_double);

// Reads a precomputed gate's g and checks that it is a log decay (<= 0) and,
// with a lower bound, at least the bound: the CPU kernels' check (CUDA refuses a
// precomputed gate).
void check_precomputed_gate_values(const char* op, const Problem& p, const at::Tensor& g);

// K^-0.5 unless the caller gave a scale.
double resolved_scale(const Problem& p);

inline int64_t concrete(const c10::SymInt& s) {
  return s.expect_int();
}

// The chunk slots of a call of B x T tokens and N sequences, as the CUDA
// kernels number them: B * ceil(T / kChunk) for fixed length; with cu_seqlens
// (B = 1, T the batch's tokens) a bound, as the lengths are on the device:
// each sequence adds at most one partial chunk, and every chunk holds a token.
inline c10::SymInt chunk_slots(const c10::SymInt& B, const c10::SymInt& T, const c10::SymInt& N, bool varlen) {
  const c10::SymInt C = kChunk;
  const c10::SymInt chunks = (T + C - 1) / C;
  return varlen ? T.min(chunks + N) : B * chunks;
}

// Outputs are allocated in one place for the real and the Meta kernels, so
// their shapes, dtypes and strides agree (opcheck compares them).
struct ForwardOutputs {
  at::Tensor out;          // [B, T, H, V], dtype of q
  at::Tensor final_state;  // [N, H, V, K] in p.state_dtype, or [0] when not requested
};
ForwardOutputs allocate_forward_outputs(const Problem& p, const at::Tensor& q, bool output_final_state);

struct BackwardOutputs {
  at::Tensor dq, dk, dv, dg, dbeta, dA_log, ddt_bias;
  at::Tensor dinitial_state;  // [N, H, V, K], or [0] without initial_state
};
BackwardOutputs allocate_backward_outputs(
    const Problem& p,
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& g,
    const at::Tensor& beta,
    const at::Tensor& A_log,
    const at::Tensor& dt_bias,
    const std::optional<at::Tensor>& initial_state);

// kda::bwd's eight outputs, in the schema's order.
using BackwardTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                 at::Tensor, at::Tensor>;

}  // namespace kda
