"""The CUDA path's automatic choices (csrc/cuda/heuristics.cpp) for the benchmark's
cases on a 132-SM GPU (H100, H200), read through kda_testing::forward_plan and backward_plan:
host logic, so a CUDA build checks them without a GPU. The expected values follow the rules the heuristics'
comments state (docs/performance-notes.md has the counts behind them)."""
import pytest
import torch

import torch_kda
from torch_kda.testing import forced

pytestmark = pytest.mark.skipif(not torch_kda.cuda_built(), reason="the heuristics exist in CUDA builds")

SMS = 132


def plan(lengths, H, bf16_state=True, kept_records=False, D=128):
    """One length: a fixed-length call; several: varlen, as bench_fwd.py runs them."""
    return tuple(torch.ops.kda_testing.forward_plan(len(lengths), sum(lengths), len(lengths) > 1, H, SMS,
                                                    bf16_state, kept_records, D))


def backward_plan(lengths, H, D, bf16_state=False):
    """The backward's (K2 shape, dS shape) on a device of 80 GiB."""
    return tuple(torch.ops.kda_testing.backward_plan(len(lengths), sum(lengths), len(lengths) > 1, H, SMS,
                                                     bf16_state, D, 80 << 30))[:2]


@pytest.mark.parametrize("lengths, H, expected", [
    # (K2 block, late copies, window in slots, segments); the segments as measured
    # on an H100 (benchmarks/bench_segments.py, docs/performance-notes.md)
    ([65536], 16, ("4x1w", False, 4096, 8)),          # case 12: 16 pairs, bf16 products: 8 segments of 512 chunks
    ([262144], 8, ("4x1w", False, 16384, 16)),        # case 13: 8 pairs: 16 segments, 128 pairs
    ([131072], 8, ("4x1w", False, 8192, 16)),         # 8 pairs
    ([524288], 8, ("4x1w", False, 32768, 16)),        # 8 pairs, 7 GB of records: within the 8 GiB
    ([65536], 8, ("4x1w", False, 4096, 16)),          # 8 pairs, segments of 256 chunks
    ([32768], 8, ("4x1w", False, 2048, 8)),           # 8 pairs: 256 chunks cap it at 8 segments
    ([262144], 4, ("4x1w", False, 16384, 32)),        # 4 pairs: 32 segments
    ([1048576], 2, ("4x1w", False, 65536, 32)),       # 2 pairs: at most 32 segments
    ([131072] * 2, 8, ("4x1w", False, 16386, 8)),     # windows of one sequence: 8 pairs at once, 128 after
    ([65536] * 3, 4, ("4x1w", False, 12291, 16)),     # windows of one sequence: 4 pairs at once
    ([32768] * 4, 8, ("4x1w", False, 8196, 4)),       # windows of two sequences: 16 pairs at once, 128 after
    ([131072], 12, ("4x1w", False, 8192, 16)),        # 12 pairs, bf16 products
    ([131072], 16, ("4x1w", False, 8192, 8)),         # 16 pairs, bf16 products
    ([32768], 16, ("2x2", False, 2048, 1)),           # 16 pairs: 4 segments of 512 chunks would gain only 4x
    ([8192], 16, ("2x2", False, 512, 1)),             # case 7: too short
    ([32768], 32, ("2x2", False, 1024, 1)),           # case 10: 32 pairs
    ([65536] * 4, 16, ("4x1w", False, 16388, 1)),     # case 14: 64 pairs
    ([65536] + [512] * 63, 32, ("4x1w", True, 6176, 1)),  # case 15: many pairs
    ([8192], 96, ("4x1w", False, 512, 1)),            # case 1: 192 blocks, short of three an SM: no late copies
])
def test_benchmark_cases(lengths, H, expected):
    assert plan(lengths, H) == expected


@pytest.mark.parametrize("lengths, H, expected", [
    ([65536], 16, ("4x4", False, 2048, 1)),           # case 12: 16 pairs never gained with fp32 states
    ([131072], 12, ("4x4", False, 2731, 1)),          # 12 pairs: nor here
    ([262144], 8, ("4x1w", False, 16384, 16)),        # case 13: 8 pairs
    ([32768] * 4, 8, ("2x2", False, 4098, 1)),        # 16 pairs at once
])
def test_fp32_state_cases(lengths, H, expected):
    assert plan(lengths, H, bf16_state=False) == expected


