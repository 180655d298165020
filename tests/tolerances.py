"""Numerical thresholds, defined once and used by every numerics test."""

# Full-sequence logits vs the NeMo oracle: max |Δ| over the vocabulary at every compared position.
LOGITS_ATOL = 1e-4
# A quantisation bin flip is "traced" when a pre-quantisation value that rounded differently lies
# this close (input units) to a rounding or block-scale boundary.
FLIP_BOUNDARY_TOL = 1e-5
# More exempted positions than this fraction means the config must be reseeded.
MAX_EXEMPT_FRACTION = 0.10
# Argmax must agree wherever the oracle's top-2 logit margin is at least this.
ARGMAX_MARGIN = 1e-3
# An oracle top-k row (indexer entries, candidate blocks, MoE experts) whose k-th and (k+1)-th scores
# are closer than this is a near tie: the selection may depend on tie-breaking or rounding noise, so
# that position onwards is exempt, and counts towards MAX_EXEMPT_FRACTION (reseed beyond it).
TOPK_MARGIN_MIN = 1e-4
# A switched-off mechanism must move the logits by at least this much (sensitivity tests).
SENSITIVITY_MIN_MOVE = 1e-2
# Paths whose arithmetic differs from the full forward's by design (kernels, graphs, the default mode's
# cached engine after traced flips are replayed). Same-maths comparisons run in batch-invariant mode under ==
# instead; the residuals this bound was checked against are in docs/batch-invariance.md, "What stays a tolerance".
PREFIX_ATOL = 1e-5
# Vision tower + aligner embeddings vs the NeMo oracle (issue 22): max |Δ| over every image-token feature.
# Both compute in fp32 from the same BF16-stored weights; the residual is summation order (GEMM blocking,
# SDPA), a few fp32 ulp of O(1) values, far below this bound.
VISION_ATOL = 1e-4
