"""The built extension's machine code, read without a GPU: the decode kernel
(csrc/cuda/pool.cu) is bound by the state's bytes, and a state store that the
compiler splits into narrower stores costs it a large share of the copy
bandwidth. Fails unless every pool_decode_kernel instance for 128-wide heads
stores the state in 16-byte stores (STG.E.128) and no wider store than its
outputs' 2-byte ones is split. Needs a CUDA build and cuobjdump (the CUDA toolkit's, or the one Triton
ships), not a GPU."""
import glob
import os
import re
import shutil
import subprocess

import pytest

import torch_kda

pytestmark = pytest.mark.skipif(not torch_kda.cuda_built(), reason="the CUDA kernels exist in CUDA builds")


def cuobjdump():
    candidates = [shutil.which("cuobjdump")]
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    candidates.append(os.path.join(home, "bin", "cuobjdump"))
    try:
        import triton

        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    for c in candidates:
        if c and os.path.exists(c):
            return c
    pytest.fail("no cuobjdump (CUDA toolkit or Triton's) to read the extension's SASS with")


def kernel_sass(name_part):
    """{mangled kernel name: its SASS lines} for the extension's kernels whose name has name_part."""
    (lib,) = glob.glob(os.path.join(os.path.dirname(torch_kda.__file__), "_C*.so"))
    text = subprocess.run([cuobjdump(), "-sass", lib], capture_output=True, text=True, check=True).stdout
    kernels, current = {}, None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = m.group(1) if name_part in m.group(1) else None
            if current:
                kernels[current] = []
        elif current:
            kernels[current].append(line)
    return kernels


def store_widths(lines):
    """The global stores' kinds (STG.E.128, STG.E.U16, ...) in SASS lines."""
    return [m.group(0) for line in lines for m in [re.search(r"\bSTG(\.[A-Z0-9]+)*", line)] if m]


def test_decode_kernels_store_the_state_in_16_byte_stores():
    kernels = kernel_sass("pool_decode_kernel")
    # Template arguments: fp32 pool, speculative, narrow (a pool of head sizes below
    # 128, read and written element by element: rows need not be 16-byte aligned).
    narrow = {name: re.search(r"pool_decode_kernelILb[01]ELb[01]ELb([01])E", name) for name in kernels}
    assert all(narrow.values()), f"unexpected decode kernel names: {list(kernels)}"
    full = {name: lines for name, lines in kernels.items() if narrow[name].group(1) == "0"}
    assert len(kernels) == 8 and len(full) == 4, (
        f"expected eight decode instances (pool dtype x speculative x narrow), got {list(kernels)}")
    for name, lines in full.items():
        stores = store_widths(lines)
        assert "STG.E.128" in stores, name
        split = sorted({s for s in stores if s not in ("STG.E.128", "STG.E.U16")})
        assert not split, f"{name}: state stores split into {split}"
