"""benchmarks/bench_fwd.py's CUDA-graph helper keeps alive what the graph writes into.

torch_kda.fwd writes into the caller's out and final_state, which bench_fwd's closure
allocates outside the graph's private pool. Were `graphed` to return the bare
`graph.replay`, the closure (the buffers' last owner) would be freed while the replays still
write into its buffers; with fla's graph captured next that faulted at 8192 x 32 heads. The CUDA parts are stood in for
here, so the test runs on any machine: it checks the ownership, not the fault.
"""
import contextlib
import gc
import os
import sys
import weakref

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_fwd  # noqa: E402


class _Stream:
    def wait_stream(self, other):
        pass


class _Graph:
    """Records the function run under capture; a replay runs it again."""

    captured = None

    def replay(self):
        _Graph.captured()


def _fake_cuda(monkeypatch, capturing):
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(_Graph, "captured", None)  # no capture carried over from another test

    @contextlib.contextmanager
    def graph(g):
        capturing["on"] = True
        yield
        capturing["on"] = False

    monkeypatch.setattr(torch.cuda, "graph", graph)


def test_graphed_replay_keeps_the_callers_buffers(monkeypatch):
    capturing = {"on": False}
    _fake_cuda(monkeypatch, capturing)
    src = torch.randn(64)

    def make_fn():
        out = torch.full((64,), float("nan"))  # as run_torch_kda: the closure owns out

        def fn():
            if capturing["on"]:
                # A real graph keeps out's address, not a reference: so a weak one here.
                target = weakref.ref(out)
                _Graph.captured = lambda: target().copy_(src * 2)
            out.copy_(src * 2)

        return fn, weakref.ref(out)

    fn, out_ref = make_fn()
    replay, ok = bench_fwd.graphed(fn, "test")
    del fn
    gc.collect()
    assert ok
    out = out_ref()
    assert out is not None, "the replay no longer holds the buffers its graph writes"
    out.fill_(float("nan"))
    replay()
    torch.testing.assert_close(out, src * 2, rtol=0, atol=0)
