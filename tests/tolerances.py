"""Numerical thresholds, defined once and used by every numerics test, each with its derivation.

Rule: a comparison of two paths that do the same maths runs in batch-invariant mode and uses
``==`` (docs/batch-invariance.md); a bound remains only where the arithmetic differs by design (Triton
kernels against torch references, FP8 against fp32, bf16 against fp32, CUDA graphs against eager, the
default mode's cached engine), and a quantisation bin flip is allowed only where the boundary tracing of
``tests/model/deepseek_v41/quant_boundary.py`` proves it one. Every tolerance site of ``tests/`` and its
decision is listed in docs/accuracy.md, "Test tolerances".

Units: u32 = 2^-24 is fp32's unit roundoff (half an ulp at 1.0), u_bf16 = 2^-8 bf16's.
"""

# fp32 unit roundoff.
U_FP32 = 2.0**-24
# bf16 unit roundoff: a round-to-nearest cast moves a value by at most this, relative.
U_BF16 = 2.0**-8

# --- the model against the NeMo oracle ----------------------------------------------------------------

# Full-sequence logits vs the NeMo oracle: max |Δ| over the vocabulary at every compared position. Two
# implementations of one fp32 forward (other op order, other fused kernels) after traced flips are replayed:
# per-op differences are a few u32 relative, and the random configs' logits are O(1)–O(10) after up to 8
# layers that each amplify an input perturbation (docs/accuracy.md, table 1: the smooth gain is high), so
# the residual is ~1e-6–1e-5; the bound is 10× above that and 100× below SENSITIVITY_MIN_MOVE (a real defect).
LOGITS_ATOL = 1e-4
# A quantisation bin flip is "traced" when a pre-quantisation value that rounded differently lies
# this close (input units) to a rounding or block-scale boundary. fp32 reassociation moves an O(1)
# pre-quantisation value by a few u32 per op over a layer (≲ 1e-6); 1e-5 is 10× that, and still 1,000× below
# the smallest e4m3/e2m1 step of the test configs' values (~1e-2), so a real rounding defect is not excused.
FLIP_BOUNDARY_TOL = 1e-5
# More exempted positions than this fraction means the config must be reseeded (a coverage rule, not a
# numeric bound: at most 1 in 10 compared positions may be lost to oracle near ties).
MAX_EXEMPT_FRACTION = 0.10
# Argmax must agree wherever the oracle's top-2 logit margin is at least this: 10× LOGITS_ATOL, so two
# logit vectors within LOGITS_ATOL cannot swap the top two there.
ARGMAX_MARGIN = 1e-3
# An oracle top-k row (indexer entries, candidate blocks, MoE experts) whose k-th and (k+1)-th scores
# are closer than this is a near tie: the selection may depend on tie-breaking or rounding noise, so
# that position onwards is exempt, and counts towards MAX_EXEMPT_FRACTION (reseed beyond it). 10× the
# FLIP_BOUNDARY_TOL noise scale: scores that differ by fp32 noise alone cannot reorder a wider gap.
TOPK_MARGIN_MIN = 1e-4
# The same near-tie rule where both sides are this model on one machine (the cached engine against its own
# full forward): their scores differ by fp32 reordering only, ≤ 4.8e-6 as measured on the logits downstream
# (test_engine_equals_model's printed max |Δ| at OMP_NUM_THREADS 1, 2, 4 and ATEN_CPU_CAPABILITY default,
# avx2, avx512), so a gap of 10^-5 is not reordered by it. A different pick would still fail the comparison
# (PREFIX_ATOL): a smaller margin only compares more positions. The NeMo oracle's TOPK_MARGIN_MIN stays 10× larger:
# another implementation.
SAME_MODEL_TOPK_MARGIN_MIN = 1e-5
# A switched-off mechanism must move the logits by at least this much (sensitivity tests): 100× LOGITS_ATOL,
# so a move this large cannot be rounding noise.
SENSITIVITY_MIN_MOVE = 1e-2
# Paths whose arithmetic differs from the full forward's by design (kernels, graphs, the default mode's
# cached engine after traced flips are replayed). Same-maths comparisons run in batch-invariant mode under ==
# instead. Residuals measured against it (docs/batch-invariance.md, "What stays a tolerance"): 6.7e-6 max
# per step for graph replays against eager and 2.9e-6 to 5.4e-6 for the fp32 kernel engine against the full
# forward (H200); 2.4e-6 to 4.8e-6 for the CPU default mode's cached engine after replay, over the thread
# counts and CPU capabilities of docs/accuracy.md, "Test tolerances".
PREFIX_ATOL = 1e-5
# Vision tower + aligner embeddings vs the NeMo oracle: max |Δ| over every image-token feature.
# Both compute in fp32 from the same BF16-stored weights; the residual is summation order (GEMM blocking,
# SDPA), a few fp32 ulp of O(1) values, far below this bound.
VISION_ATOL = 1e-4

