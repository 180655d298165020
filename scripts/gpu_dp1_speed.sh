#!/usr/bin/env bash
# Issue 23's single-GPU check: 150-step decode medians with one rank (the default path) at HEAD against
# the commit before expert parallelism, trees alternated twice in one device call so the drift shows
# (10-step bench medians were ±0.3 ms run to run, larger than the 3% in question). Needs the parent's
# source in parent/ (carry it with the device call):
#   rm -rf parent && mkdir parent && git archive d088b4c | tar -x -C parent && cp scheduler_rs/_core.abi3.so parent/scheduler_rs/
# (the extension's API only grew since d088b4c). Results land in $OUT (or ./out)/dp1.txt.
set -uo pipefail
. scripts/device_env.sh
for i in 1 2; do
    PYTHONPATH="$PWD/parent:$site" timeout 140 python3 scripts/dp1_decode_median.py --tree parent 2>&1 \
        | grep -v Warning | tee -a "$out/dp1.txt"
    PYTHONPATH="$PWD:$site" timeout 140 python3 scripts/dp1_decode_median.py --tree head 2>&1 \
        | grep -v Warning | tee -a "$out/dp1.txt"
done
# What time is left: the offline batch-256 run's decode busy fraction (issue 21's async item).
left=$((560 - SECONDS))
[ "$left" -gt 60 ] && PYTHONPATH="$PWD:$site" timeout "$left" python3 -m services.bench.step_offline --batch 256 --steps 20 \
    2>&1 | grep -v Warning | tail -20 | tee "$out/offline.txt"
