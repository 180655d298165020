"""FP8 / MXFP4 / FP4 formats: hand-built bit layouts, scale rules, round trips, and NeMo agreement."""

from types import SimpleNamespace

import pytest
import torch

from model.deepseek_v41 import quant as Q
from model.deepseek_v41.safetensors_io import read_checkpoint, write_checkpoint


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Per-row magnitudes spread over decades, so scales differ between blocks.
    return torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-3, 3, (*shape[:-1], 1), generator=g)


# ---------------------------------------------------------------- codecs


def test_e2m1_rounding_table_ties_to_even_and_saturation():
    x = torch.tensor([0.0, 0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 1e9, -0.25, -0.3, -6.5])
    expected = [0, 0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 8, 9, 15]
    assert Q.encode_e2m1(x).tolist() == expected
    assert Q.decode_e2m1(torch.arange(16, dtype=torch.uint8)).tolist() == [
        0,
        0.5,
        1,
        1.5,
        2,
        3,
        4,
        6,
        -0.0,
        -0.5,
        -1,
        -1.5,
        -2,
        -3,
        -4,
        -6,
    ]


def test_pack_fp4_even_index_in_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0, 7, 9]], dtype=torch.uint8)
    packed = Q.pack_fp4(codes)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x21, 0x0F, 0x97]]
    assert torch.equal(Q.unpack_fp4(packed), codes)
    assert torch.equal(Q.unpack_fp4(packed.view(torch.int8)), codes)
    with pytest.raises(ValueError, match="even"):
        Q.pack_fp4(torch.zeros(3, dtype=torch.uint8))


def test_scale_codecs_have_the_bits_of_their_longer_forms():
    """The 2-op form gives the 7-op form's bits (exponent + has-mantissa, shifted back) for every sign and
    exponent, with mantissas 0, 1, all ones and 4,093 random ones: 2.1M bit patterns, NaN and inf included."""
    g = torch.Generator().manual_seed(0)
    mantissas = torch.cat((torch.tensor([0, 1, (1 << 23) - 1]), torch.randint(0, 1 << 23, (4093,), generator=g)))
    exponents = torch.arange(256)
    bits = (exponents[:, None] << 23 | mantissas[None, :]).flatten()
    bits = torch.cat((bits, bits | (1 << 31))).to(torch.int32)  # both signs
    exponent, has_mantissa = (bits >> 23) & 255, (bits & ((1 << 23) - 1)) != 0
    want = (exponent + has_mantissa.to(torch.int32)) << 23
    assert torch.equal(_bits(Q.pow2_ceil(bits.view(torch.float32))), want)
    assert _bits(Q.pow2_ceil(torch.tensor([float("nan")]))).item() == _bits(torch.tensor([-0.0])).item()
    # e8m0_from_pow2 drops ``& 255`` before its uint8 cast: the same bytes for every pattern (sign set too).
    floats = bits.view(torch.float32)
    assert torch.equal(Q.e8m0_from_pow2(floats).view(torch.uint8), ((bits >> 23) & 255).to(torch.uint8))


def test_pow2_ceil_is_exact_at_powers_of_two():
    x = torch.tensor([1.0, 1.0000001, 0.75, 2.0**-126, 3.0 * 2**-20, 2.0**100])
    assert Q.pow2_ceil(x).tolist() == [1.0, 2.0, 1.0, 2.0**-126, 2.0**-18, 2.0**100]
    scales = torch.tensor([2.0**-126, 2.0**-1, 1.0, 2.0**127])
    assert Q.e8m0_from_pow2(scales).view(torch.uint8).tolist() == [1, 126, 127, 254]
    assert torch.equal(Q.e8m0_to_float(Q.e8m0_from_pow2(scales)), scales)


# ---------------------------------------------------------------- checkpoint weights


