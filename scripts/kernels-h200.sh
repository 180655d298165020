#!/usr/bin/env bash
# One device call (see /work/.library/device): the GPU kernel tests, then `shinkai bench kernels`.
# Writes under $OUT (or ./out): pytest log, bench log and JSON. Usage: bash scripts/kernels-h200.sh [bench args]
set -uo pipefail
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_rmsnorm.py tests/kernels/test_moe_grouped_gemm.py \
    2>&1 | tee "$out/pytest.log" | tail -30
python3 -m services.cli bench kernels --json "$out/kernels.json" "$@" 2>&1 | tee "$out/bench.log"
