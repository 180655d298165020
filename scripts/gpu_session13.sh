#!/usr/bin/env bash
# Session 13's checks in one device call, each part switched by the environment:
# - GPU_TESTS (space-separated files): their gpu-marked tests, within GPU_TESTS_S seconds (default 150);
# - SPEC_BATCHES (e.g. "1" or "16 64"): issue 20's table on v41-s1-dspark (v41-s1 plus the released 3-stage
#   draft at an eighth of its experts) at those batches, SPEC_ACCEPT acceptances (default "0 0.8 1") and
#   SPEC_MODES (default "fixed varlen"), fp8 kernels and CUDA graphs, 512-token prompts, 128 tokens each
#   (SPEC_PROFILE=1: each case also profiled: device ms, launches and top kernels a step; SPEC_ASYNC=1: async
#   scheduling);
# - TINY_SPEC=1: the same at batch 1 on tiny (the table the session-11 figures came from);
# - KL_DEEPGEMM=1: DeepGEMM built (gpu_deepgemm.sh), then the contractive FP8 KL test at v41 width with
#   SHINKAI_MOE_GEMM=deepgemm (its 1,024-token chunks take DeepGEMM's grouped products);
# - PROFILE=1: `services.bench.step --quick --profile` (the launches per decode step); with DEEPGEMM=1, DeepGEMM
#   built first and on the path, so prefill's experts take it (the default where it imports).
# - STEP_SIZES (e.g. "1024,4096,16384"): the step bench's prefill at those sizes (and decode b1 at 4K), after
#   DEEPGEMM's build when asked for;
# - FULL_SIZES=1: issue 21's sizes run (batches 1-256 at 4K and 32K, prefill 1K-32K) with --profile, after
#   DEEPGEMM's build when asked for;
# - THREE_WAY=1: `services.bench.step --quick --batches 1,256` with the eager / torch.compile / engine comparison
#   (the 8-layer subset at batch 1 and 64) and the async offline batch-256 run (GPU busy), after DEEPGEMM's build;
# - GEMM_BENCH=1: `services.bench.kernels --only prefill_gemms` (the projections and the grouped wo_a, Triton
#   against cuBLASLt);
# - MOE_CONFIGS=1: the MoE grouped GEMM's launch configs swept (services/bench/kernels_moe_configs.py), the
#   device's table written to kernels/configs/ (and copied to $OUT);
# - STEP_AB (e.g. "1,16,64,256"): decode at those batches (4K) and prefill of 1K, first with the config table off
#   (SHINKAI_MOE_CONFIGS=0), then on;
# - WINDOW_BENCH=1: prefill attention with window keys staged vs dequantised in the loop (kernels_prefill_attention).
# Each part gets what is left of LIMIT_S (default 560). Results in $OUT (or ./out).
set -uo pipefail
. scripts/device_env.sh
export PYTHONPATH="$PWD:$site"
limit=${LIMIT_S:-560}
left() { echo $((limit - SECONDS)); }
if [ -n "${KL_DEEPGEMM:-}${DEEPGEMM:-}" ]; then
    DEEPGEMM_BUILD_ONLY=1 bash scripts/gpu_deepgemm.sh > "$out/deepgemm-build.log" 2>&1 &
    build=$!
fi
if [ -n "${GPU_TESTS:-}" ]; then
    # shellcheck disable=SC2086 # a list of files
    timeout "${GPU_TESTS_S:-150}" python3 -m pytest -v -m gpu -p no:cacheprovider -rs --durations=8 $GPU_TESTS > "$out/tests-gpu.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$out/tests-gpu.log" | tail -12
fi
if [ -n "${GEMM_BENCH:-}" ] && [ "$(left)" -gt 90 ]; then
    timeout 150 python3 -m services.bench.kernels --only prefill_gemms --json "$out/prefill-gemms.json" \
        > "$out/prefill-gemms.log" 2>&1
    echo "prefill gemms bench rc $?"; grep -E "wo_a|wq_b|wo_b" "$out/prefill-gemms.log" | head -30
fi
if [ -n "${MOE_CONFIGS:-}" ] && [ "$(left)" -gt 120 ]; then
    table=kernels/configs/moe_grouped_gemm-nvidia-h200.json
    timeout "$(( $(left) < 420 ? $(left) - 60 : 360 ))" python3 -m services.bench.kernels_moe_configs \
        --write-configs "$table" --json "$out/moe-configs.json" > "$out/moe-configs.log" 2>&1
    echo "moe configs rc $?"; grep -E "defaults|best of" "$out/moe-configs.log" | cut -c1-150 | head -50
    cp "$table" "$out/" 2>/dev/null
fi
if [ -n "${STEP_AB:-}" ]; then
    for table in 0 1; do
        [ "$(left)" -gt 90 ] || break
        SHINKAI_MOE_CONFIGS=$table timeout "$(left)" python3 -m services.bench.step --batches "$STEP_AB" \
            --contexts 4096 --prefill-tokens 1024 --no-compare --no-async --json "$out/step-table-$table.json" \
            > "$out/step-table-$table.log" 2>&1
        echo "step, config table $table: rc $?"; grep -E "^prefill|^decode|FAILED" "$out/step-table-$table.log" | head -8
    done
fi
if [ -n "${WINDOW_BENCH:-}" ] && [ "$(left)" -gt 90 ]; then
    timeout 90 python3 -m services.bench.kernels_prefill_attention > "$out/window-bench.log" 2>&1
    echo "window staging bench rc $?"; tail -12 "$out/window-bench.log"
