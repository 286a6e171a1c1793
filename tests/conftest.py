"""Shared fixtures and helpers of the torch_kda test suite.

The reference is torch_kda.naive: the recurrence token by token in float64,
which shares no code with the kernels it checks (`reference_kda`, `run_reference`
here; tests/test_reference.py checks it against second formulations).

Every test draws fresh random inputs from a seed derived from its node id:
inputs differ between tests, and a failing test reproduces exactly.
"""
import contextlib
import math
import zlib

import pytest
import torch

from torch_kda.naive import kda_naive as reference_kda


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped where none is present)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on two CPU cores")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def seed_for(nodeid):
    return zlib.crc32(nodeid.encode())


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """A different, reproducible seed for every test (parametrisations included)."""
    seed = seed_for(request.node.nodeid)
    torch.manual_seed(seed)
    return seed


# --------------------------------------------------------------------------
# Random inputs.
# --------------------------------------------------------------------------

INPUT_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


def record_floats(D):
    """A record's fp32 elements at head size D (csrc/constants.h record_bytes): six
    [16][D] bf16 planes, D fp32 decays, four [16][16] bf16 planes."""
    return (6 * 16 * D * 2 + D * 4 + 4 * 16 * 16 * 2) // 4


RECORD_FLOATS = record_floats(128)  # 27,136 bytes at the default head size


def make_inputs(
    B=2,
    T=9,
    H=2,
    K=4,
    V=3,
    *,
    dtype=torch.float32,
    seqlens=None,
    cu_dtype=torch.int64,
    state_dtype=None,
    param_dtype=None,
    requires_grad=False,
    HV=None,
):
    """Fresh random inputs: q, k, v, g ~ N(0, 1), beta logits ~ N(0, 1),
    A_log, dt_bias ~ U(0, 1), initial_state ~ N(0, 1) when state_dtype is given.
    A_log and dt_bias are float32 (float64 when dtype is float64) unless param_dtype says.
    HV: grouped value heads (v, g, beta, A_log, dt_bias and the state have HV, q
    and k H); None for HV = H.

    seqlens (a list of lengths) packs sequences along T with B = 1 and sets cu_seqlens.
    Returns a dict with keys q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens.
    """
    if param_dtype is None:
        param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if seqlens is not None:
        B, T = 1, sum(seqlens)
        cu = torch.tensor([0] + list(seqlens), dtype=torch.int64).cumsum(0).to(cu_dtype)
        N = len(seqlens)
    else:
        cu = None
        N = B
    HV = H if HV is None else HV
    d = {
        "q": torch.randn(B, T, H, K, dtype=torch.float64).to(dtype),
        "k": torch.randn(B, T, H, K, dtype=torch.float64).to(dtype),
        "v": torch.randn(B, T, HV, V, dtype=torch.float64).to(dtype),
        "g": torch.randn(B, T, HV, K, dtype=torch.float64).to(dtype),
        "beta": torch.randn(B, T, HV, dtype=torch.float64).to(dtype),
        "A_log": torch.rand(HV, dtype=torch.float64).to(param_dtype),
        "dt_bias": torch.rand(HV, K, dtype=torch.float64).to(param_dtype),
        "initial_state": None,
        "cu_seqlens": cu,
    }
    if state_dtype is not None:
        d["initial_state"] = torch.randn(N, HV, V, K, dtype=torch.float64).to(state_dtype)
    if requires_grad:
        for name in INPUT_NAMES + ("initial_state",):
            if d[name] is not None:
                d[name].requires_grad_(True)
    return d


def positional(d):
    """The seven positional tensors of kda() / torch.ops.kda.fwd."""
    return tuple(d[name] for name in INPUT_NAMES)


def run_reference(d, **kwargs):
    return reference_kda(
        *positional(d), initial_state=d["initial_state"], cu_seqlens=d["cu_seqlens"], **kwargs
    )


def rel(x, ref):
    """||x - ref|| / ||ref|| over the whole tensor, in float64."""
    ref = ref.detach().to(torch.float64)
    x = x.detach().to(torch.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    denom = torch.linalg.vector_norm(ref).item()
    assert denom > 0 and math.isfinite(denom), "degenerate reference: the comparison could not fail"
    return torch.linalg.vector_norm(x - ref).item() / denom


def nan_like(t):
    return torch.full_like(t, float("nan"))


@contextlib.contextmanager
def nan_filled_empty():
    """Every tensor that torch allocates uninitialised inside the block (at::empty in
    the ops' C++ too: their outputs and scratch) is filled with NaN first, through
    torch's deterministic mode, so that an element no kernel writes shows."""
    det = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(det)


def fla_chunk_kda(x, lower_bound):
    """fla's chunk_kda on the inputs x (gate, L2 norm and beta sigmoid in its
    kernel, the state V-first, dt_bias flat [H * K] as it takes it, its initial
    state fp32). Its safe_gate is its bounded gate, which it refuses with the
    softplus gate (lower_bound=None)."""
    import os

    os.environ.setdefault("FLA_FLASH_KDA", "0")
    fla_kda = pytest.importorskip("fla.ops.kda")
    init = x["initial_state"].float() if x["initial_state"] is not None else None
    return fla_kda.chunk_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"],
        initial_state=init,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        safe_gate=lower_bound is not None,
        lower_bound=lower_bound,
        state_v_first=True,
        A_log=x["A_log"],
        dt_bias=x["dt_bias"].flatten(),
        cu_seqlens=x["cu_seqlens"],
    )


def capture_graph(step):
    """A CUDA graph of step() (warmed up once on a side stream, as capture wants),
    and what step returned during the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs
