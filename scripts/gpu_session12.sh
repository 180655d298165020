#!/usr/bin/env bash
# Session 12's checks in one device call, each part switched by the environment:
# - GPU_TESTS (space-separated files): their gpu-marked tests, while DeepGEMM builds in the background;
# - DEEPGEMM_STEP=1: DeepGEMM built (gpu_deepgemm.sh, DEEPGEMM_BUILD_ONLY), then the step bench's prefill sizes on
#   v41-s1 with SHINKAI_MOE_GEMM=deepgemm, against the session-11 sizes run (Triton experts);
# - DEEPGEMM_CASES (e.g. "decode:1,decode:16"): the MoE-layer kernel bench at those sizes (after DEEPGEMM_STEP's build);
# - DRAFT_PROPOSAL=1: the DSpark proposal's launches and host reads (services.bench.draft_proposal, fp8, graphs);
# - SPEC_ACCEPT (e.g. "0 0.8"): issue 20's batch-1 speculative row at those forced acceptances, fixed and varlen.
# The call stays under LIMIT_S (default 540). Results in $OUT (or ./out).
set -uo pipefail
. scripts/device_env.sh
export PYTHONPATH="$PWD:$site"
limit=${LIMIT_S:-540}
if [ -n "${DEEPGEMM_STEP:-}" ]; then
    DEEPGEMM_BUILD_ONLY=1 bash scripts/gpu_deepgemm.sh > "$out/deepgemm-build.log" 2>&1 &
    build=$!
fi
if [ -n "${GPU_TESTS:-}" ]; then
    # shellcheck disable=SC2086 # a list of files
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rs $GPU_TESTS > "$out/tests-gpu.log" 2>&1
    grep -E "^FAILED|^ERROR|passed|failed" "$out/tests-gpu.log" | tail -8
fi
if [ -n "${DEEPGEMM_STEP:-}" ]; then
    wait "$build"; tail -2 "$out/deepgemm-build.log"
    if ls /tmp/deepgemm/deep_gemm/_C*.so > /dev/null 2>&1; then
        PYTHONPATH="$PWD:$site:/tmp/deepgemm" SHINKAI_MOE_GEMM=deepgemm DG_JIT_CACHE_DIR=/tmp/deepgemm-jit \
            timeout 200 python3 -m services.bench.step --batches 1 --contexts 4096 --prefill-tokens 1024,4096,16384 \
            --no-compare --no-async --baseline docs/results/step-v41-s1-sizes.json --json "$out/step-deepgemm.json" \
            > "$out/step-deepgemm.log" 2>&1
        echo "step (deepgemm) rc $?"; grep -E "^prefill|^decode  ctx" "$out/step-deepgemm.log" | head -10
    fi
fi
if [ -n "${DEEPGEMM_CASES:-}" ] && ls /tmp/deepgemm/deep_gemm/_C*.so > /dev/null 2>&1; then
    PYTHONPATH="$PWD:$site:/tmp/deepgemm" DG_JIT_CACHE_DIR=/tmp/deepgemm-jit SHINKAI_DEEPGEMM_CASES="$DEEPGEMM_CASES" \
        timeout 120 python3 -m services.bench.kernels --only deepgemm_moe --json "$out/deepgemm-cases.json" \
        > "$out/deepgemm-cases.log" 2>&1
    echo "deepgemm cases rc $?"; grep -E "^  (decode|prefill|DeepGEMM)" "$out/deepgemm-cases.log" | head -20
fi
if [ -n "${DRAFT_PROPOSAL:-}" ]; then
    timeout 90 python3 -m services.bench.draft_proposal --device cuda --kernel-backend fp8 --cuda-graphs --batch 1 \
        --static-proposal --json "$out/draft-proposal.json" > "$out/draft-proposal.log" 2>&1
    echo "draft_proposal rc $?"; tail -12 "$out/draft-proposal.log"
fi
left=$((limit - SECONDS))
if [ -n "${SPEC_ACCEPT:-}" ] && [ "$left" -gt 60 ]; then
    # shellcheck disable=SC2086 # a list of acceptances
    timeout "$left" python3 -m services.bench.speculative --num-speculative-tokens 5 --max-tokens 64 \
        --kernel-backend fp8 --cuda-graphs --json "$out/speculative-b1.json" --batch 1 --acceptance $SPEC_ACCEPT \
        --modes fixed varlen > "$out/speculative-b1.log" 2>&1
    echo "speculative b1 rc $?"; grep "batch" "$out/speculative-b1.log"
fi
