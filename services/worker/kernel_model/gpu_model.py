"""Build a model too large for its fp32 form straight into the kernel backend's form (v41-s1).

v41-s1 is ~84 GB as released (FP8 / MXFP4); its fp32 form would be ~4× that. So the model is
made on the ``meta`` device and brought to the GPU one layer at a time: the layer's released tensors
are drawn on the GPU from the seed (``random_stored_on_device``), its parameters are materialised,
filled, and converted by the kernel backend (``convert_model`` on that layer), and the fp32 copies
are dropped before the next layer. Peak memory is the converted model plus one fp32 layer (~8 GB).

The Engram tables (72M rows × 256 each) never exist in fp32: they stay e4m3 with their row-wise
e8m0 scales in ``Fp8RowwiseEmbedding``, which dequantises only the rows a step gathers, with the
same arithmetic as ``dequantize_fp8_rowwise`` (so the values equal the fp32 table's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from model.deepseek_v41.checkpoint import tensor_table
from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.init import random_stored_on_device
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.quant import dequantize_weight
from model.deepseek_v41.rope import rope_frequencies


class Fp8RowwiseEmbedding(nn.Module):
    """An Engram table kept as released: ``weight`` e4m3 [rows, C], ``scale`` e8m0 [rows, C/32]."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight_fp8", weight)
        self.register_buffer("scale", scale)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows int [...] → fp32 [..., C]."""
        flat = rows.reshape(-1)
        values = dequantize_weight(self.weight_fp8[flat], self.scale[flat], rowwise=True)  # [n, C]
        return values.view(*rows.shape, values.shape[-1])


VISION_PREFIXES = ("vision.", "aligner.", "image_")
"""The name prefixes of the vision tower's parts, read after the layers and the draft."""


def _assign(model: nn.Module, tensors: dict[str, torch.Tensor], cfg: ModelConfig, prefix: str) -> None:
    """Fill the parameters under ``prefix`` from released tensors (dequantised, as ``assign_weights``)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for spec in tensor_table(cfg).values():
            if not spec.name.startswith(prefix) or ".engram.embed." in spec.name:
                continue
            stored = tensors[spec.name]
            if spec.fmt in ("fp8_block", "mxfp4", "fp8_rowwise"):
                value = dequantize_weight(
                    stored, tensors[spec.name.removesuffix(".weight") + ".scale"], rowwise=spec.fmt == "fp8_rowwise"
                )
            else:
                value = stored
            target = params[spec.target]
            (target if spec.index is None else target[spec.index]).copy_(value.float())


def is_engram_table(name: str) -> bool:
    """Whether a released tensor is (a part of) an Engram table, which ``engram_on_host`` keeps on the host."""
    return ".engram.embed." in name


def _draw(
    cfg: ModelConfig, seed: int, device: torch.device, prefix: str, engram_on_host: bool
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    on_host = is_engram_table if engram_on_host else None
    for entry in random_stored_on_device(cfg, seed, device, prefix=prefix, on_host=on_host):
        out.update(entry)
    return out


def build_random_kernel_model(
    cfg: ModelConfig,
    seed: int,
    device: torch.device | str,
    precision: str = "fp8",
    token_map: torch.Tensor | None = None,
    num_compressed: int | None = None,
    kernels=None,
    convert: bool = True,
    expert_format: str = "fp8",
    engram_on_host: bool = False,
    on_part: Callable[[str, object], None] | None = None,
) -> DeepseekV41:
    """A kernel-backed model with random released weights drawn on ``device`` (see the module docstring).
    ``convert=False`` stops before the kernel conversion: the torch model (tests compare it with the
    whole-model build). ``engram_on_host``: the Engram tables are drawn a band at a time and kept on the host."""
    device = torch.device(device)
    return build_kernel_model(
        cfg,
        lambda prefix: _draw(cfg, seed, device, prefix, engram_on_host),
        device,
        precision,
        token_map,
        num_compressed,
        kernels,
        convert,
        on_part=on_part,
        expert_format=expert_format,
    )


def num_parts(cfg: ModelConfig) -> int:
    """The parts ``build_kernel_model`` places, one ``on_part`` call each: embedding, final norm and head, every
    layer, the draft ("mtp.") and the vision tower's prefixes."""
    return (
        3
        + cfg.num_hidden_layers
        + (1 if cfg.num_nextn_predict_layers else 0)
        + (len(VISION_PREFIXES) if cfg.vision is not None else 0)
    )


