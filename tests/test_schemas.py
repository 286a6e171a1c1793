"""The operator schemas are stable API (docs/ARCHITECTURE.md lists them): a change must be deliberate,
so each is snapshotted here. Refresh with EXPECTTEST_ACCEPT=1 after a deliberate change."""
import expecttest
import torch

import torch_kda  # noqa: F401  (registers torch.ops.kda.*)


class TestSchemas(expecttest.TestCase):
    def test_fwd_schema(self):
        self.assertExpectedInline(str(torch.ops.kda.fwd.default._schema), """kda::fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, float? scale=None, float? lower_bound=None, Tensor? initial_state=None, bool output_final_state=False, Tensor? cu_seqlens=None) -> (Tensor out, Tensor final_state)""")

    def test_fwd_inplace_schema(self):
        self.assertExpectedInline(str(torch.ops.kda.fwd_.default._schema), """kda::fwd_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, Tensor(a!) out, Tensor(b!)? final_state=None, float? scale=None, float? lower_bound=None, Tensor? initial_state=None, Tensor? cu_seqlens=None) -> ()""")

    def test_bwd_schema(self):
        self.assertExpectedInline(str(torch.ops.kda.bwd.default._schema), """kda::bwd(Tensor grad_out, Tensor? grad_final_state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, float? scale=None, float? lower_bound=None, Tensor? initial_state=None, Tensor? cu_seqlens=None, Tensor? checkpoints=None, Tensor? records=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, Tensor dA_log, Tensor ddt_bias, Tensor dinitial_state)""")

    def test_fwd_pool_schema(self):
        self.assertExpectedInline(str(torch.ops.kda.fwd_pool_.default._schema), """kda::fwd_pool_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, Tensor(a!) state_pool, Tensor state_indices, Tensor(b!) out, float? scale=None, float? lower_bound=None, Tensor? cu_seqlens=None, Tensor? num_accepted_tokens=None) -> ()""")

    def test_fwd_checkpointed_schema(self):
        # Not API (what torch_kda.kda calls on CUDA when a gradient is wanted), but
        # its first arguments must stay fwd's: autograd's setup_context reads them alike.
        self.assertExpectedInline(str(torch.ops.kda._fwd_checkpointed.default._schema), """kda::_fwd_checkpointed(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, float? scale=None, float? lower_bound=None, Tensor? initial_state=None, bool output_final_state=False, Tensor? cu_seqlens=None, str save="states_and_records") -> (Tensor out, Tensor final_state, Tensor checkpoints, Tensor records)""")

    def test_overloads(self):
        # One overload per operator: callers and the autograd registration use .default.
        for name in ("fwd", "fwd_", "fwd_pool_", "bwd", "_fwd_checkpointed"):
            self.assertEqual(getattr(torch.ops.kda, name).overloads(), ["default"])

    def test_fwd_inplace_mutates_only_its_buffers(self):
        schema = torch.ops.kda.fwd_.default._schema
        mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        self.assertEqual(mutated, ["out", "final_state"])
        pool = torch.ops.kda.fwd_pool_.default._schema
        mutated = [a.name for a in pool.arguments if a.alias_info is not None and a.alias_info.is_write]
        self.assertEqual(mutated, ["state_pool", "out"])
        for op in (torch.ops.kda.fwd.default, torch.ops.kda.bwd.default, torch.ops.kda._fwd_checkpointed.default):
            self.assertFalse(any(a.alias_info is not None for a in op._schema.arguments))
