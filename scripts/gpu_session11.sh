#!/usr/bin/env bash
# Session 11's checks in one device call (the timeouts add up to 280 s): the async decode steps' sync-debug
# test (ImageInputs' device read fixed), the gpu tests of the kernels the launch cut touched (KERNEL_TESTS,
# space-separated), then the step bench's quick sizes, profiled, for the launch count.
# Results in $OUT (or ./out): tests-*.log, step.log, step.json.
set -uo pipefail
. scripts/device_env.sh
export PYTHONPATH="$PWD:$site"
if [ -n "${KERNEL_TESTS:-}" ]; then
    # shellcheck disable=SC2086 # a list of files
    timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider $KERNEL_TESTS > "$out/tests-kernels.log" 2>&1
    grep -E "^FAILED|^ERROR|passed|failed" "$out/tests-kernels.log" | tail -8
fi
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/services/engine/test_async.py \
    -k "cuda or synchronise" > "$out/tests-sync.log" 2>&1
grep -E "^E  .*(Error|synchron)|^FAILED|passed|failed|services/.*py:[0-9]+" "$out/tests-sync.log" | tail -8
left=$((280 - SECONDS))
timeout "$left" python3 -m services.bench.step --quick --profile --no-compare --no-async \
    --baseline docs/results/step-v41-s1-sizes.json --json "$out/step.json" > "$out/step.log" 2>&1
grep -E "decode  ctx|prefill  |^profile" "$out/step.log" | head -12
