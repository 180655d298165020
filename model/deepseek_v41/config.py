"""DeepSeek-V4.1 text configuration (spec §2), read from the composite HF ``config.json``.

The checkpoint's ``config.json`` holds ``text_config`` (the backbone and the DSpark draft),
``vision_config`` and ``quantization_config``. ``text_config`` shapes the backbone and the draft,
``vision_config`` the vision tower (``ModelConfig.vision``, see ``vision_config.py``).

Values the references do not implement, or implement differently from each other, are rejected
with a ``ValueError`` naming the field, rather than silently computing something else.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.deepseek_v41.vision_config import VisionConfig, vision_from_hf, vision_to_hf

# The released config key for the Engram pad token is unknown (spec §7.2); both spellings are read.
ENGRAM_PAD_KEYS = ("engram_pad_token_id", "engram_pad_id")


@dataclass(frozen=True)
class YarnScaling:
    """YaRN applied to the compress rope only (spec §3.5): frequency interpolation, no mscale."""

    factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 65536


@dataclass(frozen=True)
class ModelConfig:
    """Backbone hyper-parameters; names follow the HF/NeMo ``text_config`` keys (spec §2)."""

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling = field(default_factory=YarnScaling)
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer_id: int | None = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16_000_000
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    # DSpark draft (spec §3.12): stages ``mtp.0..`` after the backbone's layers (ratio-0 entries in
    # compress_ratios); 0 stages = no draft.
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5  # draft positions per block: the anchor then noise tokens
    dspark_noise_token_id: int = 128799  # the token in every non-anchor slot of a block
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)  # layers whose attention-input streams are tapped
    dspark_markov_rank: int = 256  # rank of the Markov head's token-transition bias
    dspark_n_routed_experts: int = 128  # routed experts in each draft stage's MoE
    dspark_num_experts_per_tok: int = 3
    vision: VisionConfig | None = None  # the vision tower and image sizing; None: text only
    # Fields the text backbone does not read, carried so a config round-trips.
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        validate(self)

    # ---- layer roles (spec §3.4) -------------------------------------------------------------

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_for(self, layer: int) -> int | None:
        """The nearest KV source at or below ``layer`` for a compressed layer, else None."""
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def index_source_for(self, layer: int) -> int | None:
        """The nearest index source at or below ``layer`` whose top-k this layer uses, else None."""
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.index_source_layer_ids if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        """Index sources after the candidate source restrict their scores to its blocks."""
        return (
            self.candidate_source_layer_id is not None
            and layer in self.index_source_layer_ids
            and layer > self.candidate_source_layer_id
        )

    def engram_hash_heads(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads


def _positive_int(name: str, value: Any) -> None:
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def validate(cfg: ModelConfig) -> None:
    """Raise ValueError for shapes or schedules the model does not implement."""
    for name in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "head_dim",
        "qk_rope_head_dim",
        "q_lora_rank",
        "o_groups",
        "o_lora_rank",
        "sliding_window",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "hc_mult",
        "hc_sinkhorn_iters",
    ):
        _positive_int(name, getattr(cfg, name))
    if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim > min(cfg.head_dim, cfg.index_head_dim):
        raise ValueError(
            f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even and at most head_dim and index_head_dim"
        )
    if cfg.num_attention_heads % cfg.o_groups:
        raise ValueError(f"num_attention_heads={cfg.num_attention_heads} must be divisible by o_groups={cfg.o_groups}")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ValueError("num_experts_per_tok must not exceed n_routed_experts")
    if cfg.num_experts_per_tok < 2:
        # NeMo skips the top-k renormalisation for top-1 while the spec always renormalises.
        raise ValueError("num_experts_per_tok must be at least 2 (top-1 renormalisation differs between references)")
    for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor"):
        value = getattr(cfg, name)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be finite and positive, got {value!r}")
    if not math.isfinite(cfg.swiglu_limit) or cfg.swiglu_limit <= 0:
        raise ValueError(f"swiglu_limit must be finite and positive, got {cfg.swiglu_limit!r}")
    _validate_schedule(cfg)
    _validate_engram(cfg)
    _validate_draft(cfg)
    if cfg.vision is not None and not 0 <= cfg.vision.image_token_id < cfg.vocab_size:
        raise ValueError(f"image_token_id={cfg.vision.image_token_id} is outside the vocabulary")


def _validate_schedule(cfg: ModelConfig) -> None:
    n = cfg.num_hidden_layers
    if len(cfg.compress_ratios) < n:
        raise ValueError(f"compress_ratios has {len(cfg.compress_ratios)} entries for {n} layers")
    for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
        ids = list(getattr(cfg, name))
        if ids != sorted(set(ids)) or any(type(i) is not int or not 0 <= i < n for i in ids):
            raise ValueError(f"{name}={ids} must be strictly increasing layer ids below num_hidden_layers={n}")
    ratios = cfg.compress_ratios[:n]
    if any(r not in (0, 1, 2) for r in ratios):
        raise ValueError(f"compress_ratios {list(ratios)}: only 0, 1 and 2 are supported (V4.1 CSA2)")
    if not set(cfg.kv_source_layer_ids) <= set(cfg.index_source_layer_ids):
        raise ValueError("every kv_source_layer_ids entry must also be an index source")
    owner_ratio = None
    for layer, ratio in enumerate(ratios):
        if ratio == 0:
            if layer in cfg.kv_source_layer_ids or layer in cfg.index_source_layer_ids:
                raise ValueError(f"layer {layer} has compress ratio 0 and cannot be a KV or index source")
            continue
        if layer in cfg.kv_source_layer_ids:
            owner_ratio = ratio
        if owner_ratio != ratio:
            raise ValueError(f"compressed layer {layer} needs a preceding KV source with ratio {ratio}")
    cand = cfg.candidate_source_layer_id
    if cand is not None:
        if cand not in cfg.kv_source_layer_ids:
            raise ValueError(f"candidate_source_layer_id={cand} must be a KV source")
        if any(s > cand for s in cfg.kv_source_layer_ids):
            # A later KV source would publish keys the candidate blocks do not index.
            raise ValueError("no KV source may follow candidate_source_layer_id")
        _positive_int("candidate_topk_blocks", cfg.candidate_topk_blocks)
        _positive_int("candidate_block_size", cfg.candidate_block_size)


def _validate_engram(cfg: ModelConfig) -> None:
    if len(cfg.engram_num_embeddings) != len(cfg.engram_layer_ids):
        raise ValueError("engram_num_embeddings needs one row count per engram_layer_ids entry")
    if not cfg.engram_layer_ids:
        return
    for name in ("engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size"):
        _positive_int(name, getattr(cfg, name))
    if cfg.engram_max_ngram_size < 2:
        raise ValueError(f"engram_max_ngram_size={cfg.engram_max_ngram_size} must be at least 2")
    if not 0 <= cfg.engram_pad_token_id < cfg.vocab_size:
        raise ValueError(f"engram_pad_token_id={cfg.engram_pad_token_id} is outside the vocabulary")
    for rows in cfg.engram_num_embeddings:
        _positive_int("engram_num_embeddings entry", rows)


def _validate_draft(cfg: ModelConfig) -> None:
    stages = cfg.num_nextn_predict_layers
    if type(stages) is not int or stages < 0:
        raise ValueError(f"num_nextn_predict_layers must be a non-negative integer, got {stages!r}")
    if not stages:
        return
    for name in ("dspark_block_size", "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok"):
        _positive_int(name, getattr(cfg, name))
    n = cfg.num_hidden_layers
    ratios = cfg.compress_ratios[n : n + stages]
    if len(ratios) < stages or any(ratios):
        raise ValueError(
            f"compress_ratios needs {stages} ratio-0 entries after the {n} backbone layers for the "
            f"DSpark stages, got {list(ratios)}"
        )
    ids = list(cfg.dspark_target_layer_ids)
    if not ids or ids != sorted(set(ids)) or any(type(i) is not int or not 0 <= i < n for i in ids):
        raise ValueError(
            f"dspark_target_layer_ids={ids} must be strictly increasing layer ids below num_hidden_layers={n}"
        )
    if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size:
        raise ValueError(f"dspark_noise_token_id={cfg.dspark_noise_token_id} is outside the vocabulary")
    if not 2 <= cfg.dspark_num_experts_per_tok <= cfg.dspark_n_routed_experts:
        raise ValueError("dspark_num_experts_per_tok must be at least 2 and at most dspark_n_routed_experts")


# ---- reading and writing config.json ---------------------------------------------------------

_REQUIRED_ENUMS = {
    "num_key_value_heads": 1,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def from_hf_dict(data: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a composite HF config dict (``text_config`` inside) or a bare text config."""
    text = dict(data.get("text_config", data))
    for key, required in _REQUIRED_ENUMS.items():
        value = text.get(key, data.get(key, required))
        if value != required:
            raise ValueError(f"unsupported {key}={value!r}: DeepSeek-V4.1 requires {required!r}")
    if text.get("gate_temp", 1.0) != 1.0:
        raise ValueError(f"unsupported gate_temp={text['gate_temp']!r}: only 1.0 is implemented")
    pads = {k: text[k] for k in ENGRAM_PAD_KEYS if k in text}
    if len(set(pads.values())) > 1:
        raise ValueError(f"conflicting Engram pad keys {pads}")
    kwargs: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(ModelConfig)} - {"extra", "rope_scaling", "vision"}
    for name in names:
        if name in text:
            value = text[name]
            kwargs[name] = tuple(value) if isinstance(value, list) else value
    if pads:
        kwargs["engram_pad_token_id"] = next(iter(pads.values()))
    if kwargs.get("candidate_source_layer_id") == -1:
        kwargs["candidate_source_layer_id"] = None
    kwargs["rope_scaling"] = _yarn(text.get("rope_scaling"))
    kwargs["vision"] = vision = vision_from_hf(data)
    read_elsewhere = {"text_config"} | ({"vision_config", "image_token_id"} if vision is not None else set())
    extra = {k: v for k, v in data.items() if k not in read_elsewhere}
    extra["text_config"] = {k: v for k, v in text.items() if k not in names and k not in ENGRAM_PAD_KEYS}
    return ModelConfig(**kwargs, extra=extra)


