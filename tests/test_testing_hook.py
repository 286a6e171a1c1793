"""The testing hook's own rules (torch_kda.testing.forced, kda_testing::force and
kda_testing::forced, kda_testing::force_segments), which need a CUDA build but no
GPU: nesting restores the settings it found, an inner block sets all four of its
own, bad values raise before anything is set."""
import pytest
import torch

import torch_kda
from torch_kda.testing import forced

pytestmark = pytest.mark.skipif(not torch_kda.cuda_built(), reason="the hook exists in CUDA builds")

AUTO = ("auto", "auto", -1)


def now():
    return tuple(torch.ops.kda_testing.forced())


def test_nested_blocks_restore_what_they_found():
    assert now() == AUTO
    with forced("4x4", window_slots=3):
        assert now() == ("4x4", "auto", 3)
        with forced(ds_block="4x2"):
            assert now() == ("auto", "4x2", -1)
        assert now() == ("4x4", "auto", 3)
    assert now() == AUTO


@pytest.mark.parametrize("kw, error", [
    (dict(window_slots="three"), TypeError), (dict(window_slots=True), TypeError), (dict(window_slots=2.5), TypeError),
    (dict(window_slots=-2), ValueError), (dict(recurrence_block="8x1"), RuntimeError),
    (dict(ds_block="1x1"), RuntimeError),
])
def test_a_bad_value_sets_nothing(kw, error):
    with forced("2x2", "4x1", 7, segments=3):
        with pytest.raises(error):
            with forced(**{"recurrence_block": "4x4", "segments": 5, **kw}):
                pass
        assert now() == ("2x2", "4x1", 7)
        assert torch.ops.kda_testing.forced_segments() == 3
    assert now() == AUTO
    assert torch.ops.kda_testing.forced_segments() == -1


def test_none_means_automatic():
    with forced(None, None, None):
        assert now() == AUTO
