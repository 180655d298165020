#!/usr/bin/env bash
# Issue 20's GPU check of the draft's proposal in CUDA graphs, in one device call (under 10 minutes: the
# timeouts below add up to 560 s). Results land in $OUT (or ./out), each part's log as soon as it ends:
# - the gpu-marked tests: the proposal under CUDA's sync debug mode == the host-driven loop; a graph replay of
#   the static proposal == the same static proposal run eagerly; speculation on the GPU paths, with the
#   decode steps' and the draft's graphs replayed;
# - tokens/s with 5 drafts, forced acceptance, fp8 kernels and graphs, against speculation off, at
#   batches 1, 16 and 64 at a = 0, 0.5, 0.8 (and 1 at batch 1), fixed and varlen: issue 20's whole table.
# The proposal's launches and host reads per part: `python3 -m services.bench.draft_proposal --device cuda
# --kernel-backend fp8 --cuda-graphs --batch 1` (its own call).
set -uo pipefail
. scripts/device_env.sh
export PYTHONPATH="$PWD:$site"
timeout 160 python3 -m pytest -q -m gpu tests/services/worker/test_draft_proposal.py \
    tests/services/worker/test_static_draft_proposal.py tests/services/worker/test_speculator.py \
    > "$out/gpu-tests.log" 2>&1
tail -5 "$out/gpu-tests.log"
spec() {  # name, timeout, then the bench's arguments
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 -m services.bench.speculative --num-speculative-tokens 5 --max-tokens 64 \
        --kernel-backend fp8 --cuda-graphs --json "$out/speculative-$name.json" "$@" > "$out/speculative-$name.log" 2>&1
    echo "speculative $name: rc $?"
    grep -H "batch" "$out/speculative-$name.log"
}
spec b1 130 --batch 1 --acceptance 0 0.5 0.8 1 --modes fixed varlen
spec b16 120 --batch 16 --acceptance 0 0.5 0.8 --modes fixed varlen
spec b64 150 --batch 64 --acceptance 0 0.5 0.8 --modes fixed varlen
