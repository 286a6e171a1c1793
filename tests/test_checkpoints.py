"""kda._fwd_checkpointed's checkpoints and records (csrc/checkpoints.h), where
no GPU is needed: their shapes (every chunk slot's starting state, bf16, and K1's
record, fp32) on Meta tensors, its `save` argument and torch_kda.kda's
save_for_backward keyword, and kda.bwd's checks of those it is given. Their values and what the backward
does with them are tested on the GPU (tests/test_cuda_backward.py)."""
import expecttest
import pytest
import torch

import torch_kda  # noqa: F401  (registers torch.ops.kda.*)
from conftest import RECORD_FLOATS, make_inputs, positional, record_floats

META = torch.device("meta")


def _meta_inputs(**kw):
    d = make_inputs(K=128, V=128, **kw)
    return {n: (t.to(META) if t is not None else t) for n, t in d.items()}


def _saved(d, **kw):
    out = torch.ops.kda._fwd_checkpointed(*positional(d), None, -5.0, d["initial_state"], False, d["cu_seqlens"], **kw)
    return out[2], out[3]


def _checkpoints(d):
    return _saved(d)[0]


# The CUDA kernels' chunk slots: B * ceil(T / 16) for fixed length, and for a
# varlen batch of T tokens and N sequences min(T, ceil(T / 16) + N).
@pytest.mark.parametrize("kw,slots", [
    (dict(B=1, T=8192, H=32), 512), (dict(B=1, T=16 * 500 + 1, H=8), 501), (dict(B=2, T=300, H=2), 38),
    (dict(B=1, T=0, H=2), 0), (dict(seqlens=[300], H=2), 20), (dict(seqlens=[100, 200], H=2), 21),
    (dict(seqlens=[5, 0, 3], H=4), 4), (dict(seqlens=[1, 1, 1, 1, 1], H=2), 5)])
def test_one_checkpoint_and_record_per_chunk_slot(kw, slots):
    ckpt, records = _saved(_meta_inputs(**kw))
    assert ckpt.shape == (slots, kw["H"], 128, 128)
    assert ckpt.dtype == torch.bfloat16 and ckpt.is_contiguous()
    assert records.shape == (slots, kw["H"], RECORD_FLOATS)
    assert records.dtype == torch.float32 and records.is_contiguous()


# `save` (None: the default) -> the slots of the checkpoints and of the records
# that the forward keeps (300 tokens: 19 slots).
@pytest.mark.parametrize("save,kept", [
    (None, (19, 19)), ("states_and_records", (19, 19)), ("states", (19, 0)), ("none", (0, 0))])
def test_save_argument(save, kept):
    kw = {} if save is None else {"save": save}
    ckpt, rec = _saved(_meta_inputs(B=1, T=300, H=2), **kw)
    assert ckpt.shape == (kept[0], 2, 128, 128) and rec.shape == (kept[1], 2, RECORD_FLOATS)


# The states and records of the chunked kernels' head size D, 64, 128 or 256,
# the smallest holding K and V, of the zero-padded problem (300 tokens: 19
# slots; csrc/constants.h chunked_head_size).
@pytest.mark.parametrize("K,V,kept,D", [(64, 64, 19, 64), (48, 64, 19, 64), (1, 17, 19, 64), (64, 65, 19, 128),
                                        (100, 60, 19, 128), (128, 128, 19, 128), (129, 64, 19, 256),
                                        (256, 256, 19, 256)], ids=lambda x: str(x))
def test_kept_by_head_size(K, V, kept, D):
    d = {n: (t.to(META) if t is not None else t) for n, t in make_inputs(K=K, V=V, B=1, T=300, H=2).items()}
    ckpt, rec = _saved(d)
    assert ckpt.shape == (kept, 2, D, D) and rec.shape == (kept, 2, record_floats(D))


def test_save_is_not_read_from_the_environment(monkeypatch):
    """No environment variable changes what the forward keeps: only the argument does."""
    monkeypatch.setenv("TORCH_KDA_SAVE_STATES", "0")
    monkeypatch.setenv("TORCH_KDA_SAVE_RECORDS", "0")
    ckpt, rec = _saved(_meta_inputs(B=1, T=300, H=2))
    assert ckpt.shape[0] == 19 and rec.shape[0] == 19


