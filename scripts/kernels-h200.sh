#!/usr/bin/env bash
# One device call: the GPU kernel tests, then `shinkai bench kernels` (run as its module, so the
# device needs none of the other commands' dependencies), then the compiled kernel's resources.
# Writes under $OUT (or ./out): pytest log, bench log and JSON. Usage: bash scripts/kernels-h200.sh [bench args]
# TESTS (default: every kernel test file) and INSPECT (default: both inspect scripts) narrow a run, e.g.
# TESTS=tests/kernels/test_decode_attention.py INSPECT=scripts/diagnostics/attention_inspect.py bash scripts/kernels-h200.sh --only attention
set -uo pipefail
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
tests="${TESTS:-tests/kernels/test_rmsnorm.py tests/kernels/test_moe_grouped_gemm.py tests/kernels/test_moe_router.py tests/kernels/test_decode_attention.py}"
# shellcheck disable=SC2086 # a list of paths
python3 -m pytest -q -m gpu -p no:cacheprovider $tests 2>&1 | tee "$out/pytest.log" | tail -30
python3 -m services.bench.kernels --json "$out/kernels.json" "$@" 2>&1 | tee "$out/bench.log"
for script in ${INSPECT:-scripts/diagnostics/kernels_inspect.py scripts/diagnostics/attention_inspect.py}; do
    python3 "$script" "$out" 2>&1 | tee -a "$out/inspect.log" | tail -5
done
