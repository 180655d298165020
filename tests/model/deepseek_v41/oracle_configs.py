"""Random tiny configs compared against NeMo. Together they exercise every mechanism:

=========  ======================================================================================
config     what it covers
=========  ======================================================================================
oracle     the oracle's tiny schedule (spec §5.4): ratios 0,0,2,2,2,1,1,1; KV sources 2 (C2) and 5
           (C1); index sources 2, 4 (Reindex), 5 (candidate source), 7 (Reindex inside the
           candidates); reuse layers 3 and 6; Engram on 1 and 4 (2- and 3-grams); clamps 1.0
wide       C2 source at layer 1 and C1 source/candidate source at 3; 8 heads in 4 output groups;
           rope 32; candidate blocks of 4; Reindex at 2, 5 and 7; trailing ratio-0 layer after
           compressed ones; Engram on 0 and 5 with 4-grams × 3 heads; 3 of 6 experts; window 4
nocand     no candidate source; two C2 sources (1, 3) each with a reuse layer; 16 indexer heads;
           top-k 3; window 16; Engram on one layer (2-grams only)
vision-a   oracle's backbone with a 2-block tower (patch 14, downsample 3), one image per row
vision-b   nocand's backbone with a 3-block tower (patch 8, downsample 2, 3 heads, rope 100)
=========  ======================================================================================

Every prompt is long enough that the window, top-k, pooling (odd lengths leave a trailing
incomplete group) and the candidate blocks all truncate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from model.deepseek_v41.config import ModelConfig, YarnScaling
from model.deepseek_v41.engram import engram_primes
from model.deepseek_v41.vision_config import VisionConfig


@dataclass(frozen=True)
class OracleCase:
    name: str
    cfg: ModelConfig  # engram_compressed_vocab_size and table rows are filled in by `finish`
    seed: int
    seq_len: int
    batch: int = 2


def _base(**kw) -> ModelConfig:
    defaults = dict(
        vocab_size=256,
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
        index_n_heads=8,
        index_head_dim=32,
        index_topk=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        swiglu_limit=1.0,
        engram_max_ngram_size=3,
        engram_vocab_size=50,
        engram_n_heads=2,
        engram_head_dim=32,
        engram_compressed_vocab_size=1,
        num_nextn_predict_layers=0,
        dspark_noise_token_id=254,
    )
    defaults.update(kw)
    return ModelConfig(**defaults)


def finish(cfg: ModelConfig, num_compressed: int) -> ModelConfig:
    """Set the tokenizer-derived Engram size and tables exactly as large as their primes."""
    cfg = dataclasses.replace(
        cfg, engram_compressed_vocab_size=num_compressed, engram_num_embeddings=(10**9,) * len(cfg.engram_layer_ids)
    )
    rows = tuple(sum(p) for p in engram_primes(cfg))
    return dataclasses.replace(cfg, engram_num_embeddings=rows)


ORACLE = _base(
    compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 0),
    kv_source_layer_ids=(2, 5),
    index_source_layer_ids=(2, 4, 5, 7),
    candidate_source_layer_id=5,
    candidate_topk_blocks=4,
    candidate_block_size=2,
    engram_layer_ids=(1, 4),
    engram_num_embeddings=(1, 1),
)
WIDE = _base(
    num_attention_heads=8,
    o_groups=4,
    o_lora_rank=16,
    qk_rope_head_dim=32,
    sliding_window=4,
    compress_ratios=(0, 2, 2, 1, 1, 1, 1, 1, 0),
    kv_source_layer_ids=(1, 3),
    index_source_layer_ids=(1, 2, 3, 5, 7),
    candidate_source_layer_id=3,
    candidate_topk_blocks=3,
    candidate_block_size=4,
    index_topk=5,
    n_routed_experts=6,
    num_experts_per_tok=3,
    swiglu_limit=0.8,
    engram_layer_ids=(0, 5),
    engram_num_embeddings=(1, 1),
    engram_max_ngram_size=4,
    engram_n_heads=3,
)
NOCAND = _base(
    num_hidden_layers=6,
    compress_ratios=(0, 2, 2, 2, 2, 0),
    kv_source_layer_ids=(1, 3),
    index_source_layer_ids=(1, 3),
    candidate_source_layer_id=None,
    index_n_heads=16,
    index_topk=3,
    sliding_window=16,
    engram_layer_ids=(2,),
    engram_num_embeddings=(1,),
    engram_max_ngram_size=2,
)

CASES = [
    OracleCase("oracle", ORACLE, seed=8, seq_len=49),
    OracleCase("wide", WIDE, seed=3, seq_len=45),
    OracleCase("nocand", NOCAND, seed=33, seq_len=61),
]

# DSpark draft cases (test_dspark_oracle.py): the backbone of a case above plus draft stages.
# oracle-draft  3 stages tapping 5, 6, 7; blocks of 5; 8 draft experts, top-3; Markov rank 16
# wide-draft    2 stages tapping 2 and 6 (not the last layers); blocks of 4; window 4; 6 experts, top-2
DRAFT_CASES = [
    OracleCase(
        "oracle-draft",
        dataclasses.replace(
            ORACLE,
            compress_ratios=ORACLE.compress_ratios + (0, 0),
            num_nextn_predict_layers=3,
            dspark_target_layer_ids=(5, 6, 7),
            dspark_block_size=5,
            dspark_markov_rank=16,
            dspark_n_routed_experts=8,
            dspark_num_experts_per_tok=3,
        ),
        seed=8,
        seq_len=49,
    ),
    OracleCase(
        "wide-draft",
        dataclasses.replace(
            WIDE,
            compress_ratios=WIDE.compress_ratios + (0,),
            num_nextn_predict_layers=2,
            dspark_target_layer_ids=(2, 6),
            dspark_block_size=4,
            dspark_markov_rank=32,
            dspark_n_routed_experts=6,
            dspark_num_experts_per_tok=2,
        ),
        seed=3,
        seq_len=45,
    ),
]


@dataclass(frozen=True)
class VisionCase(OracleCase):
    grids: tuple[tuple[int, int], ...] = ()  # one image per batch row: its ViT patch grid (h, w)
    image_at: int = 0  # position of the image span's first placeholder in every row


# Two towers: the released patch 14 and downsample 3 (grids leaving partial 3×3 cells), and patch 8 with
# downsample 2, 3 heads of 16 and another rope base, on a different backbone. The placeholder id is an
# ordinary word of the toy vocabulary, as 129264 is of the real one.
VISION_A = dataclasses.replace(
    ORACLE,
    vision=VisionConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=48,
        max_image_tokens=64,
        min_pixels=42 * 42,
        image_token_id=250,
    ),
)
VISION_B = dataclasses.replace(
    NOCAND,
    vision=VisionConfig(
        num_hidden_layers=3,
        hidden_size=48,
        num_attention_heads=3,
        intermediate_size=40,
        patch_size=8,
        rope_theta=100.0,
        downsample_ratio=2,
        max_image_tokens=64,
        min_pixels=16 * 16,
        image_token_id=251,
    ),
)

VISION_CASES = [
    VisionCase("vision-a", VISION_A, seed=11, seq_len=41, grids=((5, 7), (7, 4)), image_at=9),
    VisionCase("vision-b", VISION_B, seed=12, seq_len=43, grids=((5, 7), (4, 6)), image_at=6),
]
