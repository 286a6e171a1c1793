"""examples/generate.py on the CPU: a tiny model prefills prompts of different
lengths into per-layer KDACaches and decodes; the script itself checks the decoded
logits against a full forward and exits non-zero if they differ."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import generate  # noqa: E402


def test_generate_on_cpu(capsys):
    generate.main(["--device", "cpu", "--new-tokens", "8", "--prompts", "5,0,12", "--layers", "2", "--dim", "64"])
    out = capsys.readouterr().out
    assert "All checks passed." in out and "relative error" in out


def test_generate_check_can_fail(monkeypatch):
    """A cache slot reused by two requests breaks the decode: the script's check notices."""
    import torch

    real = torch.randperm

    def colliding(n, *args, **kw):
        return torch.zeros_like(real(n, *args, **kw))

    monkeypatch.setattr(torch, "randperm", colliding)
    with pytest.raises(SystemExit, match="do not match"):
        generate.main(["--device", "cpu", "--new-tokens", "4", "--prompts", "5,9", "--layers", "1", "--dim", "64"])