def test_fp8_block_hand_built_layout_and_scale_rule():
    w = torch.zeros(32, 64)
    w[0, 0], w[5, 7] = 448.0, -1.0  # block (0,0): amax 448 → scale 2^0 exactly (not 2^1)
    w[3, 40] = 1.0  # block (0,1): amax 1 → 1/448 ∈ (2^-9, 2^-8] → scale 2^-8
    q, s = Q.quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (32, 64)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (1, 2)
    assert s.view(torch.uint8).tolist() == [[127, 119]]
    raw = q.view(torch.uint8)
    assert raw[0, 0] == 0x7E and raw[5, 7] == 0xB8  # 448 = S0 E1111 M110; -1 = S1 E0111 M000
    assert raw[3, 40] == 0x78  # 1 / 2^-8 = 256 = 1.0·2^8 → E = 8 + 7, M = 0
    assert torch.equal(Q.dequantize_fp8_block(q, s), w)


def test_fp8_block_partial_blocks_and_error_bound():
    w = _rand(45, 70)
    q, s = Q.quantize_fp8_block(w)
    assert s.shape == (2, 3)
    # The partial block's scale comes from its own (partial) amax.
    amax = w[32:, 64:].abs().max()
    assert Q.e8m0_to_float(s)[1, 2] == Q.pow2_ceil(amax / 448)
    d = Q.dequantize_fp8_block(q, s)
    scale = Q.e8m0_to_float(s).repeat_interleave(32, 0).repeat_interleave(32, 1)[:45, :70]
    # e4m3: 3 mantissa bits → relative error ≤ 2^-4; subnormal step scale·2^-9.
    assert ((d - w).abs() <= torch.maximum(w.abs() * 2**-4, scale * 2**-10)).all()
    with pytest.raises(ValueError, match="scale shape"):
        Q.dequantize_fp8_block(q, s[:, :2])


def test_mxfp4_hand_built_bytes():
    w = torch.zeros(2, 64)
    w[0, :4] = torch.tensor([0.5, -1.0, 6.0, 0.0])  # amax 6 → scale 1
    w[1, 32:34] = torch.tensor([3.0, 0.7])  # second block: amax 3 → 3/6 = 0.5 → scale 2^-1
    q, s = Q.quantize_mxfp4(w)
    assert q.dtype == torch.int8 and q.shape == (2, 32)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (2, 2)
    assert s.view(torch.uint8).tolist() == [[127, 1], [1, 126]]  # empty blocks get 2^-126
    raw = q.view(torch.uint8)
    assert raw[0, :2].tolist() == [0xA1, 0x07]  # (0.5→1, -1→8|2), (6→7, 0→0)
    # 3/0.5 = 6 → code 7; 0.7/0.5 = 1.4 → nearest 1.5 → code 3
    assert raw[1, 16] == 0x37
    d = Q.dequantize_mxfp4(q, s)
    assert d[0, :4].tolist() == [0.5, -1.0, 6.0, 0.0] and d[1, 32:34].tolist() == [3.0, 0.75]


def test_mxfp4_round_trip_exact_on_grid_and_bounded_off_grid():
    g = torch.Generator().manual_seed(1)
    levels = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6])
    on_grid = levels[torch.randint(0, 15, (8, 96), generator=g)]
    on_grid[:, ::32] = 6.0  # fix each block's amax so the scale is exactly 2^k
    on_grid *= 2.0 ** torch.randint(-5, 5, (8, 1), generator=g)
    assert torch.equal(Q.dequantize_mxfp4(*Q.quantize_mxfp4(on_grid)), on_grid)
    w = _rand(8, 96, seed=2)
    q, s = Q.quantize_mxfp4(w)
    scale = Q.e8m0_to_float(s).repeat_interleave(32, 1)
    # No clipping (scale ≥ amax/6) and the widest step (4 → 6) is 2·scale.
    # scale is a power of two, so the rounded difference stays ≤ it whenever the exact one does: no slack.
    assert ((Q.dequantize_mxfp4(q, s) - w).abs() <= scale).all()
    with pytest.raises(ValueError, match="even"):
        Q.quantize_mxfp4(torch.ones(2, 33))


