"""Hardware floors of a whole V4.1 step: the least time the bytes and FLOPs of one step can take.

A step is a sequence of ops that cannot overlap (each layer needs the last one's output), so its
floor is Σ over ops of max(bytes / bandwidth, FLOPs / peak), with bytes the fewest each op must
move (every weight it uses read once, KV read once) and FLOPs its matrix work. The per-op split
matters: at batch 256 the MoE GEMMs are memory-bound while attention is compute-bound, and a single
max over the step's totals would hide that.

Routing is uniform and random, as DeepInfer's benchmark forces it: with T tokens each picking k of
E experts, E·(1 − (1 − k/E)^T) experts are expected to hold tokens, and only their weights are read.
Weights are counted in the GPU's format: e4m3 with 128×128 fp32 scales for every FP8 matrix, the routed
experts as the path keeps them (``expert_format``: MXFP4 as released, half a byte per weight and one e8m0
byte per 32; or converted to FP8), bf16 embed/head, fp32 small tensors.

Attention per decode row and layer (spec §3.4): the window's ``sliding_window`` FP8 keys, and in
compressed layers the ``index_topk`` selected FP4 entries; index sources also scan every visible
index key (⌊context / ratio⌋ of them). Prefill rows see on average half the chunk's context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.deepseek_v41.checkpoint import tensor_table
from model.deepseek_v41.config import ModelConfig

FP8_SCALE_BYTES = 4 / (128 * 128)  # one fp32 scale per 128×128 block, per weight byte


@dataclass
class Op:
    name: str
    bytes: float
    flops: float
    peak: str = "fp8_peak"  # which matrix ceiling bounds its FLOPs


@dataclass
class StepCost:
    ops: list[Op] = field(default_factory=list)

    def add(self, name: str, nbytes: float, flops: float, peak: str = "fp8_peak") -> None:
        self.ops.append(Op(name, nbytes, flops, peak))

    def floor(self, ceil: dict[str, float]) -> float:
        """Seconds: Σ max(bytes / bandwidth, FLOPs / peak)."""
        return sum(max(op.bytes / ceil["bandwidth"], op.flops / ceil[op.peak]) for op in self.ops)

    def total_bytes(self) -> float:
        return sum(op.bytes for op in self.ops)

    def total_flops(self) -> float:
        return sum(op.flops for op in self.ops)


def expected_active_experts(num_tokens: int, num_experts: int, top_k: int) -> float:
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


def _gpu_bytes(shape: tuple[int, ...], fmt: str, expert_format: str | None = "fp8") -> float:
    numel = 1
    for s in shape:
        numel *= s
    if fmt == "mxfp4" and expert_format == "fp4":
        return numel * (0.5 + 1 / 32)
    if fmt in ("fp8_block", "mxfp4", "fp8_rowwise"):
        return numel * (1 + FP8_SCALE_BYTES)
    return numel * (2 if fmt == "bf16" else 4)


def _layer_weights(cfg: ModelConfig, expert_format: str | None = "fp8") -> dict[int, dict[str, float]]:
    """Per layer: bytes of the dense weights (every one read each step), of ONE routed expert, and
    the matrix parameters a token multiplies by (dense projections + shared expert)."""
    out = {
        i: {"dense": 0.0, "expert": 0.0, "dense_params": 0.0, "engram_row": 0.0} for i in range(cfg.num_hidden_layers)
    }
    for spec in tensor_table(cfg).values():
        if not spec.name.startswith("layers."):
            continue
        layer = out[int(spec.name.split(".")[1])]
        nbytes = _gpu_bytes(spec.shape, spec.fmt, expert_format)
        if ".ffn.experts." in spec.name:
            if spec.index == 0:
                layer["expert"] += nbytes
        elif ".engram.embed." in spec.name:
            layer["engram_row"] = spec.shape[-1] * (1 + 4 / 32)  # e4m3 row + its e8m0 scales, gathered
        else:
            layer["dense"] += nbytes
            if len(spec.shape) == 2 and spec.fmt != "fp32":
                layer["dense_params"] += spec.shape[0] * spec.shape[1]
    return out


def _attention(
    cost: StepCost, cfg: ModelConfig, layer: int, rows: int, keys_per_row: float, index_keys_per_row: float
) -> None:
    h, hd, di, hi = cfg.num_attention_heads, cfg.head_dim, cfg.index_head_dim, cfg.index_n_heads
    window_bytes = hd + hd / 64 + 1  # e4m3 + scales per key (CacheLayout.window_bytes ≈)
    entry_bytes = hd / 2 + hd / 32
    ratio = cfg.ratio(layer)
    selected = keys_per_row - cfg.sliding_window
    kv = rows * (cfg.sliding_window * window_bytes + max(selected, 0) * entry_bytes) + rows * h * hd * 2 * 2
    cost.add(f"attention {layer}", kv, 4 * h * hd * keys_per_row * rows, peak="bf16_peak")
    if ratio and layer in cfg.index_source_layer_ids:
        cost.add(
            f"indexer {layer}",
            rows * index_keys_per_row * (di / 2 + di / 32),
            2 * hi * di * index_keys_per_row * rows,
            peak="bf16_peak",
        )


def step_cost(
    cfg: ModelConfig, num_tokens: int, context: int, *, prefill: bool, expert_format: str | None = "fp8"
) -> StepCost:
    """One step of ``num_tokens`` rows: decode rows each at ``context``, or one prefill chunk of a
    ``num_tokens``-token prompt (``context`` = num_tokens then); routed experts read in ``expert_format``."""
    cost = StepCost()
    weights = _layer_weights(cfg, expert_format)
    e, k, inter, d = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hidden_size
    active = expected_active_experts(num_tokens, e, k)
    sampled = 1 if prefill else num_tokens
    avg_context = (context + 1) / 2 if prefill else context
    for layer in range(cfg.num_hidden_layers):
        w = weights[layer]
        cost.add(f"dense {layer}", w["dense"], 2 * num_tokens * w["dense_params"])
        cost.add(f"experts {layer}", active * w["expert"], 2 * num_tokens * k * 3 * inter * d)
        if w["engram_row"]:
            cost.add(f"engram {layer}", num_tokens * cfg.engram_hash_heads() * w["engram_row"], 0.0)
        ratio = cfg.ratio(layer)
        visible = avg_context // ratio if ratio else 0
        keys = min(cfg.sliding_window, avg_context) + (min(cfg.index_topk, visible) if ratio else 0)
        _attention(cost, cfg, layer, num_tokens, keys, visible)
    cost.add(
        "embed + head", num_tokens * d * 2 + cfg.vocab_size * d * 2, 2 * sampled * cfg.vocab_size * d, peak="bf16_peak"
    )
    return cost


# The target specification's floor table (its own HBM bandwidth and FP8 peak, 4K context), kept to print beside ours.
SPEC_FLOORS_MS = {
    ("decode", 1): 3.98,
    ("decode", 16): 16.2,
    ("decode", 64): 18.4,
    ("decode", 256): 20.7,
    ("prefill", 4096): 102.0,
    ("prefill", 32768): 833.0,
}
