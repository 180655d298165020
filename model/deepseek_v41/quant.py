"""FP8 / FP4 number formats of DeepSeek-V4.1: checkpoint storage and the cache fake-quantisation.

Pure torch, CPU-correct, vectorised. Two families share one set of codecs:

Checkpoint storage (spec §3.11; NeMo 0.7.0 ``deepseek_v41/state_dict_adapter.py``
``dequantize_checkpoint_weight`` decodes every byte written here to the same fp32):

=====================  ===========================  ==================  ===================================
tensor                 ``<name>.weight`` dtype       weight shape        ``<name>.scale`` (float8_e8m0fnu)
=====================  ===========================  ==================  ===================================
dense FP8 projections  float8_e4m3fn (``F8_E4M3``)   [R, C]              [ceil(R/32), ceil(C/32)]
routed experts MXFP4   int8 (``I8``), 2 codes/byte   [R, C/2]            [R, ceil(C/32)]
Engram tables          float8_e4m3fn (``F8_E4M3``)   [R, C]              [R, ceil(C/32)]
=====================  ===========================  ==================  ===================================

- The scale name is the weight name with ``.weight`` replaced by ``.scale`` (``attn.wq_a.scale``,
  ``engram.embed.scale``, ``ffn.experts.3.w1.scale``); safetensors dtype ``F8_E8M0``.
- NeMo picks the format from the weight dtype: int8 → MXFP4 (row-wise scales); float8_e4m3fn →
  32×32 blocks, except keys containing ``.engram.embed.`` which are row-wise. So experts MUST be
  stored as int8 (uint8 is rejected) and Engram tables are told apart only by their name.
- Shapes that are not multiples of 32 are allowed: the last scale row/column covers the partial
  block (NeMo indexes scales with ``index // 32`` on a ceil-sized grid). MXFP4 needs an even C.
- Dequantisation is ``decode(code) * scale`` in fp32, which is exact (a power-of-two product).
- Quantisation here (NeMo ships no V4.1 weight quantiser) uses the no-clipping rule of the
  released cache kernels: ``scale = 2^ceil(log2(amax / max_code))`` per block, computed exactly
  from the fp32 bits; e4m3 by round-to-nearest-even, e2m1 by round-to-nearest, ties to the even
  code. An all-zero block gets the smallest normal scale 2^-126.

Cache fake-quantisation (part of the model math, spec §3.5–3.7; bit-identical to NeMo's
``deepseek_v41/quantization.py::quantize_cache``). Channels are grouped by ``block`` along the last
dim; a partial last group is zero-padded (zeros never change an amax):

- window K:      ``fake_quant_fp8_e4m3(x, 32)``: scale = 2^ceil(log2(max(amax,1e-4)·(1/448))),
  x/scale clamped to ±448, cast to e4m3 (round-to-nearest-even), times the scale.
- indexer q/k:   ``fake_quant_fp4_e2m1(x, 32, "e8m0")``: scale = 2^ceil(log2(max(amax,6·2^-126)·(1/6))).
- compressed KV: ``fake_quant_fp4_e2m1(x, 16, "e4m3")``: scale = e4m3_rne(max(amax, 6·2^-9) / 6).
  FP4: x/scale clamped to ±6, rounded to the nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the
  even code (0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4), sign kept; times the scale.

``quantize_*_cache`` return the real bytes of those formats (FP4 packed two per byte, even index in
the low nibble; main KV entry 512 ch → 256 B + 32 e4m3 scales; indexer key 128 ch → 64 B + 4
e8m0 scales); ``dequantize(quantize(x)) == fake_quant(x)`` exactly.

``tests/model/deepseek_v41/quant_boundary.py`` reports how far inputs sit from a rounding discontinuity of these
formats.
"""

from __future__ import annotations

import re
from typing import Literal

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
WEIGHT_BLOCK = 32
"""Block edge of every checkpoint scale (32×32 dense, 1×32 row-wise)."""
FP8_CACHE_BLOCK = 32
COMPRESSED_KV_BLOCK = 16
INDEXER_BLOCK = 32

ScaleFormat = Literal["e8m0", "e4m3"]

# e2m1 code c (4 bits): bit 3 = sign, bits 0-2 index these magnitudes; an even index has mantissa 0.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_MIN_NORMAL = 2.0**-126


