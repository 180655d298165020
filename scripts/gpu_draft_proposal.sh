#!/usr/bin/env bash
# Issue 20's check of the device-only draft proposal on the GPU, in one device call: the gpu-marked tests
# (the proposal under CUDA's sync debug mode == the host-driven loop; speculation on the GPU paths), the
# proposal's launches and host reads per part on the fp8 kernel backend (services/bench/draft_proposal.py),
# and batch-1 tokens/s with 5 drafts against the earlier run (docs/speculative-h200-2026-12-02-b1.json).
# Results land in $OUT (or ./out).
set -uo pipefail
. scripts/device_env.sh
export PYTHONPATH="$PWD:$site"
timeout 300 python3 -m pytest -q -m gpu tests/services/worker/test_draft_proposal.py tests/services/worker/test_speculator.py \
    > "$out/gpu-tests.log" 2>&1
tail -5 "$out/gpu-tests.log"
for b in 1 16; do
    timeout 120 python3 -m services.bench.draft_proposal --device cuda --kernel-backend fp8 --batch "$b" \
        --json "$out/draft-proposal-b$b.json" > "$out/draft-proposal-b$b.log" 2>&1
    tail -30 "$out/draft-proposal-b$b.log"
done
timeout 240 python3 -m services.bench.speculative --batch 1 --acceptance 0 0.8 1 --num-speculative-tokens 5 \
    --max-tokens 64 --kernel-backend fp8 --cuda-graphs --json "$out/speculative-b1.json" > "$out/speculative-b1.log" 2>&1
grep -H "batch" "$out/speculative-b1.log"
