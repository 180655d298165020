#!/usr/bin/env bash
# Session 12's checks in one device call (about 9 minutes): DeepGEMM built in the background (gpu_deepgemm.sh,
# DEEPGEMM_BUILD_ONLY) while the gpu tests of the session's kernels run (GPU_TESTS, space-separated); then the step
# bench's prefill sizes on v41-s1 with SHINKAI_MOE_GEMM=deepgemm against the session-11 sizes run (Triton experts);
# then the DSpark proposal's launches and issue 20's batch-1 speculative row with the draft on the kernel set.
# Results in $OUT (or ./out).
set -uo pipefail
. scripts/device_env.sh
export PYTHONPATH="$PWD:$site"
DEEPGEMM_BUILD_ONLY=1 bash scripts/gpu_deepgemm.sh > "$out/deepgemm-build.log" 2>&1 &
build=$!
if [ -n "${GPU_TESTS:-}" ]; then
    # shellcheck disable=SC2086 # a list of files
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rs $GPU_TESTS > "$out/tests-gpu.log" 2>&1
    grep -E "^FAILED|^ERROR|passed|failed" "$out/tests-gpu.log" | tail -8
fi
wait $build; tail -3 "$out/deepgemm-build.log"
if ls /tmp/deepgemm/deep_gemm/_C*.so > /dev/null 2>&1; then
    echo "== step bench, SHINKAI_MOE_GEMM=deepgemm"
    PYTHONPATH="$PWD:$site:/tmp/deepgemm" SHINKAI_MOE_GEMM=deepgemm DG_JIT_CACHE_DIR=/tmp/deepgemm-jit \
        timeout 200 python3 -m services.bench.step --batches 1 --contexts 4096 --prefill-tokens 1024,4096,16384 \
        --no-compare --no-async --baseline docs/step-h200-2026-12-02-sizes.json --json "$out/step-deepgemm.json" \
        > "$out/step-deepgemm.log" 2>&1
    echo "step rc $?"; grep -E "^prefill|^decode  ctx" "$out/step-deepgemm.log" | head -10
fi
timeout 90 python3 -m services.bench.draft_proposal --device cuda --kernel-backend fp8 --cuda-graphs --batch 1 \
    --static-proposal --json "$out/draft-proposal.json" > "$out/draft-proposal.log" 2>&1
echo "draft_proposal rc $?"; tail -15 "$out/draft-proposal.log"
left=$((560 - SECONDS)); [ "$left" -gt 60 ] || exit 0
timeout "$left" python3 -m services.bench.speculative --num-speculative-tokens 5 --max-tokens 64 --kernel-backend fp8 \
    --cuda-graphs --json "$out/speculative-b1.json" --batch 1 --acceptance 0 0.5 0.8 1 --modes fixed varlen \
    > "$out/speculative-b1.log" 2>&1
echo "speculative b1 rc $?"; grep "batch" "$out/speculative-b1.log"