# ---------------------------------------------------------------- scalar codecs


_MANTISSA = (1 << 23) - 1  # fp32 mantissa bits
_MAGNITUDE = (1 << 31) - 1  # fp32 bits but the sign


def pow2_ceil(value: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ≥ ``value``, exactly, from the fp32 bits (no log2 round-off).

    ``value`` must be positive normal fp32 (callers clamp first); the result is fp32, same shape.
    Without the sign bit, adding 2^23 − 1 carries into the exponent iff the mantissa is nonzero, and the
    mask then drops the mantissa: (exponent + has-mantissa) << 23 in 3 elementwise ops where that form
    took 7 (each one a launch per quantisation on CUDA), the same bits for every input, NaN (→ −0.0)
    and inf included (tests/model/deepseek_v41/test_quant.py).
    """
    bits = value.float().contiguous().view(torch.int32)
    return (((bits & _MAGNITUDE) + _MANTISSA) & ~_MANTISSA).view(torch.float32)


def e8m0_from_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Encode exact fp32 powers of two in [2^-126, 2^127] as ``float8_e8m0fnu`` (byte = biased exponent).
    The cast to uint8 keeps the low 8 bits (an integer conversion is modular), which ``& 255`` kept."""
    return (scale.float().contiguous().view(torch.int32) >> 23).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode ``float8_e8m0fnu`` (or its raw uint8 bytes) to fp32 2^(byte-127); 0xFF is NaN."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    return scale.float()


_E2M1_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _e2m1_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(midpoints fp32 [7], code → value fp32 [16]) on ``device``, made once per device: a table
    built per call is a host-to-device copy, which a CUDA graph capture refuses (the first call on a
    device, which makes them, must come before any capture: a warm-up run does)."""
    tables = _E2M1_TABLES.get(device)
    if tables is None:
        values = _E2M1_MAGNITUDES + tuple(-m for m in _E2M1_MAGNITUDES)  # code 8 is −0.0
        tables = (
            torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=device),
            torch.tensor(values, dtype=torch.float32, device=device),
        )
        _E2M1_TABLES[device] = tables
    return tables


def encode_e2m1(normalized: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already divided by their scale) to 4-bit e2m1 codes, uint8 in [0, 15].

    Clamps to ±6 (saturating), rounds to the nearest magnitude with ties to the even code, and
    sets the sign bit (8) for every negative input, including those that round to zero.
    """
    x = normalized.float().clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)
    magnitude = x.abs().contiguous()
    midpoints = _e2m1_tables(magnitude.device)[0]
    lower = torch.bucketize(magnitude, midpoints)  # index of the level below, or at a tie
    tie = magnitude == midpoints[lower.clamp_max(len(_E2M1_MIDPOINTS) - 1)]
    index = lower + (tie & (lower % 2 == 1)).to(lower.dtype)
    return (index | ((x < 0).to(index.dtype) << 3)).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Decode e2m1 codes (uint8, low 4 bits used) to fp32; code 8 is -0.0."""
    return _e2m1_tables(codes.device)[1][(codes & 15).long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack e2m1 codes [..., K] (K even) into uint8 [..., K/2]: even index low nibble, odd high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 15) | ((c[..., 1::2] & 15) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack uint8/int8 bytes [..., K/2] into e2m1 codes uint8 [..., K] (inverse of ``pack_fp4``)."""
    b = packed.contiguous().view(torch.uint8)
    return torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)