fi
if [ -n "${DEEPGEMM:-}" ]; then  # prefill's experts on DeepGEMM from here on (the default where it imports)
    wait "$build"; tail -1 "$out/deepgemm-build.log"
    export PYTHONPATH="$PWD:$site:/tmp/deepgemm" DG_JIT_CACHE_DIR=/tmp/deepgemm-jit
fi
if [ -n "${STEP_SIZES:-}" ] && [ "$(left)" -gt 90 ]; then
    timeout "$(left)" python3 -m services.bench.step --batches 1 --contexts 4096 --prefill-tokens "$STEP_SIZES" \
        --no-compare --no-async --baseline docs/results/step-v41-s1-sizes.json --json "$out/step-sizes.json" \
        > "$out/step-sizes.log" 2>&1
    echo "step sizes rc $?"; grep -E "^prefill|^decode  ctx|FAILED" "$out/step-sizes.log" | head -10
fi
if [ -n "${FULL_SIZES:-}" ] && [ "$(left)" -gt 90 ]; then  # the sizes run, profiled, against the last one's JSON
    timeout "$(left)" python3 -m services.bench.step --batches 1,16,64,256 --contexts 4096,32768 \
        --prefill-tokens 1024,4096,16384,32768 --profile --no-compare --no-async \
        --baseline docs/results/step-v41-s1-sizes.json --json "$out/step-full.json" > "$out/step-full.log" 2>&1
    echo "step full sizes rc $?"; grep -E "^prefill|^decode|launch|FAILED" "$out/step-full.log" | head -30
fi
if [ -n "${THREE_WAY:-}" ] && [ "$(left)" -gt 120 ]; then  # issue 21's three-way table and async's GPU busy
    timeout "$(left)" python3 -m services.bench.step --quick --batches 1,256 --contexts 4096 --prefill-tokens 1024 \
        --json "$out/step-three-way.json" > "$out/step-three-way.log" 2>&1
    echo "three ways rc $?"; grep -E "three ways|^decode|^prefill|offline|busy|FAILED" "$out/step-three-way.log" | head -30
fi
if [ -n "${PROFILE:-}" ] && [ "$(left)" -gt 90 ]; then
    timeout "$(left)" python3 -m services.bench.step --quick --profile --no-compare --no-async \
        --json "$out/step-profile.json" > "$out/step-profile.log" 2>&1
    echo "step profile rc $?"; grep -E "^decode|^prefill|launch" "$out/step-profile.log" | head -20
fi
if [ -n "${SPEC_BATCHES:-}" ] && [ "$(left)" -gt 90 ]; then
    # shellcheck disable=SC2086 # lists
    timeout "$(left)" python3 -m services.bench.speculative --model v41-s1-dspark --num-speculative-tokens 5 \
        --prompt-len 512 --max-tokens 128 --kernel-backend fp8 --cuda-graphs --batch $SPEC_BATCHES \
        --acceptance ${SPEC_ACCEPT:-0 0.8 1} --modes ${SPEC_MODES:-fixed varlen} ${SPEC_PROFILE:+--profile} \
        ${SPEC_ASYNC:+--async-scheduling} \
        --json "$out/speculative-v41.json" > "$out/speculative-v41.log" 2>&1
    echo "speculative v41-s1-dspark rc $?"; grep -E "batch|Error|error|profile|^      " "$out/speculative-v41.log" | tail -100
    nvidia-smi --query-gpu=memory.used --format=csv
fi
if [ -n "${TINY_SPEC:-}" ] && [ "$(left)" -gt 60 ]; then
    timeout "$(left)" python3 -m services.bench.speculative --num-speculative-tokens 5 --max-tokens 64 \
        --kernel-backend fp8 --cuda-graphs --batch 1 --acceptance 0 0.8 1 --modes fixed varlen \
        --json "$out/speculative-tiny.json" > "$out/speculative-tiny.log" 2>&1
    echo "speculative tiny rc $?"; grep "batch" "$out/speculative-tiny.log"
fi
if [ -n "${KL_DEEPGEMM:-}" ]; then
    wait "$build"; tail -2 "$out/deepgemm-build.log"
    if ls /tmp/deepgemm/deep_gemm/_C*.so > /dev/null 2>&1 && [ "$(left)" -gt 60 ]; then
        PYTHONPATH="$PWD:$site:/tmp/deepgemm" SHINKAI_MOE_GEMM=deepgemm python3 -c "import torch
from kernels import deepgemm_moe
print('deepgemm requested', deepgemm_moe.requested(), 'available', deepgemm_moe.available(torch.device('cuda')))"
        PYTHONPATH="$PWD:$site:/tmp/deepgemm" SHINKAI_MOE_GEMM=deepgemm DG_JIT_CACHE_DIR=/tmp/deepgemm-jit \
            timeout "$(left)" python3 -m pytest -q -s -m gpu -p no:cacheprovider \
            "tests/services/worker/test_fp8_accuracy.py::test_gpu_fp8_accuracy_at_v41_width_contractive" \
            > "$out/kl-deepgemm.log" 2>&1
        echo "KL with DeepGEMM rc $?"; grep -E "mean KL|passed|failed|deepgemm|DeepGEMM" "$out/kl-deepgemm.log" | tail -8
    fi
fi
