"""The DSpark draft's block attention kernel vs its torch form (``DraftAttention``'s maths: the model's
``apply_rope``, ``fake_quant_fp8_e4m3``, ``sink_attention`` and inverse RoPE), interpreted on CPU and compiled
on a GPU; and its batch invariance (a block's output whatever blocks share the launch)."""

from __future__ import annotations

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from model.deepseek_v41.attention import sink_attention
from model.deepseek_v41.quant import fake_quant_fp8_e4m3
from model.deepseek_v41.rope import apply_rope, rope_turns
from tests.tolerances import FP32_REORDER_REL

# (blocks N, slots S, heads H, head_dim, rope pairs P, window W): tiny's draft (hd 64, P 8, W 8, bs 5);
# rotated pairs over two FP8 blocks; a window of three key tiles, the last partial; no window at all.
SHAPES = [
    (3, 5, 4, 64, 8, 8),
    (2, 7, 2, 128, 32, 20),
    (2, 5, 2, 64, 8, 150),
    (2, 3, 2, 64, 8, 0),
    (1, 5, 2, 256, 16, 40),
]  # the last: a wide head, 32-key tiles (V41's), one partial


def _problem(n, s, h, hd, p, w, gen, device="cpu"):
    q = torch.randn(n, s, h, hd, generator=gen).to(device)
    # Own keys with 32-channel blocks at scales 2^-6 … 2^6, so the FP8 rounding's scale varies per block.
    own = torch.randn(n, s, hd, generator=gen) * 2.0 ** torch.randint(
        -6, 7, (n, s, hd // 32), generator=gen
    ).float().repeat_interleave(32, -1)
    window = fake_quant_fp8_e4m3(torch.randn(n, w, hd, generator=gen))  # the ring holds FP8-rounded entries
    visible = torch.rand(n, w, generator=gen) < 0.7
    if w:
        visible[0] = False  # a block with no visible context entry: only its own keys and the sink
    positions = torch.randint(0, 5000, (n, 1), generator=gen) + torch.arange(s)
    freqs = 1.0 / (10000.0 ** (torch.arange(0, 2 * p, 2).float() / (2 * p)))
    turns = rope_turns(positions.float().unsqueeze(-1) * freqs)  # complex64 [N, S, P]
    sink = torch.randn(h, generator=gen)
    return [t.to(device) for t in (q, own.to(device), window, visible, turns, sink)]


def _reference(q, own, window, visible, turns, sink, scale):
    """``DraftAttention.forward`` between the projections, on blocks of one row each."""
    n, s = own.shape[:2]
    q = apply_rope(q, turns)
    keys = torch.cat((window.to(own.dtype), fake_quant_fp8_e4m3(apply_rope(own, turns))), dim=1)  # [N, W + S, hd]
    allowed = torch.cat((visible, visible.new_ones(n, s)), dim=-1).unsqueeze(1).expand(-1, s, -1)
    return apply_rope(sink_attention(q, keys, allowed, sink, scale), turns, inverse=True)


def _run(module, q, own, window, visible, turns, sink, scale):
    return module.draft_attention(q, own, window, visible, torch.view_as_real(turns), sink, scale)


@pytest.mark.parametrize(("n", "s", "h", "hd", "p", "w"), SHAPES)
def test_draft_attention_interpreted_matches_torch(n, s, h, hd, p, w):
    """The RoPE products and the FP8 rounding are the torch form's operations (bit-identical under the
    interpreter, kernels/rmsnorm.py ``_rotate``, kernels/window_write.py), so only the fp32 order of the
    head_dim-term dots and the (W + S + 1)-term softmax sums differs: FP32_REORDER_REL of the largest output."""
    args = _problem(n, s, h, hd, p, w, torch.Generator().manual_seed(n * hd + w))
    scale = hd**-0.5
    want = _reference(*args, scale)
    with interpreter():
        got = _run(load_interpreted("draft_attention"), *args, scale)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert float((got - want).abs().max()) <= FP32_REORDER_REL * float(want.abs().max())


def test_draft_attention_is_batch_invariant():
    """A block's output is the same bits alone, among other blocks, and at another place in the launch: one
    program per (block, head) reads its own block only, with tiles fixed by (W, S, head_dim)."""
    args = _problem(4, 5, 4, 64, 8, 8, torch.Generator().manual_seed(7))
    module = load_interpreted("draft_attention")
    with interpreter():
        every = _run(module, *args, 0.125)
        for i in range(4):
            alone = _run(module, *[t[i : i + 1] if t.ndim > 1 else t for t in args], 0.125)
            assert torch.equal(alone[0], every[i])
        flipped = _run(module, *[t.flip(0) if t.ndim > 1 else t for t in args], 0.125)
    assert torch.equal(flipped.flip(0), every)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("n", "s", "h", "hd", "p", "w"), SHAPES + [(8, 16, 64, 512, 32, 128)])
def test_gpu_draft_attention_matches_torch(n, s, h, hd, p, w):
    """Compiled, against the torch form on the same GPU (V41's draft shape last: 64 heads × 512, P 32, W 128).
    A fused multiply-add in the RoPE can move a rotated key by an ulp, which crosses an FP8 rounding boundary
    with probability ~2^-20 per element: at V41's shape (4.2M key elements) a few keys move by an e4m3 step,
    and on the H200 one output element then differed by 1.6e-5 of the largest (above the elementwise fp32
    bound). So the bound is on the relative Frobenius error, which a few moved elements barely change."""
    from kernels import draft_attention

    args = _problem(n, s, h, hd, p, w, torch.Generator().manual_seed(n * hd + w), "cuda")
    scale = hd**-0.5
    want = _reference(*args, scale)
    got = _run(draft_attention, *args, scale)
    assert float((got - want).norm() / want.norm()) <= FP32_REORDER_REL
    alone = _run(draft_attention, *[t[:1] if t.ndim > 1 else t for t in args], scale)
    assert torch.equal(alone[0], got[0])