# ---------------------------------------------------------------- block helpers


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., C] → fp32 [..., ceil(C/block), block], zero-padding the last group."""
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    return F.pad(x.float(), (0, -x.shape[-1] % block)).unflatten(-1, (-1, block))


def _unblock(blocked: torch.Tensor, channels: int) -> torch.Tensor:
    return blocked.flatten(-2)[..., :channels]


def _fp4_scale(amax: torch.Tensor, scale_format: ScaleFormat) -> torch.Tensor:
    if scale_format == "e8m0":
        return pow2_ceil(amax.clamp_min(FP4_E2M1_MAX * _MIN_NORMAL) * (1 / FP4_E2M1_MAX))
    if scale_format == "e4m3":
        # A tensor divisor: CUDA turns division by a Python scalar into a reciprocal product.
        # amax > 6·448 = 2688 gives a NaN scale, as in NeMo (normed latents stay far below).
        divisor = amax.new_full((), FP4_E2M1_MAX)
        return (amax.clamp_min(FP4_E2M1_MAX * 2.0**-9) / divisor).to(torch.float8_e4m3fn).float()
    raise ValueError(f"scale_format must be 'e8m0' or 'e4m3', got {scale_format!r}")


def _fp8_cache_scale(amax: torch.Tensor) -> torch.Tensor:
    return pow2_ceil(amax.clamp_min(1e-4) * (1 / FP8_E4M3_MAX))


# ---------------------------------------------------------------- cache formats (model math)


def quantize_fp8_cache(x: torch.Tensor, block: int = FP8_CACHE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Window-K FP8: ``x`` [..., C] → (float8_e4m3fn [..., C], float8_e8m0fnu [..., ceil(C/block)])."""
    grouped = _blocks(x, block)
    scale = _fp8_cache_scale(grouped.abs().amax(-1, keepdim=True))
    q = (grouped / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return _unblock(q.view(torch.uint8), x.shape[-1]).view(torch.float8_e4m3fn), e8m0_from_pow2(scale[..., 0])


def dequantize_fp8_cache(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_CACHE_BLOCK) -> torch.Tensor:
    """Inverse of ``quantize_fp8_cache`` (also accepts raw uint8 bytes); fp32 [..., C]."""
    values = _blocks(q.view(torch.float8_e4m3fn).float(), block)
    return _unblock(values * e8m0_to_float(scale).unsqueeze(-1), q.shape[-1])


def fake_quant_fp8_e4m3(x: torch.Tensor, block: int = FP8_CACHE_BLOCK) -> torch.Tensor:
    """Window-K rounding (spec §3.5) in ``x.dtype``: per ``block`` channels a power-of-two scale."""
    return dequantize_fp8_cache(*quantize_fp8_cache(x, block), block).to(x.dtype)


def quantize_fp4_cache(x: torch.Tensor, block: int, scale_format: ScaleFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 cache bytes: ``x`` [..., C] (C even) → (packed uint8 [..., C/2], scales [..., ceil(C/block)]).

    Scales are float8_e8m0fnu (indexer, block 32) or float8_e4m3fn (compressed KV, block 16).
    """
    grouped = _blocks(x, block)
    scale = _fp4_scale(grouped.abs().amax(-1, keepdim=True), scale_format)
    codes = _unblock(encode_e2m1(grouped / scale), x.shape[-1])
    stored = e8m0_from_pow2(scale[..., 0]) if scale_format == "e8m0" else scale[..., 0].to(torch.float8_e4m3fn)
    return pack_fp4(codes), stored


def dequantize_fp4_cache(packed: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of ``quantize_fp4_cache``; fp32 [..., 2·packed.shape[-1]]. Scale dtype picks the format."""
    values = decode_e2m1(unpack_fp4(packed))
    channels = values.shape[-1]
    if scale.dtype not in (torch.float8_e8m0fnu, torch.float8_e4m3fn):
        raise TypeError(f"FP4 cache scales must be float8_e8m0fnu or float8_e4m3fn (view raw bytes), got {scale.dtype}")
    scale_f = scale.float()
    return _unblock(_blocks(values, block) * scale_f.unsqueeze(-1), channels)


def fake_quant_fp4_e2m1(x: torch.Tensor, block: int, scale_format: ScaleFormat) -> torch.Tensor:
    """FP4 e2m1 rounding in ``x.dtype``: (16, "e4m3") compressed KV, (32, "e8m0") indexer q/k.

    Odd C is allowed here (no packing); results equal NeMo ``quantize_cache`` bit for bit.
    """
    grouped = _blocks(x, block)
    scale = _fp4_scale(grouped.abs().amax(-1, keepdim=True), scale_format)
    return _unblock(decode_e2m1(encode_e2m1(grouped / scale)) * scale, x.shape[-1]).to(x.dtype)


def fake_quant_compressed_kv(x: torch.Tensor) -> torch.Tensor:
    """Compressed KV entries (spec §3.6): FP4 with one e4m3 scale per 16 channels."""
    return fake_quant_fp4_e2m1(x, COMPRESSED_KV_BLOCK, "e4m3")


def fake_quant_indexer(x: torch.Tensor) -> torch.Tensor:
    """Indexer queries and keys (spec §3.7): FP4 with one power-of-two scale per 32 channels."""
    return fake_quant_fp4_e2m1(x, INDEXER_BLOCK, "e8m0")


# ---------------------------------------------------------------- checkpoint weights (spec §3.11)

_QUANTIZED_KEY = re.compile(
    r"layers\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
    r"|ffn\.(?:shared_experts|experts\.\d+)\.w[123]|engram\.(?:embed|wkv))\.weight"
    # DSpark stages (NeMo's draft adapter): the same projections plus main_proj.
    r"|mtp\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|main_proj|ffn\.(?:shared_experts|experts\.\d+)\.w[123])"
    r"\.weight"
)

WeightFormat = Literal["fp8_block", "fp8_rowwise", "mxfp4"]


def weight_format(key: str) -> WeightFormat | None:
    """Storage format of a released checkpoint key, or None for BF16/FP32 tensors.

    Same key set as NeMo's adapter: routed experts → "mxfp4", ``engram.embed`` → "fp8_rowwise",
    the other quantised projections → "fp8_block"; ``mtp.*`` (DSpark) keys as NeMo's draft adapter.
    """
    if not _QUANTIZED_KEY.fullmatch(key):
        return None
    if ".ffn.experts." in key:
        return "mxfp4"
    return "fp8_rowwise" if ".engram.embed." in key else "fp8_block"


def scale_key(weight_key: str) -> str:
    """``layers.0.attn.wq_a.weight`` → ``layers.0.attn.wq_a.scale`` (the released naming)."""
    if not weight_key.endswith(".weight"):
        raise ValueError(f"not a weight key: {weight_key!r}")
    return weight_key.removesuffix(".weight") + ".scale"


def _weight_scale(amax: torch.Tensor, max_code: float) -> torch.Tensor:
    # True division keeps amax = max_code·2^k on scale 2^k exactly; a tensor divisor keeps it true
    # division on CUDA too (a Python-scalar divisor becomes a reciprocal product there).
    return pow2_ceil(amax.clamp_min(max_code * _MIN_NORMAL) / amax.new_full((), max_code))


def _check_matrix(w: torch.Tensor, what: str) -> tuple[int, int]:
    if w.ndim != 2:
        raise ValueError(f"{what} expects a 2-D matrix, got shape {tuple(w.shape)}")
    return w.shape[0], w.shape[1]


def _check_scale(scale: torch.Tensor, expected: tuple[int, int], what: str) -> None:
    if tuple(scale.shape) != expected:
        raise ValueError(f"{what}: scale shape {tuple(scale.shape)} != expected {expected}")


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense FP8: w [R, C] → (float8_e4m3fn [R, C], float8_e8m0fnu [ceil(R/32), ceil(C/32)])."""
    rows, cols = _check_matrix(w, "quantize_fp8_block")
    padded = F.pad(w.float(), (0, -cols % WEIGHT_BLOCK, 0, -rows % WEIGHT_BLOCK))
    tiles = padded.unflatten(1, (-1, WEIGHT_BLOCK)).unflatten(0, (-1, WEIGHT_BLOCK))  # [nr, 32, nc, 32]
    scale = _weight_scale(tiles.abs().amax(dim=(1, 3)), FP8_E4M3_MAX)  # [nr, nc]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), e8m0_from_pow2(scale)


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_fp8_block``: fp32 [R, C]; the scale grid is checked."""
    rows, cols = _check_matrix(q, "dequantize_fp8_block")
    _check_scale(scale, (-(-rows // WEIGHT_BLOCK), -(-cols // WEIGHT_BLOCK)), "dequantize_fp8_block")
    s = e8m0_to_float(scale).repeat_interleave(WEIGHT_BLOCK, 0).repeat_interleave(WEIGHT_BLOCK, 1)
    return q.view(torch.float8_e4m3fn).float() * s[:rows, :cols]


def quantize_fp8_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Engram table FP8: w [R, C] → (float8_e4m3fn [R, C], float8_e8m0fnu [R, ceil(C/32)])."""
    _check_matrix(w, "quantize_fp8_rowwise")
    grouped = _blocks(w, WEIGHT_BLOCK)  # [R, nc, 32]
    scale = _weight_scale(grouped.abs().amax(-1, keepdim=True), FP8_E4M3_MAX)
    q = (grouped / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return _unblock(q.view(torch.uint8), w.shape[1]).contiguous().view(torch.float8_e4m3fn), e8m0_from_pow2(
        scale[..., 0]
    )


def dequantize_fp8_rowwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_fp8_rowwise``: fp32 [R, C]."""
    rows, cols = _check_matrix(q, "dequantize_fp8_rowwise")
    _check_scale(scale, (rows, -(-cols // WEIGHT_BLOCK)), "dequantize_fp8_rowwise")
    values = _blocks(q.view(torch.float8_e4m3fn).float(), WEIGHT_BLOCK)
    return _unblock(values * e8m0_to_float(scale).unsqueeze(-1), cols)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed expert MXFP4: w [R, C] (C even) → (int8 [R, C/2], float8_e8m0fnu [R, ceil(C/32)]).

    Column 2j is the low nibble of byte j, column 2j+1 the high nibble.
    """
    rows, cols = _check_matrix(w, "quantize_mxfp4")
    if cols % 2:
        raise ValueError(f"quantize_mxfp4 needs an even column count, got shape {(rows, cols)}")
    grouped = _blocks(w, WEIGHT_BLOCK)
    scale = _weight_scale(grouped.abs().amax(-1, keepdim=True), FP4_E2M1_MAX)
    codes = _unblock(encode_e2m1(grouped / scale), cols)
    return pack_fp4(codes).view(torch.int8), e8m0_from_pow2(scale[..., 0])


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_mxfp4``: fp32 [R, 2·packed.shape[1]]; identical bits to NeMo's decoder."""
    rows, half = _check_matrix(packed, "dequantize_mxfp4")
    _check_scale(scale, (rows, -(-2 * half // WEIGHT_BLOCK)), "dequantize_mxfp4")
    # + 0.0 turns code 8 (-0) into +0, as NeMo's table does.
    values = decode_e2m1(unpack_fp4(packed)) + 0.0
    return _unblock(_blocks(values, WEIGHT_BLOCK) * e8m0_to_float(scale).unsqueeze(-1), 2 * half)


def quantize_weight(key: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Released storage for one tensor: {key: q, scale_key(key): scale}, or {key: w} if unquantised."""
    fmt = weight_format(key)
    if fmt is None:
        return {key: w}
    quantizer = {"fp8_block": quantize_fp8_block, "fp8_rowwise": quantize_fp8_rowwise, "mxfp4": quantize_mxfp4}[fmt]
    q, s = quantizer(w)
    return {key: q, scale_key(key): s}


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, *, rowwise: bool = False) -> torch.Tensor:
    """Decode like NeMo's ``dequantize_checkpoint_weight`` does: the dtype picks the format.

    int8 → MXFP4; float8_e4m3fn → 32×32 blocks, or row-wise when ``rowwise`` (Engram tables).
    """
    if weight.dtype == torch.int8:
        return dequantize_mxfp4(weight, scale)
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"expected int8 (MXFP4) or float8_e4m3fn weights, got {weight.dtype}")
    return dequantize_fp8_rowwise(weight, scale) if rowwise else dequantize_fp8_block(weight, scale)


__all__ = [
    "COMPRESSED_KV_BLOCK",
    "FP4_E2M1_MAX",
    "FP8_CACHE_BLOCK",
    "FP8_E4M3_MAX",
    "INDEXER_BLOCK",
    "WEIGHT_BLOCK",
    "decode_e2m1",
    "dequantize_fp4_cache",
    "dequantize_fp8_block",
    "dequantize_fp8_cache",
    "dequantize_fp8_rowwise",
    "dequantize_mxfp4",
    "dequantize_weight",
    "e8m0_from_pow2",
    "e8m0_to_float",
    "encode_e2m1",
    "fake_quant_compressed_kv",
    "fake_quant_fp4_e2m1",
    "fake_quant_fp8_e4m3",
    "fake_quant_indexer",
    "pack_fp4",
    "pow2_ceil",
    "quantize_fp4_cache",
    "quantize_fp8_block",
    "quantize_fp8_cache",
    "quantize_fp8_rowwise",
    "quantize_mxfp4",
    "quantize_weight",
    "scale_key",
    "unpack_fp4",
    "weight_format",
]
