#!/usr/bin/env bash
# Issue 20's GPU check of the draft's proposal in CUDA graphs, in one device call (under 9 minutes: the
# timeouts below add up to 530 s). Results land in $OUT (or ./out), each part's log as soon as it ends:
# - the gpu-marked tests: the proposal under CUDA's sync debug mode == the host-driven loop; a graph replay of
#   the static proposal == the same static proposal run eagerly; speculation on the GPU paths, with the
#   decode steps' and the draft's graphs replayed;
# - the proposal's launches and host reads per part and per step on the fp8 kernel backend with graphs
#   (services/bench/draft_proposal.py);
# - tokens/s with 5 drafts, forced acceptance, fp8 kernels and graphs, against speculation off: batch 1 at
#   a = 0, 0.8, 1 (fixed), batches 16 and 64 at a = 0, 0.8 (fixed and varlen).
set -uo pipefail
. scripts/device_env.sh
export PYTHONPATH="$PWD:$site"
timeout 180 python3 -m pytest -q -m gpu tests/services/worker/test_draft_proposal.py \
    tests/services/worker/test_static_draft_proposal.py tests/services/worker/test_speculator.py \
    > "$out/gpu-tests.log" 2>&1
tail -5 "$out/gpu-tests.log"
timeout 40 python3 -m services.bench.draft_proposal --device cuda --kernel-backend fp8 --cuda-graphs --batch 1 \
    --json "$out/draft-proposal-graphs-b1.json" > "$out/draft-proposal-graphs-b1.log" 2>&1
tail -30 "$out/draft-proposal-graphs-b1.log"
spec() {  # name, timeout, then the bench's arguments
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 -m services.bench.speculative --num-speculative-tokens 5 --max-tokens 64 \
        --kernel-backend fp8 --cuda-graphs --json "$out/speculative-$name.json" "$@" > "$out/speculative-$name.log" 2>&1
    echo "speculative $name: rc $?"
    grep -H "batch" "$out/speculative-$name.log"
}
spec b1 90 --batch 1 --acceptance 0 0.8 1 --modes fixed
spec b16 100 --batch 16 --acceptance 0 0.8 --modes fixed varlen
spec b64 120 --batch 64 --acceptance 0 0.8 --modes fixed varlen
