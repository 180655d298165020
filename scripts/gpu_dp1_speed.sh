#!/usr/bin/env bash
# Issue 23's single-GPU check: `bench step` with one rank (the default path) at HEAD against the commit
# before expert parallelism, in one device call, alternating twice so the noise shows. Needs the parent's
# source in parent/ (carry it with the device call):
#   rm -rf parent && mkdir parent && git archive d088b4c | tar -x -C parent && cp scheduler_rs/_core.abi3.so parent/scheduler_rs/
# (the extension's API only grew since d088b4c). Results land in $OUT (or ./out).
set -uo pipefail
. scripts/device_env.sh
args="--layers ${LAYERS:-8} --no-compare --no-async --batches 1,64,256 --prefill-tokens 1024"
for i in 1 2; do
    (cd parent && PYTHONPATH="$PWD:$site" timeout 150 python3 -m services.bench.step $args --json "$out/parent$i.json" \
        > "$out/parent$i.log" 2>&1)
    PYTHONPATH="$PWD:$site" timeout 150 python3 -m services.bench.step $args --json "$out/head$i.json" > "$out/head$i.log" 2>&1
done
grep -H "decode  ctx\|prefill  " "$out"/parent*.log "$out"/head*.log
