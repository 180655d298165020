#!/usr/bin/env bash
# One device call: the GPU kernel tests, then `shinkai bench kernels` (run as its module, so the
# device needs none of the other commands' dependencies), then the compiled kernel's resources.
# Writes under $OUT (or ./out): pytest log, bench log and JSON. Usage: bash scripts/kernels-h200.sh [bench args]
set -uo pipefail
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_rmsnorm.py tests/kernels/test_moe_grouped_gemm.py tests/kernels/test_moe_router.py \
    2>&1 | tee "$out/pytest.log" | tail -30
python3 -m services.bench.kernels --json "$out/kernels.json" "$@" 2>&1 | tee "$out/bench.log"
python3 scripts/kernels_inspect.py "$out" 2>&1 | tee "$out/inspect.log" | tail -5
