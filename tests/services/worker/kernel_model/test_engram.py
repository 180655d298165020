"""KernelEngram (services/worker/kernel_model/engram.py): the model's Engram with its gate on ``kernels.engram_gate``,
under Triton's interpreter on CPU: against the model's torch forward, row-invariant, and the fallback."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kernels import invariance
from kernels.interpret import interpreter, load_interpreted
from model.deepseek_v41.engram import Engram
from services.worker.kernel_model.backend import convert_model
from services.worker.kernel_model.engram import KernelEngram
from services.worker.kernel_model.fp8_linear import KernelLinear
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.kernel_model.row_tiled import RowTiledEngram
from tests.kernels.test_engram_gate import _bound, _reference
from tests.services.worker.runners.test_model_runner import case

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _engram() -> Engram:
    """The oracle config's first Engram layer (random weights, q/k weights 1 ± 0.2), a copy."""
    model = case("oracle").model
    return copy.deepcopy(next(m for m in model.modules() if isinstance(m, Engram)))


def _inputs(engram: Engram, batch: int, seq: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, engram.n, engram.d, generator=gen) * 2
    rows = torch.randint(
        0,
        engram.embed.num_embeddings,
        (batch, seq, engram.wkv.in_features // engram.embed.embedding_dim),
        generator=gen,
    )
    live = torch.rand(batch, seq, generator=gen) > 0.3
    return h, rows, live


@pytest.mark.parametrize("masked", [False, True])
def test_kernel_engram_matches_the_models_forward(masked):
    """Same wkv (the model's nn.Linear), gate on the kernel: the torch forward and the kernel are each within
    the fp32 bound of the exact (float64) gate on the same key and value (tests/kernels/test_engram_gate.py,
    valid for any summation order at the tiny D = 64), so they differ by at most twice it."""
    engram = _engram()
    h, rows, live = _inputs(engram, 2, 5, 3)
    live = live if masked else None
    module = KernelEngram(engram, SimpleNamespace(engram_gate=load_interpreted("engram_gate")))
    with interpreter():
        got = module(h, rows, live)
    want = engram(h, rows, live)
    key, value = (t.detach().reshape(10, -1) for t in engram.project(h, rows))
    h2, live2 = h.reshape(10, engram.n, engram.d), None if live is None else live.reshape(10)
    _, mass, dot, gate = _reference(h2, key, value, engram.q_weight.detach(), engram.k_weight.detach(), live2)
    bound = _bound(h2, value, mass, dot, gate).view(got.shape)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.all((got - want).abs() <= 2 * bound)
    if masked:  # dead tokens: h through, bit for bit, in both
        assert torch.equal(got[~live], h[~live]) and torch.equal(want[~live], h[~live])


def test_converted_engram_rows_are_equal_alone_and_in_a_batch():
    """Converted (FP8 KernelLinear wkv, the gate kernel), in the batch-invariant mode: each token's output
    bits alone equal its bits inside a [3, 7] batch, with no row tiling of the gate."""
    holder = nn.ModuleDict({"engram": _engram()})
    convert_model(holder, "fp8", KernelSet(*(load_interpreted(name) for name in KernelSet.NAMES), interpreted=True))
    module = holder["engram"]
    assert isinstance(module, KernelEngram) and isinstance(module.engram.wkv, KernelLinear)
    h, rows, live = _inputs(module.engram, 3, 7, 5)
    with interpreter(), invariance.fixed_configs(), torch.no_grad():
        batch = module(h, rows, live)
        for b, s in ((0, 0), (1, 4), (2, 6)):
            one = module(h[b : b + 1, s : s + 1], rows[b : b + 1, s : s + 1], live[b : b + 1, s : s + 1])
            assert torch.equal(one[0, 0], batch[b, s])


def test_kernel_sets_without_the_gate_keep_the_row_tiled_torch_engram():
    """``KernelSet.references()`` has no ``engram_gate``: Engram stays torch, row-tiled in the mode."""
    holder = nn.ModuleDict({"engram": _engram()})
    convert_model(holder, "fp8", KernelSet.references())
    assert isinstance(holder["engram"], RowTiledEngram)
