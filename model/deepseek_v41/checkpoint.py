"""The released checkpoint layout (spec §3.11): every tensor name, its shape and storage format,
and where it lands in ``DeepseekV41``. Name mapping lives here, outside the model modules.

Formats:
  fp8_block    float8_e4m3fn weight [R, C] + float8_e8m0fnu ``.scale`` [⌈R/32⌉, ⌈C/32⌉]
  fp8_rowwise  float8_e4m3fn weight [R, C] + float8_e8m0fnu ``.scale`` [R, ⌈C/32⌉]   (Engram tables)
  mxfp4        int8 weight [R, C/2] (two e2m1 per byte, even column low) + e8m0 ``.scale`` [R, ⌈C/32⌉]
  bf16 / fp32  plain tensors
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from model.deepseek_v41.config import ModelConfig

Format = Literal["fp8_block", "fp8_rowwise", "mxfp4", "bf16", "fp32"]
QUANTIZED: tuple[Format, ...] = ("fp8_block", "fp8_rowwise", "mxfp4")


@dataclass(frozen=True)
class TensorSpec:
    name: str  # released name of the weight
    shape: tuple[int, ...]  # logical (dequantised) shape
    fmt: Format
    target: str  # parameter of DeepseekV41
    index: int | None = None  # row of a stacked parameter (routed experts)

    def stored(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """On-disk tensors for this entry: name → (shape, dtype); a quantised weight brings its ``.scale``."""
        if self.fmt == "bf16":
            return {self.name: (self.shape, torch.bfloat16)}
        if self.fmt == "fp32":
            return {self.name: (self.shape, torch.float32)}
        rows, cols = self.shape
        scale_name = self.name.removesuffix(".weight") + ".scale"
        col_blocks = -(-cols // 32)
        if self.fmt == "mxfp4":
            return {self.name: ((rows, cols // 2), torch.int8), scale_name: ((rows, col_blocks), torch.float8_e8m0fnu)}
        scale_rows = -(-rows // 32) if self.fmt == "fp8_block" else rows
        return {
            self.name: (self.shape, torch.float8_e4m3fn),
            scale_name: ((scale_rows, col_blocks), torch.float8_e8m0fnu),
        }


def tensor_table(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every released weight for ``cfg`` by name, in init order: the text backbone, then the DSpark draft
    (``mtp.*``), then the vision tower when ``cfg.vision`` is set. Each part is appended after the ones
    before it, so adding it leaves their random draws alone."""
    specs = text_specs(cfg) + draft_specs(cfg) + vision_specs(cfg)
    return {s.name: s for s in specs}


def text_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """The text backbone's tensors: embed, norm, head, then each layer."""
    d = cfg.hidden_size
    specs: list[TensorSpec] = [
        TensorSpec("embed.weight", (cfg.vocab_size, d), "bf16", "embed.weight"),
        TensorSpec("norm.weight", (d,), "bf16", "norm.weight"),
        TensorSpec("head.weight", (cfg.vocab_size, d), "bf16", "head.weight"),
    ]
    for i in range(cfg.num_hidden_layers):
        specs += layer_specs(cfg, i, f"layers.{i}.", f"layers.{i}.", cfg.n_routed_experts)
    return specs


def draft_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """The DSpark draft's tensors (spec §3.12): ``mtp.k.*`` per stage, like a ratio-0 backbone layer with
    the draft's expert count; ``main_proj``/``main_norm`` on stage 0; the final norm, the Markov head and
    the confidence head on the last stage. Targets are under ``DeepseekV41.draft``."""
    stages = cfg.num_nextn_predict_layers
    d, rank = cfg.hidden_size, cfg.dspark_markov_rank
    specs: list[TensorSpec] = []
    for k in range(stages):
        p, t = f"mtp.{k}.", "draft."
        specs += layer_specs(cfg, cfg.num_hidden_layers + k, p, f"{t}stages.{k}.", cfg.dspark_n_routed_experts)
        if k == 0:
            specs += [
                TensorSpec(
                    p + "main_proj.weight",
                    (d, d * len(cfg.dspark_target_layer_ids)),
                    "fp8_block",
                    t + "main_proj.weight",
                ),
                TensorSpec(p + "main_norm.weight", (d,), "bf16", t + "main_norm.weight"),
            ]
        if k == stages - 1:
            specs += [
                TensorSpec(p + "norm.weight", (d,), "bf16", t + "norm.weight"),
                TensorSpec(p + "markov_head.embed.weight", (cfg.vocab_size, rank), "bf16", t + "markov_embed.weight"),
                TensorSpec(p + "markov_head.head.weight", (cfg.vocab_size, rank), "bf16", t + "markov_head.weight"),
                TensorSpec(p + "confidence_head.proj.weight", (1, d + rank), "fp32", t + "confidence_proj.weight"),
            ]
    return specs


