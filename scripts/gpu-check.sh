#!/usr/bin/env bash
# One device call: every `gpu` test, then `shinkai bench kernels --quick` (as its module), each under a
# time limit so one slow part cannot eat the call. Writes under $OUT (or ./out): pytest log, JSON, logs.
# Usage on the device: bash scripts/gpu-check.sh [extra bench args]; TEST_TIMEOUT / BENCH_TIMEOUT in seconds.
set -uo pipefail
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs --continue-on-collection-errors ${TESTS:-tests} \
    --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/pytest.log" | tail -40
echo "pytest exit: ${PIPESTATUS[0]}"
if [ "${BENCH_TIMEOUT:-240}" != 0 ]; then
    timeout "${BENCH_TIMEOUT:-240}" python3 -m services.bench.kernels --quick --json "$out/kernels.json" "$@" 2>&1 \
        | tee "$out/bench.log" | tail -80
fi
