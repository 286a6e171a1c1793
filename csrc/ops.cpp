// The operator schemas of torch.ops.kda (stable API: change them deliberately;
// tests/test_schemas.py snapshots them) and the Python module stub that lets
// `import torch_kda._C` load this library.
#include <Python.h>
#include <torch/library.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",  // name
      "torch_kda native library: registers torch.ops.kda.*",
      -1,
      nullptr,
  };
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(kda, m) {
  // A_log and dt_bias are given together, or both None: then g is the log
  // decay itself (a precomputed gate, <= 0; lower_bound, if given, a promise
  // that g >= lower_bound) and bwd's dA_log and ddt_bias are empty.
  // Functional forward: returns new tensors. final_state is an empty tensor
  // when output_final_state is False (schemas cannot return optionals).
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "float? scale=None, float? lower_bound=None, Tensor? initial_state=None, "
      "bool output_final_state=False, Tensor? cu_seqlens=None) -> (Tensor out, Tensor final_state)");
  // In-place forward for serving and CUDA graphs: writes the caller's buffers.
  m.def(
      "fwd_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor(a!) out, Tensor(b!)? final_state=None, float? scale=None, float? lower_bound=None, "
      "Tensor? initial_state=None, Tensor? cu_seqlens=None) -> ()");
  // Serving from a state pool, in place: request n starts from slot
  // state_indices[n] of state_pool [slots, H, V, K] and leaves its final state
  // there; with num_accepted_tokens (speculative decoding), state_indices is
  // [N, T_max], the start is slot state_indices[n, num_accepted_tokens[n] - 1]
  // and the state after token t goes to slot state_indices[n, t]. A negative
  // start slot marks a padding row (nothing read or written, out zero). out
  // [B, T, H, V] is written whole.
  m.def(
      "fwd_pool_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor(a!) state_pool, Tensor state_indices, Tensor(b!) out, float? scale=None, float? lower_bound=None, "
      "Tensor? cu_seqlens=None, Tensor? num_accepted_tokens=None) -> ()");
  // Not API: fwd that also returns checkpoints, the state at every chunk
  // slot's start in bf16, and records, K1's record of every chunk slot, as
  // `save` asks ("states_and_records", "states" or "none"; checkpoints.h:
  // what is not kept is empty), so that bwd, given them, runs no recurrence
  // pass and no K1 of its own for them. torch_kda.kda calls it on CUDA when a
  // gradient is wanted. CUDA and Meta only.
  m.def(
      "_fwd_checkpointed(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "float? scale=None, float? lower_bound=None, Tensor? initial_state=None, "
      "bool output_final_state=False, Tensor? cu_seqlens=None, str save=\"states_and_records\") -> "
      "(Tensor out, Tensor final_state, Tensor checkpoints, Tensor records)");
  // Backward of fwd. dinitial_state is empty when there is no initial_state.
  // checkpoints, records: _fwd_checkpointed's for the same inputs, or None /
  // empty (records only with checkpoints).
  m.def(
      "bwd(Tensor grad_out, Tensor? grad_final_state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
      "Tensor? A_log, Tensor? dt_bias, float? scale=None, float? lower_bound=None, Tensor? initial_state=None, "
      "Tensor? cu_seqlens=None, Tensor? checkpoints=None, Tensor? records=None) -> (Tensor dq, Tensor dk, "
      "Tensor dv, Tensor dg, Tensor dbeta, Tensor dA_log, Tensor ddt_bias, Tensor dinitial_state)");
}