def layer_specs(cfg: ModelConfig, i: int, p: str, m: str, num_experts: int) -> list[TensorSpec]:
    """One layer's tensors named under ``p`` with targets under ``m``: backbone layer or draft stage ``i``
    (its schedule index: ratio, sources and Engram come from ``cfg`` at ``i``)."""
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    inter = cfg.moe_intermediate_size
    n = cfg.hc_mult
    specs: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], fmt: Format, target: str, index: int | None = None) -> None:
        specs.append(TensorSpec(p + name, shape, fmt, m + target, index))

    add("attn_norm.weight", (d,), "bf16", "attn_norm.weight")
    add("ffn_norm.weight", (d,), "bf16", "ffn_norm.weight")
    add("attn.wq_a.weight", (cfg.q_lora_rank, d), "fp8_block", "attn.wq_a.weight")
    add("attn.q_norm.weight", (cfg.q_lora_rank,), "bf16", "attn.q_norm.weight")
    add("attn.wq_b.weight", (h * hd, cfg.q_lora_rank), "fp8_block", "attn.wq_b.weight")
    add("attn.wkv.weight", (hd, d), "fp8_block", "attn.wkv.weight")
    add("attn.kv_norm.weight", (hd,), "bf16", "attn.kv_norm.weight")
    add("attn.wo_a.weight", (cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups), "fp8_block", "attn.wo_a.weight")
    add("attn.wo_b.weight", (d, cfg.o_groups * cfg.o_lora_rank), "fp8_block", "attn.wo_b.weight")
    add("attn.attn_sink", (h,), "fp32", "attn.attn_sink")
    if i in cfg.kv_source_layer_ids:
        add("attn.compressor.wkv.weight", (hd, d), "bf16", "attn.compressor.wkv.weight")
        if cfg.ratio(i) == 2:
            add("attn.compressor.wgate.weight", (hd, d), "bf16", "attn.compressor.wgate.weight")
        add("attn.compressor.norm.weight", (hd,), "bf16", "attn.compressor.norm.weight")
        add("attn.indexer.wk.weight", (cfg.index_head_dim, hd), "bf16", "attn.indexer.wk.weight")
        add("attn.indexer.k_norm.weight", (cfg.index_head_dim,), "bf16", "attn.indexer.k_norm.weight")
    if i in cfg.index_source_layer_ids:
        add(
            "attn.indexer.wq_b.weight",
            (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
            "fp8_block",
            "attn.indexer.wq_b.weight",
        )
        add("attn.indexer.weights_proj.weight", (cfg.index_n_heads, d), "bf16", "attn.indexer.weights_proj.weight")
    add("ffn.gate.weight", (num_experts, d), "bf16", "ffn.gate_weight")
    add("ffn.gate.bias", (num_experts,), "fp32", "ffn.gate_bias")
    add("ffn.gate.bias_vl", (num_experts,), "fp32", "ffn.bias_vl")
    for j in range(num_experts):
        add(f"ffn.experts.{j}.w1.weight", (inter, d), "mxfp4", "ffn.w1", j)
        add(f"ffn.experts.{j}.w2.weight", (d, inter), "mxfp4", "ffn.w2", j)
        add(f"ffn.experts.{j}.w3.weight", (inter, d), "mxfp4", "ffn.w3", j)
    add("ffn.shared_experts.w1.weight", (inter, d), "fp8_block", "ffn.shared_w1")
    add("ffn.shared_experts.w2.weight", (d, inter), "fp8_block", "ffn.shared_w2")
    add("ffn.shared_experts.w3.weight", (inter, d), "fp8_block", "ffn.shared_w3")
    for site in ("attn", "ffn"):
        add(f"hc_{site}_fn", (n * (n + 2), n * d), "fp32", f"hc_{site}.fn")
        add(f"hc_{site}_base", (n * (n + 2),), "fp32", f"hc_{site}.base")
        add(f"hc_{site}_scale", (3,), "fp32", f"hc_{site}.scale")
    if i in cfg.engram_layer_ids:
        rows = cfg.engram_num_embeddings[list(cfg.engram_layer_ids).index(i)]
        add("engram.embed.weight", (rows, cfg.engram_head_dim), "fp8_rowwise", "engram.embed.weight")
        add(
            "engram.wkv.weight",
            ((n + 1) * d, cfg.engram_hash_heads() * cfg.engram_head_dim),
            "fp8_block",
            "engram.wkv.weight",
        )
        add("engram.q_weight", (n, d), "bf16", "engram.q_weight")
        add("engram.k_weight", (n, d), "bf16", "engram.k_weight")
    return specs


def vision_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """``vision.*``, ``aligner.*`` and ``image_{start,end,newline}`` (NeMo's released names), landing in
    ``DeepseekV41.encoder``. Linear weights and biases BF16; the vision RMSNorm gains FP32, as NeMo keeps them."""
    v = cfg.vision
    if v is None:
        return []
    w, d, r = v.hidden_size, cfg.hidden_size, v.downsample_ratio
    specs: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], fmt: Format = "bf16") -> None:
        specs.append(TensorSpec(name, shape, fmt, "encoder." + name))

    add("vision.patch_embed.proj.weight", (w, 3 * v.patch_size**2))
    add("vision.patch_embed.proj.bias", (w,))
    for i in range(v.num_hidden_layers):
        p = f"vision.blocks.{i}."
        add(p + "norm1.weight", (w,), "fp32")
        add(p + "attn.wqkv.weight", (3 * w, w))
        add(p + "attn.wqkv.bias", (3 * w,))
        add(p + "attn.wo.weight", (w, w))
        add(p + "attn.wo.bias", (w,))
        add(p + "norm2.weight", (w,), "fp32")
        add(p + "mlp.w1.weight", (2 * v.intermediate_size, w))
        add(p + "mlp.w2.weight", (w, v.intermediate_size))
    add("vision.norm.weight", (w,), "fp32")
    add("aligner.w1.weight", (d, w * r * r))
    add("aligner.w1.bias", (d,))
    add("aligner.w2.weight", (d, d))
    add("aligner.w2.bias", (d,))
    for name in ("image_start", "image_end", "image_newline"):
        add(name, (d,))
    return specs


def stored_table(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every on-disk tensor (weights and scales): name → (shape, dtype)."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for spec in tensor_table(cfg).values():
        out.update(spec.stored())
    return out


def stored_bytes(cfg: ModelConfig) -> int:
    return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in stored_table(cfg).values())
