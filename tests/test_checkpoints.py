"""kda._fwd_checkpointed's checkpoints (csrc/checkpoints.h), where no GPU is
needed: how many the plan makes (one per window of the CUDA backward), on Meta
tensors, and kda.bwd's check of those it is given. Their values and what the
backward does with them are tested on the GPU (tests/test_cuda.py)."""
import math

import expecttest
import pytest
import torch

import torch_kda  # noqa: F401  (registers torch.ops.kda.*)
from conftest import make_inputs, positional

META = torch.device("meta")
# Bytes of backward scratch per (chunk slot, head) (csrc/cuda/params.h): the
# record, two bf16 states (S0 and dS1) and the record's gradients.
SLOT_SCRATCH = 35328 + 2 * 128 * 128 * 2 + 8576 * 4


def _meta_inputs(**kw):
    d = make_inputs(K=128, V=128, **kw)
    return {n: (t.to(META) if t is not None else t) for n, t in d.items()}


def _checkpoints(d):
    out = torch.ops.kda._fwd_checkpointed(*positional(d), None, -5.0, d["initial_state"], False, d["cu_seqlens"])
    return out[2]


@pytest.mark.parametrize("T,H", [(8192, 32), (8192, 16), (32768, 32), (100, 96), (16 * 500 + 1, 8)])
def test_one_checkpoint_per_backward_window(T, H, monkeypatch):
    monkeypatch.delenv("TORCH_KDA_WINDOW_SLOTS", raising=False)
    ckpt = _checkpoints(_meta_inputs(B=1, T=T, H=H))
    every = max((1 << 30) // (H * SLOT_SCRATCH), 16)  # slots a window holds ~1 GiB of scratch in
    assert ckpt.shape == (math.ceil(math.ceil(T / 16) / every), H, 128, 128)
    assert ckpt.dtype == torch.float32 and ckpt.is_contiguous()


@pytest.mark.parametrize("setting", ["7", "0", "1", "300"])
def test_window_setting_does_not_move_the_checkpoints(setting, monkeypatch):
    # A forward and its backward must agree on where the checkpoints lie whatever
    # the environment between them: the plan reads shapes only.
    d = _meta_inputs(B=1, T=4000, H=96)
    monkeypatch.delenv("TORCH_KDA_WINDOW_SLOTS", raising=False)
    want = _checkpoints(d).shape
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", setting)
    assert _checkpoints(d).shape == want == (4, 96, 128, 128)  # 250 slots, windows of 82


@pytest.mark.parametrize("kw", [dict(B=2, T=300), dict(seqlens=[300]), dict(seqlens=[100, 200]), dict(B=1, T=0)])
def test_no_checkpoints_but_for_one_nonempty_fixed_length_sequence(kw, monkeypatch):
    monkeypatch.setenv("TORCH_KDA_WINDOW_SLOTS", "7")
    assert _checkpoints(_meta_inputs(H=2, **kw)).shape == (0, 2, 128, 128)


class TestBackwardChecksCheckpoints(expecttest.TestCase):
    def setUp(self):
        self.d = make_inputs(B=1, T=40, H=2, K=128, V=128, state_dtype=torch.float32)
        self.grad_out = torch.randn_like(self.d["v"])

    def _bwd(self, checkpoints):
        d = self.d
        return torch.ops.kda.bwd(self.grad_out, None, *positional(d), lower_bound=-5.0,
                                 initial_state=d["initial_state"], checkpoints=checkpoints)

    def test_right_shape_accepted_and_not_needed_on_cpu(self):
        # 40 tokens are 3 slots: one window whatever the setting but 1 or 2.
        for ckpt in (torch.randn(1, 2, 128, 128), torch.empty(0)):
            for x, y in zip(self._bwd(ckpt), self._bwd(None)):
                self.assertTrue(torch.equal(x, y))

    def test_wrong_shape_rejected(self):
        with self.assertRaises(RuntimeError) as e:
            self._bwd(torch.zeros(2, 2, 128, 128))
        self.assertExpectedInline(str(e.exception).splitlines()[0], """kda.bwd: checkpoints must be what kda._fwd_checkpointed returned for the same inputs (contiguous float32 [1, 2, 128, 128] on q's device) or empty, got float32 [2, 2, 128, 128] on cpu""")

    def test_wrong_dtype_rejected(self):
        with self.assertRaises(RuntimeError) as e:
            self._bwd(torch.zeros(1, 2, 128, 128, dtype=torch.float64))
        self.assertExpectedInline(str(e.exception).splitlines()[0], """kda.bwd: checkpoints must be what kda._fwd_checkpointed returned for the same inputs (contiguous float32 [1, 2, 128, 128] on q's device) or empty, got float64 [1, 2, 128, 128] on cpu""")
