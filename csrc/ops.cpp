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
  // Functional forward: returns new tensors. final_state is an empty tensor
  // when output_final_state is False (schemas cannot return optionals).
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor A_log, Tensor dt_bias, "
      "float? scale=None, float? lower_bound=None, Tensor? initial_state=None, "
      "bool output_final_state=False, Tensor? cu_seqlens=None) -> (Tensor out, Tensor final_state)");
  // In-place forward for serving and CUDA graphs: writes the caller's buffers.
  m.def(
      "fwd_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor A_log, Tensor dt_bias, "
      "Tensor(a!) out, Tensor(b!)? final_state=None, float? scale=None, float? lower_bound=None, "
      "Tensor? initial_state=None, Tensor? cu_seqlens=None) -> ()");
  // Not API: fwd that also returns checkpoints, the state at every chunk
  // slot's start in bf16, and records, K1's record of every chunk slot
  // (checkpoints.h; empty with TORCH_KDA_SAVE_STATES=0, the records also with
  // TORCH_KDA_SAVE_RECORDS=0), so that bwd, given them, runs no recurrence
  // pass and no K1 of its own for them.
  // torch_kda.kda calls it on CUDA when a gradient is wanted. CUDA and Meta only.
  m.def(
      "_fwd_checkpointed(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor A_log, Tensor dt_bias, "
      "float? scale=None, float? lower_bound=None, Tensor? initial_state=None, "
      "bool output_final_state=False, Tensor? cu_seqlens=None) -> (Tensor out, Tensor final_state, "
      "Tensor checkpoints, Tensor records)");
  // Backward of fwd. dinitial_state is empty when there is no initial_state.
  // checkpoints, records: _fwd_checkpointed's for the same inputs, or None /
  // empty (records only with checkpoints).
  m.def(
      "bwd(Tensor grad_out, Tensor? grad_final_state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
      "Tensor A_log, Tensor dt_bias, float? scale=None, float? lower_bound=None, Tensor? initial_state=None, "
      "Tensor? cu_seqlens=None, Tensor? checkpoints=None, Tensor? records=None) -> (Tensor dq, Tensor dk, "
      "Tensor dv, Tensor dg, Tensor dbeta, Tensor dA_log, Tensor ddt_bias, Tensor dinitial_state)");
  // Not API: kda::bwd computed by the chunked ATen composition
  // (chunked_backward.h) on any device, so that the CPU tests can check it.
  m.def(
      "_bwd_chunked(Tensor grad_out, Tensor? grad_final_state, Tensor q, Tensor k, Tensor v, Tensor g, "
      "Tensor beta, Tensor A_log, Tensor dt_bias, float? scale=None, float? lower_bound=None, "
      "Tensor? initial_state=None, Tensor? cu_seqlens=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dg, "
      "Tensor dbeta, Tensor dA_log, Tensor ddt_bias, Tensor dinitial_state)");
  // Not API: K1's backward alone on CUDA (bwd_prepare.cu), fixed length, so that a
  // GPU test can check it against torch_kda/reference.py chunk_record_backward.
  // d_record: [B * ceil(T / 16), H, 8576] fp32, the record gradients (params.h).
  m.def(
      "_prepare_bwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor A_log, Tensor dt_bias, "
      "Tensor d_record, float? scale=None, float lower_bound=-5.0) -> (Tensor dqn, Tensor dkn, Tensor dv, "
      "Tensor dlam, Tensor dbeta)");
  // Not API: the backward sweep alone on CUDA (bwd_sweep.cu), fixed length, from
  // given chunk-start states ([B * ceil(T / 16), H, V, K] bf16, as K2 stores them),
  // so that a GPU test can check it against torch_kda/reference.py
  // chunk_step_backward. Runs K1 for the records first. Returns dS at each
  // chunk's end as well (bf16, as the record gradients read it).
  m.def(
      "_sweep_bwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor A_log, Tensor dt_bias, "
      "Tensor states, Tensor grad_out, Tensor? grad_final_state=None, float? scale=None, "
      "float lower_bound=-5.0) -> (Tensor d_record, Tensor d_initial, Tensor d_states)");
}