def test_fp8_rowwise_engram_layout():
    w = _rand(5, 256)
    q, s = Q.quantize_fp8_rowwise(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 256)
    assert s.shape == (5, 8)
    expected = Q.pow2_ceil(w.abs().unflatten(1, (8, 32)).amax(-1) / 448)
    assert torch.equal(Q.e8m0_to_float(s), expected)
    d = Q.dequantize_fp8_rowwise(q, s)
    assert ((d - w).abs() <= w.abs() * 2**-4 + expected.repeat_interleave(32, 1) * 2**-10).all()


def test_weight_format_and_scale_key_follow_released_names():
    assert Q.weight_format("layers.3.attn.wq_a.weight") == "fp8_block"
    assert Q.weight_format("layers.3.attn.indexer.wq_b.weight") == "fp8_block"
    assert Q.weight_format("layers.3.ffn.shared_experts.w2.weight") == "fp8_block"
    assert Q.weight_format("layers.3.engram.wkv.weight") == "fp8_block"
    assert Q.weight_format("layers.3.ffn.experts.17.w3.weight") == "mxfp4"
    assert Q.weight_format("layers.1.engram.embed.weight") == "fp8_rowwise"
    for key in (
        "layers.3.attn.compressor.wkv.weight",
        "layers.3.attn.indexer.wk.weight",
        "embed.weight",
        "head.weight",
        "layers.3.ffn.gate.weight",
        "layers.3.attn.q_norm.weight",
    ):
        assert Q.weight_format(key) is None, key
    assert Q.scale_key("layers.1.engram.embed.weight") == "layers.1.engram.embed.scale"
    out = Q.quantize_weight("layers.0.ffn.experts.0.w1.weight", torch.ones(4, 64))
    assert set(out) == {"layers.0.ffn.experts.0.w1.weight", "layers.0.ffn.experts.0.w1.scale"}


def test_nemo_dequantises_our_file_to_identical_fp32(tmp_path):
    sda = pytest.importorskip("nemo_automodel.components.models.deepseek_v41.state_dict_adapter")
    weights = {
        "layers.0.attn.wq_a.weight": _rand(45, 70, seed=3),
        "layers.0.attn.wo_b.weight": _rand(64, 96, seed=4),
        "layers.0.ffn.experts.1.w2.weight": _rand(40, 96, seed=5),
        "layers.1.engram.embed.weight": _rand(61, 64, seed=6),
        "layers.0.attn_norm.weight": _rand(64, seed=7),
    }
    stored = {}
    for key, w in weights.items():
        stored.update(Q.quantize_weight(key, w))
    write_checkpoint(stored, tmp_path)
    ours = {}
    loaded = read_checkpoint(tmp_path)
    for key, w in weights.items():
        fmt = Q.weight_format(key)
        ours[key] = (
            loaded[key]
            if fmt is None
            else Q.dequantize_weight(loaded[key], loaded[Q.scale_key(key)], rowwise=fmt == "fp8_rowwise")
        )
    # NeMo's own adapter routine, on the tensors as read from disk (its key-based routing included).
    theirs = sda.DeepseekV41StateDictAdapter._dequantize(SimpleNamespace(dtype=torch.float32), dict(loaded))
    assert set(theirs) == set(weights)
    for key in weights:
        assert theirs[key].dtype == torch.float32
        assert torch.equal(_bits(theirs[key]), _bits(ours[key])), key


# ---------------------------------------------------------------- cache fake-quant (model math)


