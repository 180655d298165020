"""The specialisation-key counter (tests/kernels/spec_keys.py) on an interpreted kernel: the keys Triton would
compile, so a step-sized argument marked ``do_not_specialize`` adds none, and anything specialised does."""

from __future__ import annotations

import torch

from kernels.interpret import interpreter, load_interpreted
from tests.kernels.spec_keys import SpecKeys

NAME = "kernels.rmsnorm._rmsnorm_kernel"


def _norm(rows: int, channels: int, keys: SpecKeys) -> None:
    k = load_interpreted("rmsnorm")
    x = torch.randn(rows, channels)
    with interpreter(), keys:
        k.rmsnorm(x, torch.ones(channels), 1e-6)


def test_row_counts_add_no_key_and_strides_and_blocks_do():
    keys = SpecKeys()
    for rows in (1, 2, 16, 17, 33):  # num_rows is do_not_specialize: 1, 16 and 17 rows share one variant
        _norm(rows, 32, keys)
    assert keys.counts() == {NAME: 1} and keys.num_launches == 5
    seen = keys.snapshot()
    _norm(3, 24, keys)  # BLOCK_C 32 again, but a row stride of 24: not divisible by 16
    _norm(3, 64, keys)  # BLOCK_C 64
    new = keys.new_since(seen)[NAME]
    assert len(new) == 2 and keys.counts() == {NAME: 3}
    stride = [dict(zip(("type", "property"), entry)) for entry in (key[0][7] for key in new)]  # x_row_stride
    assert {s["property"] for s in stride} == {"", "D"}  # 24: no property; 64: divisible by 16
    assert any(("constexpr", 64) in key[0] for key in new)
    assert keys.new_since(keys.snapshot()) == {}


def test_the_counter_leaves_triton_as_it_was():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    before = InterpretedFunction.run, JITFunction.run
    with SpecKeys():
        assert InterpretedFunction.run is not before[0]
    assert (InterpretedFunction.run, JITFunction.run) == before
