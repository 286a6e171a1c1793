"""What users copy from: the operator schemas docs/ARCHITECTURE.md lists must be the
registered ones, and README.md's quickstart must run (on the CPU here, where no GPU
is present)."""
import pathlib
import re

import pytest
import torch

import torch_kda  # noqa: F401  (registers torch.ops.kda.*)

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
ARCHITECTURE = (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def test_schemas_are_the_registered_ones():
    listed = {m.group(1): m.group(0) for m in re.finditer(r"^kda::(\w+)\(.*$", ARCHITECTURE, flags=re.M)}
    assert set(listed) == {"fwd", "fwd_", "fwd_pool_", "bwd"}
    for name, line in listed.items():
        assert line == str(getattr(torch.ops.kda, name).default._schema), name


@pytest.mark.slow
def test_quickstart_runs():
    code = README.split("## Quickstart", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    scope = {}
    exec(compile(code, "README quickstart", "exec"), scope)
    out, state, q = scope["out"], scope["state"], scope["q"]
    assert out.shape == q.shape and state.dtype == torch.float32
    assert torch.isfinite(out.float()).all() and torch.isfinite(q.grad.float()).all()
