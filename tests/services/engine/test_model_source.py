"""weights_identity: what engine and worker compare instead of the weights' bytes."""

import torch

from model.deepseek_v41.safetensors_io import write_checkpoint
from services.engine.model_source import weights_identity


def test_identity_follows_the_headers_and_the_seed(tmp_path):
    a = tmp_path / "a"
    write_checkpoint({"x": torch.zeros(4, 4), "y": torch.ones(3)}, a, max_shard_bytes=64)
    first = weights_identity(str(a), 0, "auto")
    assert first.startswith("checkpoint ") and first == weights_identity(str(a), 5, "auto")
    b = tmp_path / "b"
    write_checkpoint({"x": torch.zeros(4, 4), "y": torch.ones(4)}, b, max_shard_bytes=64)  # one shape differs
    assert weights_identity(str(b), 0, "auto") != first
    assert weights_identity("tiny", 0, "auto") != weights_identity("tiny", 1, "auto")
    assert weights_identity(str(a), 0, "dummy") == "random dummy seed 0"