def test_segments_need_their_workspace_in_one_pass():
    # 2^21 tokens on 8 heads: a one-pass workspace of 28 GB, past the segments' 8 GiB.
    _, _, window, segments = plan([1 << 21], 8)
    assert segments == 1 and window < (1 << 21) // 16
    # With the records kept for the backward the same choice (so that torch_kda.kda
    # gives the same bits with and without a gradient), in one pass.
    assert plan([1 << 21], 8, kept_records=True)[2:] == ((1 << 21) // 16, 1)
    assert plan([262144], 8, kept_records=True)[3] == 16


def test_the_hook_overrides():
    with forced(window_slots=0):
        assert plan([65536], 16)[2:] == (4096, 1)  # a forced window keeps the windowed path
    with forced(segments=2):
        assert plan([8192], 16)[3] == 2
    with forced(segments=1):
        assert plan([65536], 16)[3] == 1
    with forced(window_slots=4, segments=2):
        assert plan([65536], 16)[2:] == (4096, 2)  # forced segments run in one pass


def test_fp32_state_takes_the_4x4_at_one_warp_an_sm():
    assert plan([8192], 16, bf16_state=False)[0] == "4x4"


@pytest.mark.parametrize("D, H, bf16_state, expected", [
    (64, 32, False, "2x2"),   # at 64 the 2x2 at every shape and state timed
    (64, 96, True, "2x2"),
    (256, 32, False, "16x4"),  # at 256 four row groups a block with an fp32 state (H100: -31 to -36 %)
    (256, 8, False, "16x4"),
    (256, 32, True, "8x4"),    # and two with bf16 products (-14 to -22 %)
])
def test_k2_block_away_from_128(D, H, bf16_state, expected):
    assert plan([8192], H, bf16_state=bf16_state, D=D)[0] == expected


@pytest.mark.parametrize("D, lengths, H, expected", [
    (64, [8192], 96, "4x1"),     # three row groups an SM and more: full-width warps
    (64, [8192], 32, "2x2"),     # one
    (128, [8192], 96, "4x1"),
    (128, [8192], 32, "4x2"),    # two
    (256, [8192], 32, "8x2"),    # at 256 more than two: the 8x2 (H100: the step -1.6 to -2.8 %)
    (256, [1024] * 8, 32, "8x2"),
    (256, [8192], 96, "8x2"),
    (256, [8192], 16, "4x2"),    # two: not timed against the 8x2
    (256, [32768], 8, "2x2"),    # one: the 8x2 +23-26 %
])
def test_ds_block_by_row_groups_an_sm(D, lengths, H, expected):
    k2, ds = backward_plan(lengths, H, D)
    assert ds == expected and k2 == plan(lengths, H, bf16_state=False, D=D)[0]


@pytest.mark.parametrize("lengths, H, expected", [
    # (window in slots, segments a window); measured on an H100 (docs/performance-notes.md,
    # "The backward's segments"): near 32 chains (sequences x heads) after the cut, 32
    # chunks a segment for every head, windows of at least 1,024 chunks; a lone
    # sequence, the backward's ms one pass -> cut
    ([1048576], 2, (4228, 16)),   # 16 windows, 16 segments: 60.6 -> 25.1
    ([131072], 4, (2114, 8)),     # 9.46 -> 6.08
    ([262144], 8, (1057, 4)),     # case 13: 24.2 -> 22.0
    ([131072], 8, (1057, 4)),     # 12.3 -> 11.2
    ([32768], 8, (1057, 4)),      # 3.35 -> 3.13
    ([16384], 2, (1024, 16)),     # 1.39 -> 0.98
    ([8192], 4, (512, 1)),        # one pass of 512 chunks: cut into 4, 0.80 -> 0.94
    ([65536], 16, (528, 1)),      # 16 heads: 9.23 -> 10.88 at P = 2
    # A batch in one pass: every sequence cut, by the chains (sequences x heads) and the
    # sequences' average length; the backward's ms one pass -> cut.
    ([65536] * 2, 2, (8194, 8)),        # 5.01 -> 3.20
    ([65536] * 4, 2, (16388, 4)),       # 6.36 -> 5.52
    ([131072] * 2, 4, (16386, 4)),      # 12.37 -> 10.28
    ([32768] * 2, 4, (4098, 4)),        # 3.40 -> 3.20
    ([16384] * 4, 2, (4100, 4)),        # 1.90 -> 1.84
    ([8192] * 2, 4, (1026, 1)),         # 512 chunks a sequence
    ([65536] * 2, 8, (8194, 1)),        # 16 chains: 9.05 -> 10.47 at P = 2
])
def test_backward_segments_for_few_chains(lengths, H, expected):
    got = torch.ops.kda_testing.backward_plan(len(lengths), sum(lengths), len(lengths) > 1, H, SMS, False, 128,
                                              80 << 30)
    assert tuple(got[2:]) == expected
    with forced(segments=1):
        assert torch.ops.kda_testing.backward_plan(len(lengths), sum(lengths), len(lengths) > 1, H, SMS, False, 128,
                                                   80 << 30)[3] == 1


def test_plans_refuse_unserved_head_sizes():
    for D in (0, 100, 512, (1 << 32) + 128):
        with pytest.raises(RuntimeError, match=rf"head_size must be a size the chunked kernels serve .* got {D}"):
            plan([8192], 8, D=D)
