#!/usr/bin/env bash
# One device call for a session's closing figures: the `gpu` tests file by file (each under its own
# limit, so a slow file cannot hide the others' results), then `shinkai bench step --quick` (as its
# module) on v41-s1 with the kernel backend. Everything lands under $OUT (or ./out).
# Limits (seconds): FILE_TIMEOUT per test file, STEP_TIMEOUT for the step bench (0 skips it).
set -uo pipefail
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # carried by scripts/device-prep.sh's instructions
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PWD:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
files="${TESTS:-$(grep -l 'mark.gpu' tests/kernels/test_*.py tests/services/worker/test_*.py)}"
# JOBS files run at once (one GPU, 16 cores: Triton compiles are CPU-bound, so the files overlap well).
mkdir -p "$out/logs"
run_file() {
    name=$(basename "$1" .py)
    timeout "${FILE_TIMEOUT:-90}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs --tb=short -s \
        ${PYTEST_ARGS:-} "$1" > "$out/logs/$name.log" 2>&1
    echo "$name: exit $? :: $(tail -1 "$out/logs/$name.log")"
}
export -f run_file
export out
printf '%s\n' $files | xargs -P "${JOBS:-1}" -I{} bash -c 'run_file {}' | tee -a "$out/tests-summary.txt"
# One log for every file: the device returns only a handful of files from $OUT.
for f in $files; do
    name=$(basename "$f" .py)
    { echo "===== $name"; cat "$out/logs/$name.log"; } >> "$out/tests.log"
done
rm -rf "$out/logs"
if [ "${STEP_TIMEOUT:-300}" != 0 ]; then
    timeout "${STEP_TIMEOUT:-300}" python3 -m services.bench.step --quick ${STEP_ARGS:-} --json "$out/step.json" \
        --markdown "$out/step.md" 2>&1 | tee "$out/step.log" | tail -40
fi
