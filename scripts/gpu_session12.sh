#!/usr/bin/env bash
# Session 12's DeepGEMM check in one device call (about 8 minutes): scripts/gpu_deepgemm.sh --quick (the build with
# the system g++, the MoE-layer bench at 4K prefill and 256-row decode, the gpu tests of deepgemm_moe and
# quant_fp8), then the step bench's prefill sizes on v41-s1 with SHINKAI_MOE_GEMM=deepgemm, against the
# session-11 sizes run (Triton experts, the same code otherwise). Results in $OUT (or ./out).
set -uo pipefail
. scripts/device_env.sh
BUDGET_S=200 bash scripts/gpu_deepgemm.sh --quick 2>&1 | grep -v "^\s*$" | tail -40
ls /tmp/deepgemm/deep_gemm/_C*.so > /dev/null 2>&1 || { echo "no DeepGEMM build"; exit 2; }
left=$((560 - SECONDS))
echo "== step bench, SHINKAI_MOE_GEMM=deepgemm, ${left}s"
PYTHONPATH="$PWD:$site:/tmp/deepgemm" SHINKAI_MOE_GEMM=deepgemm DG_JIT_CACHE_DIR=/tmp/deepgemm-jit \
    timeout "$left" python3 -m services.bench.step --batches 1 --contexts 4096 --prefill-tokens "${PREFILL:-1024,4096,16384}" \
    --no-compare --no-async --baseline docs/step-h200-2026-12-02-sizes.json --json "$out/step-deepgemm.json" \
    > "$out/step-deepgemm.log" 2>&1
echo "step rc $?"; grep -E "prefill|MoE GEMMs|deep|Deep|decode  ctx" "$out/step-deepgemm.log" | head -30
