"""Model presets, defined in this one place.

``tiny``   the built-in default: the oracle's tiny shapes (spec §5.4) with the real DeepSeek
           vocabulary (129,280 ids, 99,092 Engram-compressed ids), a 3-stage DSpark draft tapping
           layers 5–7, and a 2-block vision tower with the released patch 14 and downsample 3 but a
           64-token image budget. Runs on CPU.
``v41-s1`` the single-H200 benchmark shape: Flash per-layer shapes (spec §2), 40 layers, 48 routed
           experts per layer, FP8/MXFP4 weights. Engram tables are shrunk by drawing the hash primes
           above 3,000,000 instead of 16,000,000 (rows per table: ``ENGRAM_S1_ROWS``), about 80 GB
           in all, so it lives only in GPU memory, created from a seed.
``v41-s1-dspark`` v41-s1 with the released 3-stage DSpark draft (tapping layers 37–39), its experts cut
           as the target's are (128 → 16 routed per stage, an eighth, like 384 → 48): the shape that
           ``shinkai bench speculative`` measures speculation on, since a draft's step costs next to a
           real-width target's are what decide its speed-up. 1.6 GB more in released formats, also GPU-only.
"""

from __future__ import annotations

import dataclasses

from model.deepseek_v41.config import ModelConfig, YarnScaling
from model.deepseek_v41.vision_config import VisionConfig

# Small enough for CPU tests: a 64-token span budget is at most 7 × 7 image tokens (21 × 21 patches),
# and images below 42 × 42 pixels (one image token) are scaled up to it.
TINY_VISION = VisionConfig(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=2,
    intermediate_size=48,
    max_image_tokens=64,
    min_pixels=42 * 42,
)

TINY = ModelConfig(
    vocab_size=129280,
    hidden_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    rope_scaling=YarnScaling(),
    sliding_window=8,
    compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0),
    kv_source_layer_ids=(2, 5),
    index_source_layer_ids=(2, 4, 5, 7),
    candidate_source_layer_id=5,
    candidate_topk_blocks=4,
    candidate_block_size=2,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    swiglu_limit=1.0,
    engram_layer_ids=(1, 4),
    engram_num_embeddings=(240, 306),
    engram_max_ngram_size=3,
    engram_vocab_size=50,
    engram_n_heads=2,
    engram_head_dim=32,
    engram_compressed_vocab_size=99092,
    # The draft's tensors come after every backbone tensor in the init order, so the backbone's
    # random weights (and outputs) are those of the draft-less tiny preset.
    num_nextn_predict_layers=3,
    dspark_target_layer_ids=(5, 6, 7),
    dspark_markov_rank=16,
    dspark_n_routed_experts=8,
    dspark_num_experts_per_tok=3,
    # The vision tower's tensors come last (after the draft's), so the text and draft weights are
    # those of the tower-less preset.
    vision=TINY_VISION,
)

ENGRAM_S1_VOCAB = 3_000_000
# Σ of each layer's 24 primes drawn above ENGRAM_S1_VOCAB (checked in tests against engram_primes).
ENGRAM_S1_ROWS = (72_004_620, 72_014_888)

V41_S1 = dataclasses.replace(
    ModelConfig(),
    n_routed_experts=48,
    engram_vocab_size=ENGRAM_S1_VOCAB,
    engram_num_embeddings=ENGRAM_S1_ROWS,
    num_nextn_predict_layers=0,
)

V41_S1_DSPARK = dataclasses.replace(
    V41_S1,
    num_nextn_predict_layers=3,
    dspark_n_routed_experts=16,
)

PRESETS: dict[str, ModelConfig] = {"tiny": TINY, "v41-s1": V41_S1, "v41-s1-dspark": V41_S1_DSPARK}
GPU_ONLY = {"v41-s1", "v41-s1-dspark"}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