def _yarn(raw: dict[str, Any] | None) -> YarnScaling:
    if raw is None:
        return YarnScaling()
    kind = raw.get("rope_type", raw.get("type"))
    if kind != "yarn":
        raise ValueError(f"unsupported rope_scaling type {kind!r}: the compress rope uses 'yarn'")
    for key in ("mscale", "mscale_all_dim"):
        if raw.get(key, 0) not in (0, 1, None):
            raise ValueError(f"unsupported rope_scaling.{key}={raw[key]!r}: V4.1 applies no YaRN mscale")
    y = YarnScaling(
        factor=float(raw.get("factor", 16.0)),
        beta_fast=float(raw.get("beta_fast", 32.0)),
        beta_slow=float(raw.get("beta_slow", 1.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 65536)),
    )
    if y.factor < 1 or y.original_max_position_embeddings <= 0:
        raise ValueError(f"unsupported rope_scaling {raw!r}")
    return y


def to_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """Composite HF config dict (the layout NeMo's ``DeepseekV41Config`` reads), fp32 dtype."""
    text = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.name not in ("extra", "rope_scaling", "vision")
    }
    text = {k: list(v) if isinstance(v, tuple) else v for k, v in text.items()}
    text["candidate_source_layer_id"] = -1 if cfg.candidate_source_layer_id is None else cfg.candidate_source_layer_id
    text["rope_scaling"] = {"rope_type": "yarn", **dataclasses.asdict(cfg.rope_scaling)}
    text.update(_REQUIRED_ENUMS)
    text.update({"num_hidden_layers": cfg.num_hidden_layers, "routed_scaling_factor": cfg.routed_scaling_factor})
    extra_text = dict(cfg.extra.get("text_config", {}))
    text = {**extra_text, **text}
    text.setdefault("dtype", "float32")
    out = {k: v for k, v in cfg.extra.items() if k != "text_config"}
    out.setdefault("architectures", ["DeepseekV41ForCausalLM"])
    out.setdefault("model_type", "deepseek_v41")
    out.setdefault("dtype", "float32")
    if cfg.vision is not None:
        out.update(vision_to_hf(cfg.vision))
    else:
        out.setdefault("vision_config", {"num_hidden_layers": 0})
    out.setdefault("bos_token_id", cfg.bos_token_id)
    out.setdefault("eos_token_id", cfg.eos_token_id)
    out.setdefault("pad_token_id", cfg.pad_token_id)
    out.setdefault("tie_word_embeddings", False)
    out["text_config"] = text
    return out


def load_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` (a file, or a checkpoint directory containing one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json at {path}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    return from_hf_dict(data)
