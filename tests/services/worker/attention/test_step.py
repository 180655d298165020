"""AttentionStep (services/worker/attention/step.py): the one per-layer flow over a backend.

The backends' numbers are tested where they run whole steps: the torch backend against the
full-sequence model (test_model_runner.py), the kernel backend against it and the torch runner
(test_kernel_backend.py), the graph-safe decode form against the eager runner, bit for bit at equal
row counts and in the batch-invariant mode (test_static_decode_step.py). Here: the flow itself, its
output projection, the source check, and the rule that no worker module calls into another object's
private methods.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from model.deepseek_v41.attention import Attention
from model.deepseek_v41.presets import TINY
from model.deepseek_v41.rope import apply_rope, rope_angles, rope_turns
from services.worker.attention.backend import StepRounding
from services.worker.attention.graph_backend import GraphAttention
from services.worker.attention.step import AttentionStep
from services.worker.attention.torch_backend import TorchAttention
from services.worker.batch.static_batch import StaticBatch
from services.worker.batch.step_batch import StepBatch
from services.worker.state.cache_engine import CacheEngine, ring_size

WORKER = pathlib.Path(__file__).resolve().parents[4] / "services" / "worker"
NUM_ROWS = 5


class Recording:
    """A backend that records the step's calls and attends to zeros."""

    def __init__(self, undoes_rope: bool) -> None:
        self.undoes_rope = undoes_rope
        self.calls: list[tuple[str, int]] = []

    def compress(self, attn, x):
        self.calls.append(("compress", attn.layer))

    def select(self, attn, x, q_latent, angles):
        self.calls.append(("select", attn.layer))

    def attend(self, attn, q, k):
        self.calls.append(("attend", attn.layer))
        assert q.shape == (NUM_ROWS, attn.num_heads, attn.head_dim) and k.shape == (NUM_ROWS, attn.head_dim)
        return torch.zeros_like(q)


def _layers() -> list[Attention]:
    torch.manual_seed(0)
    return [Attention(TINY, layer) for layer in range(TINY.num_hidden_layers)]


def test_each_layer_compresses_if_a_source_selects_if_compressed_then_attends():
    layers = _layers()
    positions, requests = torch.tensor([3, 4, 5, 9, 0]), torch.tensor([0, 0, 0, 1, 2])
    seen = []

    def hook(kind, layer, x, request_ids, index):
        seen.append((kind, layer, request_ids, index.tolist()))
        return x

    backend = Recording(undoes_rope=False)
    step = AttentionStep(backend, positions, requests, StepRounding(hook, ["a", "b", "c"]))
    with torch.no_grad():
        for attn in layers:
            out = step.attend(attn, torch.randn(NUM_ROWS, TINY.hidden_size))
            assert out.shape == (NUM_ROWS, TINY.hidden_size)
    expected = []
    for attn in layers:
        expected += [("compress", attn.layer)] if attn.compressor is not None else []
        expected += [("select", attn.layer)] if attn.ratio else []
        expected.append(("attend", attn.layer))
    assert backend.calls == expected
    assert any(kind == "compress" for kind, _ in expected) and any(kind == "select" for kind, _ in expected)
    # The window K of every row goes through the hook once per layer, with its request and position.
    assert seen == [("fp8", attn.layer, ["a", "a", "a", "b", "c"], [3, 4, 5, 9, 0]) for attn in layers]


@pytest.mark.parametrize("turns", [False, True], ids=["angles", "turns"])  # what ``attend`` passes: turns
@pytest.mark.parametrize("layer", [0, 2])  # window-only, compressed
def test_project_out_of_rope_undone_output_equals_the_models(layer, turns):
    """A backend that undoes RoPE itself (the kernels) and one that leaves it to the step (torch) give
    the same projection: the step projects with angle 0 where RoPE is already undone."""
    attn = _layers()[layer]
    positions = torch.tensor([1, 7, 30, 100])
    angles = rope_angles(positions, attn.freqs)
    out = torch.randn(len(positions), attn.num_heads, attn.head_dim)
    undone = apply_rope(out, angles, inverse=True)
    given = rope_turns(angles) if turns else angles
    with torch.no_grad():
        ours = AttentionStep(Recording(undoes_rope=True), positions, positions).project_out(attn, undone, given)
        model = AttentionStep(Recording(undoes_rope=False), positions, positions).project_out(attn, out, given)
        direct = attn.project_out(out.unsqueeze(1), angles.unsqueeze(1))[:, 0]
    assert torch.equal(model, direct)
    assert torch.equal(ours, model)


def test_a_compressed_layer_without_its_source_is_refused():
    """Layer 3 reads layer 2's entries (a ratio-2 KV source): without layer 2 first, each backend says so."""
    cfg, attn = TINY, _layers()[3]
    assert attn.ratio and attn.compressor is None
    cache = CacheEngine(cfg, 16, num_blocks=4, num_state_slots=2, ring=ring_size(cfg))
    one = torch.tensor([5])
    batch = StepBatch(
        request_ids=["r0"],
        input_ids=torch.zeros(1, dtype=torch.long),
        positions=one,
        row_requests=torch.zeros(1, dtype=torch.long),
        ring_slots=one % cache.layout.ring_size,
        query_start=torch.tensor([0, 1]),
        first=one,
        seqlens_k=one + 1,
        state_slots=torch.tensor([1]),
        block_tables=torch.tensor([[1]]),
        sample_rows=torch.zeros(1, dtype=torch.long),
        entry_writes={},
    )
    static = StaticBatch(cfg, 1, 1, cache.layout.ring_size, torch.device("cpu"))
    for backend in (TorchAttention(cache, batch), GraphAttention(cache, static, None, None)):
        step = AttentionStep(backend, one, torch.zeros(1, dtype=torch.long))
        with torch.no_grad(), pytest.raises(ValueError, match="layer 3 needs a preceding KV source with ratio 2"):
            step.attend(attn, torch.randn(1, cfg.hidden_size))


def test_no_worker_module_calls_another_objects_private_method():
    """``x._name(...)`` only on ``self`` / ``cls`` in services/worker (the house rule)."""
    found = []
    for path in sorted(WORKER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name, owner = node.func.attr, node.func.value
                private = name.startswith("_") and not name.startswith("__")
                if private and not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                    found.append(f"{path.relative_to(WORKER)}:{node.lineno} {ast.unparse(node.func)}")
    assert len(list((WORKER / "attention").glob("*.py"))) >= 5  # the step, the protocol and three backends scanned
    assert not found, found
