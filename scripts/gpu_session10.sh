#!/usr/bin/env bash
# Session 10's code, built without a GPU, in one device call (timeouts add up to 560 s): the gpu tests of
# what it added or changed, then the step bench on v41-s1 with its launch cuts (the quick sizes, profiled).
# Results land in $OUT (or ./out): tests.log (the failures' lines), step.log, step.json.
# - kernels: activations quantised in the GEMMs, the router's and the mix's finish and the MoE layout in
#   their neighbours' launches (== tests, each run 20 times), split-K experts, the window write;
# - the sync-debug tests: async decode steps and the sampler, which failed in session 10's first call
#   (engram_rows' and the ban write's synchronising writes, both fixed since);
# - the verify half of a speculative step in a CUDA graph (static_verify, with the sampler's processing:
#   verify_half), the draft distributions handed over by state slot, LLM capturing every bucket ahead.
set -uo pipefail
. scripts/device_env.sh
export PYTHONPATH="$PWD:$site"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_splitk.py \
    tests/kernels/test_moe_grouped_gemm.py tests/kernels/test_moe_router.py tests/kernels/test_moe_layout.py \
    tests/kernels/test_mhc.py tests/kernels/test_tickets.py tests/kernels/test_moe_splitk.py \
    tests/kernels/test_window_write.py > "$out/tests-kernels.log" 2>&1
grep -E "^FAILED|^ERROR|passed|failed" "$out/tests-kernels.log" | tail -12
timeout 140 python3 -m pytest -q -p no:cacheprovider tests/services/engine/test_async.py \
    tests/services/worker/test_sampler.py -k "cuda or synchronise" > "$out/tests-sync.log" 2>&1
grep -E "^E  .*(Error|synchron)|^FAILED|passed|failed|services/.*py:[0-9]+" "$out/tests-sync.log" | tail -12
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/services/worker/test_static_verify.py \
    tests/services/worker/test_verify_half.py tests/services/worker/test_static_draft_proposal.py \
    > "$out/tests-verify.log" 2>&1
grep -E "^E  .*(Error|synchron)|^FAILED|passed|failed" "$out/tests-verify.log" | tail -12
left=$((570 - SECONDS))
timeout "$left" python3 -m services.bench.step --quick --profile --no-compare --no-async \
    --baseline docs/results/step-v41-s1-sizes.json --json "$out/step.json" > "$out/step.log" 2>&1
grep -E "decode  ctx|prefill  |^profile|launches" "$out/step.log" | head -20