def _with_ties(x: torch.Tensor, block: int) -> torch.Tensor:
    """Put exact e2m1 midpoints (ties) into blocks whose amax is pinned to 6 × a power of two."""
    x = x.clone()
    x[..., 0] = 6.0
    x[..., 1:8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x[..., 8:12] = 0.0
    return x


@pytest.mark.parametrize("shape", [(3, 7, 512), (5, 128), (4, 40), (2, 33)])
def test_fake_quant_matches_nemo_bit_for_bit(shape):
    nemo_q = pytest.importorskip("nemo_automodel.components.models.deepseek_v41.quantization")
    x = _with_ties(_rand(*shape, seed=sum(shape)), 16)
    for ours, fmt, block in (
        (Q.fake_quant_fp8_e4m3(x, 32), "fp8", 32),
        (Q.fake_quant_indexer(x), "mxfp4", 32),
        (Q.fake_quant_compressed_kv(x), "nvfp4", 16),
    ):
        theirs = nemo_q.quantize_cache(x, format=fmt, block_size=block)
        assert torch.equal(ours, theirs), fmt
        assert not torch.equal(ours, x), fmt  # the rounding really happened
    xb = x.to(torch.bfloat16)
    got = Q.fake_quant_compressed_kv(xb)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, nemo_q.quantize_cache(xb, format="nvfp4", block_size=16))


def test_scale_steps_match_nemo_at_their_boundaries():
    """Block maxima placed on, and one ulp either side of, every scale step of the three formats."""
    nemo_q = pytest.importorskip("nemo_automodel.components.models.deepseek_v41.quantization")
    e4m3 = torch.arange(1, 126, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    pow2 = 2.0 ** torch.arange(-20, 4.0)
    for fmt, block, steps in (
        ("nvfp4", 16, 6 * (e4m3[:-1] + e4m3[1:]) / 2),
        ("mxfp4", 32, 6 * pow2),
        ("fp8", 32, 448 * pow2),
    ):
        amax = torch.cat([steps, torch.nextafter(steps, steps * 2), torch.nextafter(steps, steps / 2)])
        g = torch.Generator().manual_seed(block)
        x = torch.rand(amax.numel(), block, generator=g) * amax[:, None] * 0.9
        x[:, 3] = -amax
        ours = {
            "nvfp4": Q.fake_quant_compressed_kv,
            "mxfp4": Q.fake_quant_indexer,
            "fp8": lambda t: Q.fake_quant_fp8_e4m3(t, 32),
        }[fmt](x)
        assert torch.equal(ours, nemo_q.quantize_cache(x, format=fmt, block_size=block)), fmt


def test_fp4_ties_round_to_even_code_in_fake_quant():
    x = torch.zeros(1, 32)
    x[0, :8] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    out = Q.fake_quant_indexer(x)[0, :8].tolist()
    assert out == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_cache_byte_layouts_and_sizes():
    kv = _rand(4, 512, seed=9)
    packed, scale = Q.quantize_fp4_cache(kv, 16, "e4m3")
    assert packed.dtype == torch.uint8 and packed.shape == (4, 256)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (4, 32)
    assert packed[0].numel() + scale[0].numel() == 288
    assert torch.equal(Q.dequantize_fp4_cache(packed, scale, 16), Q.fake_quant_compressed_kv(kv))
    key = _rand(4, 128, seed=10)
    packed, scale = Q.quantize_fp4_cache(key, 32, "e8m0")
    assert packed.numel() // 4 + scale.numel() // 4 == 68 and scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(Q.dequantize_fp4_cache(packed, scale, 32), Q.fake_quant_indexer(key))
    with pytest.raises(TypeError, match="view raw bytes"):
        Q.dequantize_fp4_cache(packed, scale.view(torch.uint8), 32)  # ambiguous: e8m0 or e4m3?
    win = _rand(4, 512, seed=11)
    q, scale = Q.quantize_fp8_cache(win)
    assert q.shape == (4, 512) and scale.shape == (4, 16)
    assert torch.equal(Q.dequantize_fp8_cache(q.view(torch.uint8), scale.view(torch.uint8)), Q.fake_quant_fp8_e4m3(win))