def build_kernel_model(
    cfg: ModelConfig,
    fetch: Callable[[str], dict[str, torch.Tensor]],
    device: torch.device | str,
    precision: str = "fp8",
    token_map: torch.Tensor | None = None,
    num_compressed: int | None = None,
    kernels=None,
    convert: bool = True,
    on_part: Callable[[str, object], None] | None = None,
    expert_format: str = "fp8",
) -> DeepseekV41:
    """The kernel-backed model built part by part: ``fetch(prefix)`` gives the released tensors whose names
    start with ``prefix`` ("embed.", "norm.", "head.", then "layers.0." …, then "mtp." for a draft, then
    ``VISION_PREFIXES`` when the config has a vision tower), already on ``device``
    (drawn from a seed, or read from a checkpoint: services/worker/kernel_model/weight_loader.py). ``on_part(prefix,
    conversion)`` is called after each part is placed, with the layer's ``Conversion`` (how many FP8 weight
    elements were not exact at 128×128) or None. The fetched tensors are dropped before the next part.
    ``expert_format`` (services/worker/kernel_model/fp4_experts.py): routed experts kept MXFP4 ("fp4") or
    converted to FP8 ("fp8"). An Engram table stays on the device it was fetched to (the host, for
    ``engram_on_host``: the fetch keeps it there)."""
    device = torch.device(device)
    if cfg.engram_layer_ids and (token_map is None or num_compressed is None):
        raise ValueError("a config with Engram layers needs the tokenizer's Engram token map")
    with torch.device("meta"):
        model = DeepseekV41(cfg, token_map, num_compressed)
    if cfg.engram_layer_ids:
        from model.deepseek_v41.engram import EngramHasher

        model.hasher = EngramHasher(cfg, token_map, num_compressed).to(device)  # real buffers, made off meta
    for name in ("embed", "norm", "head"):
        getattr(model, name).to_empty(device=device)
        _assign(model, fetch(f"{name}."), cfg, f"{name}.")
        if on_part is not None:
            on_part(f"{name}.", None)
    for block in model.layers:
        prefix = f"layers.{block.layer}."
        tensors = fetch(prefix)
        table = None
        if block.engram is not None:
            name = f"{prefix}engram.embed.weight"
            table = Fp8RowwiseEmbedding(tensors.pop(name), tensors.pop(name.replace(".weight", ".scale")))
            block.engram.embed = nn.Identity()  # so to_empty never allocates the fp32 table
        block.to_empty(device=device)
        if table is not None:
            block.engram.embed = table
        block.attn.freqs = rope_frequencies(cfg, compressed=block.attn.ratio > 0).to(device)
        _assign(model, tensors, cfg, prefix)
        del tensors
        done = None
        if convert:
            from services.worker.kernel_model.backend import convert_model

            done = convert_model(block, precision, kernels, expert_format)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if on_part is not None:
            on_part(prefix, done)
    if model.draft is not None:  # loaded as torch modules; the runner's convert_model of the whole model converts it
        model.draft.to_empty(device=device)
        for stage in model.draft.stages:
            stage.attn.freqs = rope_frequencies(cfg, compressed=False).to(device)
        _assign(model, fetch("mtp."), cfg, "mtp.")
        if on_part is not None:
            on_part("mtp.", None)
    if model.encoder is not None:  # the vision tower stays torch (the multimodal service runs it)
        model.encoder.to_empty(device=device)
        for prefix in VISION_PREFIXES:
            _assign(model, fetch(prefix), cfg, prefix)
            if on_part is not None:
                on_part(prefix, None)
    return model.eval()