# --- kernels against their torch references -----------------------------------------------------------

# An fp32 kernel against its fp32 torch reference, max |Δ| relative to max |reference| (or relative
# Frobenius error): only the summation order differs. Two orders of a length-K fp32 reduction differ by a
# random walk of K roundings, ≈ √(2K)·u32·S with S the largest partial sum: ≤ 7.6e-6·S at K ≤ 8,192, the
# longest reduction these tests run (GEMM K ≤ 7,168; attention ≤ 2,048 keys; split-K partials), and for the
# normalised outputs tested S is within a small factor of max |reference|. Measured in the fp32 engine tests
# (tests/services/worker/kernel_model/test_backend.py): ≤ 3.5e-6 on logits.
FP32_REORDER_REL = 1e-5
# A bf16 output (fp32 accumulation, one cast at the end) against the fp32 reference, elementwise relative:
# the cast moves a value by ≤ U_BF16; the interpreter casts by truncation (≤ 2·U_BF16 = 2^-7), and the fp32
# reordering ahead of the cast is below FP32_REORDER_REL, taken as its absolute floor near zero.
BF16_CAST_REL = 2.0 * U_BF16
# An FP8 linear layer (e4m3 activations and weights, block scales) against the fp32 product, relative
# Frobenius error: one e4m3 round-to-nearest cast has RMS relative error 3.25% (measured on N(0, 9) data:
# ``x.to(torch.float8_e4m3fn)``), two independent casts give √2 × 3.25% = 4.6%; measured 3.7% on a random
# 96 × 200 layer. The bound is 1.09× the derived RMS, 1.35× the measured.
FP8_LINEAR_REL = 0.05
# A bf16 output through the Triton interpreter's fp32 → bf16 cast, which truncates: the error is uniform
# in [0, 1) ulp, RMS relative ≈ 2^-7/√3 at mantissa 1 and 3.3e-3 averaged over mantissas, relative
# Frobenius error measured 4.0e-3 (tests/kernels/test_moe_grouped_gemm.py, moe_experts). On the GPU the cast
# rounds to nearest (1.7e-3 RMS relative, measured on N(0, 9) data), so the bound holds there too.
BF16_TRUNC_REL = 1e-2
# A bf16-dot attention path (q and the unnormalised P cast to bf16, bf16 output) against the fp32
# reference, relative Frobenius error: one round-to-nearest cast has RMS relative error 1.66e-3 (measured on
# N(0, 9) data: ``x.to(torch.bfloat16)``; ≈ U_BF16/√3 × the mean of 1/mantissa), so three independent casts
# give √3 × 1.66e-3 = 2.9e-3; the bound is 1.7× that. Measured ~1e-3 at Flash shapes (H200) and 1.5–2.2e-3 at
# the tiny shapes (tests/kernels/bf16_emulation.py).
BF16_PATH_REL = 5e-3
# The same bf16-dot kernel against a torch emulation of exactly its casts: what remains is P rounded
# against a running (not the global) row max. Measured ≤ 4.0e-4 (decode) and ≤ 2.3e-4 (prefill) at the tiny
# shapes; the bound is 2.5× the larger, still 5× below BF16_PATH_REL (a missing or extra cast would show).
BF16_EMULATION_REL = 1e-3