class TestSaveIsChecked(expecttest.TestCase):
    def test_bad_save_argument(self):
        with self.assertRaises(RuntimeError) as e:
            _saved(_meta_inputs(B=1, T=30, H=2), save="records")
        self.assertExpectedInline(str(e.exception).splitlines()[0], """kda.fwd: save must be one of 'states_and_records', 'states', 'none', got 'records'""")

    def test_bad_save_for_backward_keyword(self):
        d = make_inputs(B=1, T=30, H=2, K=16, V=16)
        with self.assertRaises(ValueError) as e:
            torch_kda.kda(*positional(d), lower_bound=-5.0, save_for_backward="all")
        self.assertExpectedInline(str(e.exception), """torch_kda.kda: save_for_backward must be one of 'states_and_records', 'states', 'none', got 'all'""")


class TestBackwardChecksCheckpoints(expecttest.TestCase):
    def setUp(self):
        self.d = make_inputs(B=1, T=40, H=2, K=128, V=128, state_dtype=torch.float32)
        self.grad_out = torch.randn_like(self.d["v"])

    def _bwd(self, checkpoints, records=None):
        d = self.d
        return torch.ops.kda.bwd(self.grad_out, None, *positional(d), lower_bound=-5.0,
                                 initial_state=d["initial_state"], checkpoints=checkpoints, records=records)

    def test_right_shape_accepted_and_not_needed_on_cpu(self):
        # 40 tokens are 3 slots.
        ckpt = torch.randn(3, 2, 128, 128).bfloat16()
        for saved in ((ckpt, None), (torch.empty(0), None), (ckpt, torch.randn(3, 2, RECORD_FLOATS)),
                      (ckpt, torch.empty(0)), (None, torch.empty(0))):
            for x, y in zip(self._bwd(*saved), self._bwd(None)):
                self.assertTrue(torch.equal(x, y))

    def test_records_without_checkpoints_rejected(self):
        with self.assertRaises(RuntimeError) as e:
            self._bwd(None, torch.randn(3, 2, RECORD_FLOATS))
        self.assertExpectedInline(str(e.exception).splitlines()[0], """kda.bwd: records were given without checkpoints: pass both, as kda._fwd_checkpointed returned them""")

    def test_records_of_wrong_shape_rejected(self):
        with self.assertRaises(RuntimeError) as e:
            self._bwd(torch.randn(3, 2, 128, 128).bfloat16(), torch.randn(3, 2, 8832))
        self.assertExpectedInline(str(e.exception).splitlines()[0], """kda.bwd: records must be what kda._fwd_checkpointed returned for the same inputs (contiguous float32 [3, 2, 6784] on q's device) or empty, got float32 [3, 2, 8832] on cpu""")

    def test_records_of_wrong_dtype_rejected(self):
        with self.assertRaises(RuntimeError) as e:
            self._bwd(torch.randn(3, 2, 128, 128).bfloat16(), torch.randn(3, 2, RECORD_FLOATS).bfloat16())
        self.assertExpectedInline(str(e.exception).splitlines()[0], """kda.bwd: records must be what kda._fwd_checkpointed returned for the same inputs (contiguous float32 [3, 2, 6784] on q's device) or empty, got bfloat16 [3, 2, 6784] on cpu""")

    def test_wrong_shape_rejected(self):
        with self.assertRaises(RuntimeError) as e:
            self._bwd(torch.zeros(2, 2, 128, 128, dtype=torch.bfloat16))
        self.assertExpectedInline(str(e.exception).splitlines()[0], """kda.bwd: checkpoints must be what kda._fwd_checkpointed returned for the same inputs (contiguous bfloat16 [3, 2, 128, 128] on q's device) or empty, got bfloat16 [2, 2, 128, 128] on cpu""")

    def test_wrong_dtype_rejected(self):
        with self.assertRaises(RuntimeError) as e:
            self._bwd(torch.zeros(3, 2, 128, 128))
        self.assertExpectedInline(str(e.exception).splitlines()[0], """kda.bwd: checkpoints must be what kda._fwd_checkpointed returned for the same inputs (contiguous bfloat16 [3, 2, 128, 128] on q's device) or empty, got float32 [3, 2, 128, 128] on cpu""")
