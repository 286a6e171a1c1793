"""benchmarks/fla_warm.py: the workers' shares of each autotuned kernel's
configurations cover every configuration the call may run, each once where
there are enough workers (but the smallest, which every share holds as the one
likeliest to fit). Triton's autotuner is a stand-in with the method fla_warm narrows."""
import importlib
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def stand_in_triton(monkeypatch):
    """A fresh `triton.runtime.autotuner.Autotuner` whose prune_configs drops the
    configurations marked `dropped` (the real one may drop some by the call's
    sizes; fla_warm narrows what it keeps)."""

    class Autotuner:
        def __init__(self, configs):
            self.configs = configs

        def prune_configs(self, kwargs, nargs=None):
            return [c for c in self.configs if not getattr(c, "dropped", False)]

    autotuner = types.ModuleType("triton.runtime.autotuner")
    autotuner.Autotuner = Autotuner
    runtime = types.ModuleType("triton.runtime")
    runtime.autotuner = autotuner
    triton = types.ModuleType("triton")
    triton.runtime = runtime
    for name, module in (("triton", triton), ("triton.runtime", runtime), ("triton.runtime.autotuner", autotuner)):
        monkeypatch.setitem(sys.modules, name, module)
    return Autotuner


class Config:
    """As triton.Config: tile sizes in kwargs, stages, warps."""

    def __init__(self, num_stages, num_warps, **kwargs):
        self.num_stages, self.num_warps, self.kwargs = num_stages, num_warps, kwargs

    def __repr__(self):
        return f"Config({self.num_stages}, {self.num_warps}, {self.kwargs})"


@pytest.mark.parametrize("workers", [1, 3, 12])
@pytest.mark.parametrize("count", [1, 5, 12, 24])
def test_shares_cover_every_configuration(monkeypatch, workers, count):
    fla_warm = importlib.import_module("fla_warm")
    # Stages 4, 3, 2 and tiles 64, 32 over the list: the smallest is not first.
    configs = [Config(4 - i % 3, 4, BK=64 if i % 2 else 32) for i in range(count)]
    smallest = min(configs, key=lambda c: (c.num_stages, c.kwargs["BK"]))
    pruned = Config(1, 1, BK=16)  # smaller than all, but not the call's to run
    pruned.dropped = True
    shares = []
    for index in range(workers):
        Autotuner = stand_in_triton(monkeypatch)
        fla_warm._narrowed(index, workers)
        share = Autotuner(configs + [pruned]).prune_configs({}, {})
        assert smallest in share, f"worker {index} of {workers}: no fallback that fits"
        assert pruned not in share
        shares.append(share)
    compiled = [c for share in shares for c in share]
    assert {id(c) for c in compiled} == {id(c) for c in configs}
    if count >= workers:
        others = [c for c in compiled if c is not smallest]
        assert len(others) == count - 1, "a configuration besides the smallest compiled twice"
