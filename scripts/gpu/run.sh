#!/usr/bin/env bash
# The GPU switchboard: runs named suites on the device machine, one after another, in one device call.
#
#   bash scripts/gpu/run.sh SUITE…          # no argument or --help: the suites, one line each
#
# Before the call (here): `bash scripts/dev/device-prep.sh` (`--stack` for the serve suites) builds the
# extension and the wheels the device lacks; carry both, and what a suite names below (third_party/deepgemm-src,
# base/):
#   run(carry=["scheduler_rs/_core.abi3.so", ".whl"], command="bash scripts/gpu/run.sh tests")
#
# Each suite is sized to end within SUITE_S seconds (each has its own default, all under 10 minutes) and the
# whole call within LIMIT_S (default 570: the device gives a command 10 minutes); every step runs under
# `timeout`, cut to what is left. Naming two suites shares one call's LIMIT_S between them.
# Outputs go under $OUT (or ./out): $OUT/summary.txt (each step's exit code and seconds) and $OUT/SUITE/ (its logs
# and JSON). The device returns at most 8 files from $OUT: where there are more, each suite's folder is packed
# into $OUT/SUITE.tar.gz.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

SUITES="
tests             every gpu-marked test file, file by file (JOBS at once, FILE_TIMEOUT each; TESTS: files or folders), and the sync-debug async decode tests
                  (tests/services/gateway's need device-prep.sh --stack: its conftest serves the openai client)
kernels           bench kernels (KERNELS_ARGS, default --quick) against each kernel's roofline, then the compiled MoE GEMM's and decode attention's registers, spills and instructions (diagnostics/*_inspect.py)
step              bench step --quick --profile on v41-s1 (launches and the kernel table per step; STEP_ARGS, STEP_BASELINE), then the offline batch-256 run's GPU-busy share
step-sizes        bench step at the full sizes: decode batches 1-256 at 4K and 32K, prefill 1K-32K, profiled (STEP_BASELINE)
step-compare      bench step's eager / torch.compile / engine comparison (the 8-layer subset) and the async on/off run, batches 1 and 256
moe-configs       the MoE grouped GEMM's launch configs swept and written to kernels/configs/ (copied to the suite's folder), then decode (MOE_AB_BATCHES) and 1K prefill with the table off, then on
deepgemm          DeepGEMM built from the carried third_party/deepgemm-src, bench kernels --only deepgemm_moe against the Triton grouped GEMM and cuBLASLt (DEEPGEMM_ARGS, DEEPGEMM_CASES), then its gpu tests
deepgemm-step     DeepGEMM built, then bench step's prefill (DEEPGEMM_SIZES) and the v41-width FP8 KL test with SHINKAI_MOE_GEMM=deepgemm
speculative       the gpu tests of speculation (draft proposal, static proposal and verify, verify half, speculator: sync-debug mode, graph replay == eager; constrained speculation), then the proposal's launches and host reads
speculative-bench bench speculative, fp8 kernels and CUDA graphs, 5 drafts, forced acceptances, fixed and varlen, against speculation off (SPEC_MODEL tiny or v41-s1-dspark, SPEC_BATCHES, SPEC_ACCEPT, SPEC_MODES, SPEC_PROFILE, SPEC_ASYNC)
structured        the constrained gpu tests (speculation with token masks, the sampler kernel under a mask and in a graph, constrained async), then bench structured on v41-s1 cut to SO_LAYERS (default 8): decode batches 1/16/64 constrained vs unconstrained, sync and async (SO_ARGS, default --rounds 2 --steps 24 --walks 4)
serve             v41-s1 at full depth (--load-format dummy), one build: served over HTTP to the openai client and the load generator at concurrency 1, 16, 64, then offline LLM.generate (greedy ==) and bench step's decode (device-prep.sh --stack)
serve-checkpoint  a v41-s1 part (NUM_LAYERS, default 14) written by model init, the disk's read rate, loaded by shinkai up from a cold page cache, the openai client, then LLM.generate (greedy ==) (device-prep.sh --stack)
experts           the MXFP4 experts' gpu tests (the kernel's, checkpoint greedy tokens against the CPU; with EXPERTS_KL=1 the FP4 KL criterion too), then bench step's decode at batches 1/16/64/256 with FP8 experts and FP4 experts on v41-s1 (EXPERTS_LAYERS, default 20) against each path's floor
serve-fits        v41-s1 at full depth through shinkai up with --engram-on-host and FP4 experts: ready, the memory lines, served over HTTP; then with --expert-format fp8: it fits or gets the clear error (device-prep.sh --stack)
serve-up          the serve suite's figures through shinkai up (two full-depth builds) (device-prep.sh --stack)
prefix            prefix caching: the exactness gpu test (kernel path, CUDA graphs, cache on == off; PREFIX_EXACT=0 skips it), then bench prefix on v41-s1 cut
                  to NUM_LAYERS (default 8, --load-format dummy): multi-turn and agent loads, cache off then on (PREFIX_ARGS)
fairness          scripts/diagnostics/fairness.py in-process on the GPU (tiny, --max-num-batched-tokens 256): a light key's TTFT
                  alone and beside one and two keys sending 3,900-token prompts, then a key over its limit (FAIR_S per phase)
                  (device-prep.sh --stack: the in-process server is the gateway's)
coldstart         time to ready through shinkai up, v41-s1 cut to COLDSTART_LAYERS (default 14, --load-format dummy, --max-num-seqs COLDSTART_SEQS, default 64: the 11 decode graphs): cold (an empty cache root) then warm (a second start on it), each broken into load / profile / compile / capture, with the seconds of each graph size; on the cold server TTFT p50/p99 at concurrency 1 and 16 fresh, then again after that warm-up on prompts it has not seen (COLDSTART_RUNS: any of cold, warm and seeded in order, default cold warm; seeded: Triton's cache emptied, the compile manifests kept; COLDSTART_TTFT=0 skips the TTFT runs); then, where 150 s are left, the decode graphs captured again largest or smallest first, into one pool or one each (scripts/diagnostics/capture_order.py; COLDSTART_ORDER=0 skips it) (device-prep.sh --stack)
mixed             mixed against separate steps: the mixed-steps test on the kernel path (gpu-marked), then v41-s1 cut to NUM_LAYERS (default 8, --load-format dummy) through shinkai up, separate then mixed (MIXED_BUDGET: --max-num-batched-tokens), the load generator with Poisson arrivals at concurrency 16 and 64, 512- and 4,096-token prompts, 256 tokens out
parallel          two GPUs (nvidia-h100-x2): expert parallelism over NCCL against one process, kernel ranks in graphs (batch-invariant: tokens and logprobs ==), the torch MoE, 3 drafts; then live EPLB's layout switch at one boundary
ep-one-gpu        one GPU: the expert-parallel kernel layer's gpu tests (its layouts' kernels at v41-s1's shapes; virtual ranks and NCCL at world size 1 captured in graphs), bench step --dp 1 --ep-path on v41-s1 with MXFP4 experts (EP_LAYERS, default 8; EP_BATCHES, default 64; EP_PROFILE=1 adds --profile), then the EP path in the engine's decode graphs
hosts             two hosts simulated on one machine of 2+ GPUs (nvidia-h100-x2 or more): torchrun --nnodes 2, half of the GPUs each (CUDA_VISIBLE_DEVICES), one engine per GPU over NCCL; greedy tokens against one process, then a host killed mid-stream (scripts/gpu/hosts_check.py; HOSTS_MODEL, default tiny) (device-prep.sh --stack: the ranks speak gRPC)
invariance        the batch-invariance test with == on v41-s1 at full depth (INVARIANCE_PROMPTS, default 64: the batch, then each prompt alone), then where graphs and eager part on tiny
compare           decode and prefill step medians (150 steps, v41-s1 at 8 layers) of a baseline tree carried in BASE_TREE (default base/) and this tree, alternated twice
compare-profile   bench step --profile at batch 1 (CONTEXTS, default 32768) for BASE_TREE and this tree, their kernel tables side by side
"

usage() {
    echo "usage: bash scripts/gpu/run.sh SUITE…   (on the device machine; outputs under \$OUT or ./out)"
    echo
    echo "suites:"
    echo "$SUITES" | sed '/^$/d; s/^/  /'
    echo
    echo "Environment: LIMIT_S (the whole call, default 570 s), SUITE_S (each suite's budget), and the suites' own"
    echo "variables named above. See scripts/README.md."
}

if [ $# = 0 ] || [ "$1" = --help ] || [ "$1" = -h ]; then usage; exit 0; fi
for s in "$@"; do
    if ! echo "$SUITES" | grep -q "^$s "; then echo "run.sh: no suite '$s'" >&2; usage >&2; exit 2; fi
done

. scripts/dev/device_env.sh  # $out (absolute), $site, PYTHONPATH=tree:$site, the carried wheels installed
limit=${LIMIT_S:-570}
summary="$out/summary.txt"

# --- time and steps ----------------------------------------------------------------------------------------------
suite_end=$limit
left() { local a=$(( suite_end - SECONDS )) b=$(( limit - SECONDS )); echo $(( a < b ? a : b )); }
cap() { local l; l=$(left); echo $(( $1 < l ? $1 : l )); }  # a step's limit: N seconds, or what is left
enough() { [ "$(left)" -gt "$1" ]; }                            # at least N seconds left
note() { echo "$*" | tee -a "$summary"; }
# run NAME LIMIT CMD…: CMD under timeout (LIMIT cut to what is left) into $dir/NAME.log; notes its exit code.
run() {
    local name=$1 limit_s; limit_s=$(cap "$2"); shift 2
    if [ "$limit_s" -lt 10 ]; then note "$suite/$name: skipped (no time left)"; return 0; fi
    local t0=$SECONDS
    timeout "$limit_s" "$@" > "$dir/$name.log" 2>&1
    local rc=$?
    note "$suite/$name: rc $rc ($(( SECONDS - t0 )) s of $limit_s)"
    return $rc
}
show() { grep -E "$2" "$dir/$1.log" | tail -"${3:-20}"; }      # show NAME PATTERN [N]: a log's telling lines
# (timeout runs programs, not shell functions: these are arrays)
gpu_tests=(python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs --tb=short)
bench_step=(python3 -m services.bench.step.run)
begin() {  # begin SUITE DEFAULT_BUDGET
    suite=$1; dir="$out/$1"; mkdir -p "$dir"
    suite_end=$(( SECONDS + ${SUITE_S:-$2} ))
    note "== $suite (${SUITE_S:-$2} s budget, $(( limit - SECONDS )) s left in the call)"
}
deepgemm_on() {  # DeepGEMM on the path for what follows (after deepgemm_build.sh)
    export PYTHONPATH="$PYTHONPATH:${DEEPGEMM_BUILD:-/tmp/deepgemm}" DG_JIT_CACHE_DIR=/tmp/deepgemm-jit
}

# --- the suites --------------------------------------------------------------------------------------------------
suite_tests() {
    begin tests 560
    local files=() entry
    for entry in ${TESTS:-tests}; do
        if [ -d "$entry" ]; then
            mapfile -t -O "${#files[@]}" files < <(grep -rl --include='test_*.py' 'mark.gpu' "$entry" | sort)
        else
            files+=("$entry")
        fi
    done
    mkdir -p "$dir/files"
    file_test() {
        local name; name=$(echo "$1" | tr '/:' '__')
        timeout "$FILE_TIMEOUT" python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs --tb=short ${PYTEST_ARGS:-} \
            "$1" > "$dir/files/$name.log" 2>&1
        echo "$1: exit $? :: $(tail -1 "$dir/files/$name.log")"
    }
    export -f file_test; export dir FILE_TIMEOUT="${FILE_TIMEOUT:-120}" PYTEST_ARGS="${PYTEST_ARGS:-}"
    # JOBS files at once on the one GPU: Triton's compiles are CPU-bound, so the files overlap well.
    printf '%s\n' "${files[@]}" | run files "$(( $(left) - 40 ))" xargs -P "${JOBS:-2}" -I{} bash -c 'file_test {}'
    cat "$dir/files.log"
    for entry in "$dir"/files/*.log; do { echo "===== $(basename "$entry" .log)"; cat "$entry"; } >> "$dir/tests.log"; done
    rm -rf "$dir/files"
    if [ -z "${TESTS:-}" ]; then  # CUDA tests outside the gpu mark: async decode steps under sync-debug mode
        run sync 120 python3 -m pytest -q -p no:cacheprovider tests/services/engine/test_async.py -k "cuda or synchronise"
        show sync "^E  .*(Error|synchron)|^FAILED|passed|failed|skipped|^SKIPPED|no tests ran|services/.*py:[0-9]+" 8
    fi
}

suite_kernels() {
    begin kernels 540
    # shellcheck disable=SC2086 # a list of arguments
    run bench "$(( $(left) - 100 ))" python3 -m services.bench.kernels.run ${KERNELS_ARGS:---quick} --json "$dir/kernels.json"
    tail -60 "$dir/bench.log"
    if [ "${INSPECT:-1}" != 0 ]; then
        run inspect-moe 50 python3 scripts/diagnostics/kernels_inspect.py "$dir"; cat "$dir/inspect-moe.log"
        run inspect-attention 50 python3 scripts/diagnostics/attention_inspect.py; tail -8 "$dir/inspect-attention.log"
    fi
}

suite_step() {
    begin step 540
    # shellcheck disable=SC2086 # a list of arguments
    run step 400 "${bench_step[@]}" ${STEP_ARGS:---quick --profile --no-compare --no-async} \
        ${STEP_BASELINE:+--baseline "$STEP_BASELINE"} --json "$dir/step.json" --markdown "$dir/step.md"
    show step "decode  ctx|prefill  |^profile|launches|FAILED" 30
    if enough 60; then  # the async offline run's decode busy fraction
        run offline 150 python3 -m services.bench.step.offline --batch 256 --steps 20 --json "$dir/offline.json"
        tail -12 "$dir/offline.log"
    fi
}

suite_step_sizes() {
    begin step-sizes 560
    run step 560 "${bench_step[@]}" --batches 1,16,64,256 --contexts 4096,32768 --prefill-tokens 1024,4096,16384,32768 \
        --profile --no-compare --no-async ${STEP_BASELINE:+--baseline "$STEP_BASELINE"} --json "$dir/step.json"
    show step "^prefill|^decode|launch|FAILED" 30
}

suite_step_compare() {
    begin step-compare 540
    run step 540 "${bench_step[@]}" --quick --batches 1,256 --contexts 4096 --prefill-tokens 1024 --json "$dir/step.json"
    show step "three ways|^decode|^prefill|offline|busy|FAILED" 30
}

suite_moe_configs() {
    begin moe-configs 570
    local table
    table=$(python3 -c "import torch; from kernels.moe_configs import config_path
print(config_path(torch.cuda.get_device_name()))") || return
    run sweep 360 python3 -m services.bench.kernels.moe_configs --write-configs "$table" --json "$dir/moe-configs.json"
    show sweep "defaults|best of" 50 | cut -c1-150
    cp "$table" "$dir/" 2>/dev/null
    local on
    for on in 0 1; do  # decode and 1K prefill with the table off, then on
        enough 90 || break
        SHINKAI_MOE_CONFIGS=$on run "step-table-$on" 300 "${bench_step[@]}" --batches "${MOE_AB_BATCHES:-1,16,64,256}" \
            --contexts 4096 --prefill-tokens 1024 --no-compare --no-async --json "$dir/step-table-$on.json"
        show "step-table-$on" "^prefill|^decode|FAILED" 8
    done
}

suite_deepgemm() {
    begin deepgemm 560
    run build 420 bash scripts/gpu/deepgemm_build.sh "$dir/build-full.log" || { tail -20 "$dir/build.log"; return; }
    deepgemm_on
    # The bench stops starting new sizes early enough to print its table within its limit.
    local bench_s=$(( $(left) - 75 )); [ "$bench_s" -ge 150 ] || bench_s=150
    # shellcheck disable=SC2086 # a list of arguments
    [ -n "${DEEPGEMM_CASES:-}" ] && export SHINKAI_DEEPGEMM_CASES="$DEEPGEMM_CASES"  # e.g. "decode:1,decode:16"
    SHINKAI_DEEPGEMM_BENCH_S=$(( bench_s - 90 )) run bench "$bench_s" python3 -m services.bench.kernels.run --only deepgemm_moe --json "$dir/deepgemm.json" \
        ${DEEPGEMM_ARGS:-}
    grep -v "^\s*$" "$dir/bench.log" | tail -60
    # The probe, the grouped outputs against the torch reference, the layout kernel byte for byte.
    run tests "$(( $(left) - 10 ))" "${gpu_tests[@]}" tests/kernels/test_deepgemm_moe.py tests/kernels/test_moe_contiguous.py \
        tests/kernels/test_quant_fp8.py
    tail -15 "$dir/tests.log"
}

suite_deepgemm_step() {
    begin deepgemm-step 560
    run build 420 bash scripts/gpu/deepgemm_build.sh "$dir/build-full.log" || { tail -20 "$dir/build.log"; return; }
    deepgemm_on
    export SHINKAI_MOE_GEMM=deepgemm
    run step 200 "${bench_step[@]}" --batches 1 --contexts 4096 --prefill-tokens "${DEEPGEMM_SIZES:-1024,4096,16384}" \
        --no-compare --no-async ${STEP_BASELINE:+--baseline "$STEP_BASELINE"} --json "$dir/step.json"
    show step "^prefill|^decode  ctx|FAILED" 10
    python3 -c "import torch
from kernels import deepgemm_moe
print('deepgemm requested', deepgemm_moe.requested(), 'available', deepgemm_moe.available(torch.device('cuda')))"
    # Its 1,024-token chunks take DeepGEMM's grouped products.
    run kl 300 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
        "tests/services/worker/kernel_model/test_fp8_accuracy.py::test_gpu_fp8_accuracy_at_v41_width_contractive"
    show kl "mean KL|passed|failed|skipped|deepgemm|DeepGEMM" 8
    unset SHINKAI_MOE_GEMM
}

suite_speculative() {
    begin speculative 450
    run tests 300 "${gpu_tests[@]}" tests/services/worker/spec/test_draft_proposal.py tests/services/worker/spec/test_static_draft_proposal.py \
        tests/services/worker/spec/test_speculator.py tests/services/worker/spec/test_static_verify.py \
        tests/services/worker/spec/test_verify_half.py tests/services/engine/structured/test_token_masks.py
    show tests "^FAILED|^ERROR|^E  .*(Error|synchron)|passed|failed|skipped|^SKIPPED|no tests ran" 15
    run proposal 90 python3 -m services.bench.speculative.draft_proposal --device cuda --kernel-backend fp8 --cuda-graphs --batch 1 \
        --static-proposal --json "$dir/draft-proposal.json"
    tail -12 "$dir/proposal.log"
}

suite_speculative_bench() {
    begin speculative-bench 560
    local model=${SPEC_MODEL:-tiny} batch accept size=(--prompt-len 512 --max-tokens 128) each=560
    if [ "$model" = tiny ]; then size=(--max-tokens 64); each=160; fi
    for batch in ${SPEC_BATCHES:-$([ "$model" = tiny ] && echo "1 16 64" || echo 1)}; do
        enough 60 || break
        accept=${SPEC_ACCEPT:-$([ "$model" != tiny ] && echo "0 0.8 1" || { [ "$batch" = 1 ] && echo "0 0.5 0.8 1" || echo "0 0.5 0.8"; })}
        # shellcheck disable=SC2086 # lists
        run "b$batch" "$each" python3 -m services.bench.speculative.run --model "$model" \
            --num-speculative-tokens 5 "${size[@]}" --kernel-backend fp8 --cuda-graphs --batch "$batch" \
            --acceptance $accept --modes ${SPEC_MODES:-fixed varlen} ${SPEC_PROFILE:+--profile} \
            ${SPEC_ASYNC:+--async-scheduling} --json "$dir/speculative-b$batch.json"
        show "b$batch" "batch|Error|error|profile|^      " 60
    done
}

suite_structured() {
    begin structured 420
    # The sampler kernel's first (cheap), then constrained speculation (four engines of 64 blocks), then constrained
    # async last: its engine sizes its pools from gpu_memory_utilization, and in one pytest process that memory
    # stays held until a collection frees the engine's reference cycles.
    run tests 100 "${gpu_tests[@]}" tests/services/worker/sampling/test_token_bitmask.py \
        tests/services/engine/structured/test_token_masks.py tests/services/engine/structured/test_async_constrained.py
    show tests "^FAILED|^ERROR|^E  .*(Error|synchron)|passed|failed|skipped|^SKIPPED|no tests ran" 15
    # shellcheck disable=SC2086 # a list of arguments
    run bench "$(( $(left) - 5 ))" python3 -m services.bench.structured.run --layers "${SO_LAYERS:-8}" \
        ${SO_ARGS:---rounds 2 --steps 24 --walks 4} --json "$dir/structured.json"
    show bench "^model|^decode|^mask|^compile|target|met|Error|Traceback" 40
}

# The serve suites' parts (`shinkai up` through its module, so the device needs no console script).
serve_ready() {  # up returns once every service is healthy; the engine's log has the load and pool lines
    local t0=$SECONDS
    run up 420 python3 -m services.entrypoints.cli up --run-dir "$run_dir" --http-port "$port" --grpc-port 0 --timeout 400 "$@"
    local rc=$?
    echo "{\"what\": \"time_to_ready_s\", \"model\": \"$2\", \"rc\": $rc, \"seconds\": $(( SECONDS - t0 ))}" \
        | tee -a "$dir/results.jsonl"
    grep -h -E "loaded .* GB/s|pools:|captured the decode graph|Error" "$run_dir"/logs/engine-0.log | tail -30 \
        | tee -a "$dir/engine-lines.log"
    return $rc
}
serve_stop() {
    python3 -m services.entrypoints.cli down --run-dir "$run_dir" --timeout 60 2>&1 | tail -8
    cat "$run_dir"/logs/engine-0.log >> "$dir/engine.log" 2>/dev/null
    rm -rf "$run_dir/logs"
}
serve_begin() {  # serve_begin SUITE BUDGET
    begin "$1" "$2"
    run_dir=/tmp/shinkai-run; port=8000
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$dir/gpu.txt"
    echo "{\"what\": \"commit\", \"sha\": \"${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}\"}" \
        >> "$dir/results.jsonl"
}

suite_serve() {  # one full-depth build serves, then runs offline and bench step
    serve_begin serve 560
    run served 540 python3 scripts/gpu/serve_check.py served --model v41-s1 --load-format dummy --num-requests 64 \
        --batches 1,16,64 --out "$dir/served-dummy.json"
    grep -v "it/s\]" "$dir/served.log" | tail -40
}

suite_serve_checkpoint() {
    serve_begin serve-checkpoint 570
    local ckpt=/tmp/v41-s1-part big t0=$SECONDS
    df -h /tmp | tee -a "$dir/disk.txt"
    run init 300 python3 -m services.entrypoints.cli model init --preset v41-s1 --num-layers "${NUM_LAYERS:-14}" --out "$ckpt" \
        --device cuda || { tail -5 "$dir/init.log"; return; }
    echo "{\"what\": \"model_init_s\", \"layers\": ${NUM_LAYERS:-14}, \"seconds\": $(( SECONDS - t0 )), \"bytes\": $(du -sb $ckpt | cut -f1)}" \
        | tee -a "$dir/results.jsonl"
    big=$(ls -S "$ckpt"/model-*.safetensors | head -1)
    sync
    dd if="$big" of=/dev/null bs=64M count=64 iflag=direct 2>&1 | tail -1 | tee -a "$dir/disk.txt"
    sync; echo 3 > /proc/sys/vm/drop_caches && echo '{"what": "page_cache", "dropped": true}' >> "$dir/results.jsonl"
    # The batch-invariant mode on both halves: greedy tokens are then == whatever each side's pools, graph sizes
    # and attention splits (the default mode's fp32 sums differ with max_model_len, and random weights turn that
    # into different tokens).
    serve_ready --model "$ckpt" --max-num-seqs 16 --max-model-len 1024 --gpu-memory-utilization 0.9 --batch-invariant
    run http 120 python3 scripts/gpu/serve_check.py http --url "http://127.0.0.1:$port/v1" --model "$ckpt" \
        --out "$dir/http-checkpoint.json"
    tail -c 1500 "$dir/http.log"
    serve_stop
    run offline 240 python3 scripts/gpu/serve_check.py offline --model "$ckpt" --greedy "$dir/http-checkpoint.json" \
        --num-requests 16 --max-tokens 448 --greedy-only --batch-invariant --out "$dir/offline-checkpoint.json"
    grep -v "it/s\]" "$dir/offline.log" | tail -20
}

suite_serve_up() {  # the serve suite through `shinkai up` (two full-depth builds)
    serve_begin serve-up 570
    serve_ready --model v41-s1 --load-format dummy --max-num-seqs 64 --max-model-len 1024 --gpu-memory-utilization 0.9
    run http 60 python3 scripts/gpu/serve_check.py http --url "http://127.0.0.1:$port/v1" --model v41-s1 \
        --out "$dir/http-dummy.json"
    tail -c 1500 "$dir/http.log"
    local c n
    for c in 1 16 64; do
        n=$(( c == 1 ? 4 : 2 * c ))
        run "load-c$c" 150 python3 -m services.client.loadgen --url "http://127.0.0.1:$port/v1" --model v41-s1 \
            --num-requests $n --concurrency $c --max-tokens 128 --prompt-tokens 512
        tee -a "$dir/results.jsonl" < "$dir/load-c$c.log"
    done
    serve_stop
    run offline 300 python3 scripts/gpu/serve_check.py offline --model v41-s1 --load-format dummy \
        --greedy "$dir/http-dummy.json" --num-requests 64 --batches 1,16,64 --out "$dir/offline-dummy.json"
    grep -v "it/s\]" "$dir/offline.log" | tail -20
}

coldstart_start() {  # coldstart_start NAME: one `shinkai up` on the suite's cache root; its ready event and capture times
    local name=$1 t0=$SECONDS
    echo "{\"what\": \"cache_before\", \"start\": \"$name\", \"triton_entries\": $(find "$SHINKAI_CACHE_DIR/triton" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | wc -l)}" \
        | tee -a "$dir/results.jsonl"
    run "up-$name" 420 python3 -m services.entrypoints.cli up --run-dir "$run_dir" --http-port "$port" --grpc-port 0 \
        --timeout 400 --model "$model" --load-format dummy --max-num-seqs "${COLDSTART_SEQS:-64}" --max-model-len 4096 \
        --gpu-memory-utilization 0.9
    local rc=$?
    grep -v "it/s\]" "$dir/up-$name.log" | tail -25
    echo "{\"what\": \"time_to_ready_s\", \"start\": \"$name\", \"rc\": $rc, \"seconds\": $(( SECONDS - t0 ))}" \
        | tee -a "$dir/results.jsonl"
    grep -h '"event": "ready"' "$run_dir"/logs/engine-0.log | sed "s/^{/{\"start\": \"$name\", /" | tee -a "$dir/results.jsonl"
    grep -h -E "capture seconds per graph size|startup \{|loaded .* GB/s|pools:|Error|precompile" "$run_dir"/logs/engine-0.log \
        | sed "s/^/$name: /" | tee -a "$dir/engine-lines.log"
    return $rc
}

coldstart_ttft() {  # coldstart_ttft LABEL FIRST: TTFT at concurrency 1 then 16 (the prompt lengths differ between the
    # two), the requests numbered from FIRST (the warmed run's prompts unseen: no prefix-cache hit in either run)
    local c n p
    for c in 1 16; do
        n=$(( c == 1 ? 8 : 48 )); p=$(( c == 1 ? 300 : 700 ))
        run "ttft-$1-c$c" 90 python3 -m services.client.loadgen --url "http://127.0.0.1:$port/v1" --model "$model" \
            --num-requests $n --concurrency $c --max-tokens 32 --prompt-tokens $p --first-request "$2"
        sed "s/^{/{\"server\": \"$1\", /" "$dir/ttft-$1-c$c.log" | grep '^{' | tee -a "$dir/results.jsonl"
    done
}

suite_coldstart() {  # cold and warm starts on one cache root, TTFT on a fresh server then after a warm-up
    serve_begin coldstart 570
    model=/tmp/v41-s1-l${COLDSTART_LAYERS:-14}
    v41_part "$model" "${COLDSTART_LAYERS:-14}"
    # The suite's own cache root, empty for the cold start; the libraries' variables unset so `up` puts every
    # compile cache under it (services/cache_dirs.py).
    export SHINKAI_CACHE_DIR=/tmp/shinkai-coldstart-cache
    unset TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR DG_JIT_CACHE_DIR
    local runs=${COLDSTART_RUNS:-cold warm}
    case " $runs " in *" cold "*) rm -rf "$SHINKAI_CACHE_DIR";; esac
    mkdir -p "$SHINKAI_CACHE_DIR"
    local name
    for name in $runs; do
        # seeded: Triton's cache emptied, the compile manifests kept (a new node given the variants' list)
        [ "$name" = seeded ] && python3 -m services.entrypoints.cli cache clear --triton --yes
        coldstart_start "$name" || { serve_stop; continue; }
        if [ "$name" = cold ] && [ "${COLDSTART_TTFT:-1}" != 0 ]; then  # fresh, then the same after that warm-up
            coldstart_ttft fresh 0
            coldstart_ttft warmed 1000
        fi
        serve_stop
        # Its Triton compiles per phase and after ready (what the requests waited on), from its stopped event.
        grep -h '"event": "stopped"' "$dir/engine.log" | tail -1 | sed "s/^{/{\"start\": \"$name\", /" \
            | tee -a "$dir/results.jsonl"
    done
    if [ "${COLDSTART_ORDER:-1}" != 0 ] && enough 150; then  # capture order and pool sharing, on the warm cache
        run order 240 python3 scripts/diagnostics/capture_order.py --model "$model" --max-num-seqs "${COLDSTART_SEQS:-64}"
        grep '^{' "$dir/order.log" | tee -a "$dir/results.jsonl"
    fi
    python3 -m services.entrypoints.cli cache show | tee -a "$dir/cache.txt"
    python3 scripts/gpu/coldstart_table.py "$dir/results.jsonl" | tee "$dir/table.txt"
    unset SHINKAI_CACHE_DIR  # later suites keep the default root
}

v41_part() {  # v41_part DIR LAYERS: v41-s1's config cut to its first LAYERS layers, and the tokenizer
    python3 -c "
import json, sys
from pathlib import Path
from model.deepseek_v41.config import to_hf_dict
from model.deepseek_v41.init import first_layers
from model.deepseek_v41.presets import preset
from model.deepseek_v41.tokenizer import write_tokenizer_files
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
write_tokenizer_files(out, None)  # --load-format dummy reads only the config and the tokenizer
(out / 'config.json').write_text(json.dumps(to_hf_dict(first_layers(preset('v41-s1'), int(sys.argv[2])))))
" "$1" "$2"
}

suite_prefix() {  # the cache's bits on the kernel path, then its reuse and TTFT, off against on
    begin prefix 420
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$dir/gpu.txt"
    if [ "${PREFIX_EXACT:-1}" != 0 ]; then  # PREFIX_EXACT=0: the bench alone
        run exact 150 "${gpu_tests[@]}" tests/services/engine/prefix/test_exactness.py
        show exact "passed|failed|skipped|^SKIPPED|no tests ran|^FAILED|^E  " 12
    fi
    local model=/tmp/v41-s1-l${NUM_LAYERS:-8}
    v41_part "$model" "${NUM_LAYERS:-8}"
    # shellcheck disable=SC2086 # a list of arguments
    run bench "$(( $(left) - 5 ))" python3 -m services.entrypoints.cli bench prefix --model "$model" --load-format dummy \
        ${PREFIX_ARGS:---conversations 16} --json "$dir/prefix.json"
    grep -v "it/s\]" "$dir/bench.log" | tail -30
}

suite_fairness() {  # another key's TTFT beside long prompts, on the GPU's step times
    begin fairness 300
    run fair "$(( $(left) - 5 ))" python3 scripts/diagnostics/fairness.py --seconds "${FAIR_S:-15}" --json "$dir/fairness.json"
    tail -20 "$dir/fair.log"
}

suite_mixed() {  # mixed and separate steps: the kernel path's bits, then one load per mode through shinkai up
    serve_begin mixed 570
    run exact 100 "${gpu_tests[@]}" tests/services/engine/test_mixed_steps.py
    show exact "passed|failed|skipped|^SKIPPED|no tests ran|^FAILED|^E  " 12
    local model=/tmp/v41-s1-l${NUM_LAYERS:-8} scheduling c p n rate
    v41_part "$model" "${NUM_LAYERS:-8}"
    for scheduling in separate mixed; do
        serve_ready --model "$model" --load-format dummy --max-num-seqs 64 --max-model-len 4608 \
            --gpu-memory-utilization 0.9 --scheduling "$scheduling" ${MIXED_BUDGET:+--max-num-batched-tokens $MIXED_BUDGET} \
            || { serve_stop; continue; }
        grep -h '"event": "ready"' "$run_dir"/logs/engine-0.log | tee -a "$dir/engine-lines.log"  # the budget
        # The headline pair first; the first mode stops early so the second gets its turn.
        for load in 64:4096 16:512 16:4096 64:512; do
            c=${load%:*}; p=${load#*:}
            if [ "$scheduling" = separate ] && ! enough "${MIXED_RESERVE_S:-120}"; then break; fi
            n=$(( c == 16 ? 24 : 64 )); rate=$(( c / 4 ))  # Poisson arrivals, requests per second
            run "load-$scheduling-c$c-p$p" 60 python3 -m services.client.loadgen --url "http://127.0.0.1:$port/v1" \
                --model "$model" --num-requests $n --concurrency $c --max-tokens 256 --prompt-tokens $p \
                --request-rate $rate
            sed "s/^{/{\"scheduling\": \"$scheduling\", /" "$dir/load-$scheduling-c$c-p$p.log" | grep '^{' \
                | tee -a "$dir/results.jsonl"
        done
        serve_stop
    done
}

suite_experts() {
    begin experts 570
    run tests 200 "${gpu_tests[@]}" tests/kernels/test_moe_fp4.py tests/services/worker/kernel_model/test_fp4_experts.py \
        ${EXPERTS_KL:+tests/services/worker/kernel_model/test_fp8_accuracy.py} \
        -k fp4 -s
    grep -E "passed|failed|FP4 experts|FP8 experts|GPU FP8|Error" "$dir/tests.log" | tail -12
    run step 360 "${bench_step[@]}" --layers "${EXPERTS_LAYERS:-20}" --expert-format fp8,fp4 --batches 1,16,64,256 \
        --contexts 4096 --prefill-tokens "${EXPERTS_PREFILL:-4096}" --no-compare --no-async --json "$dir/step.json" \
        --markdown "$dir/step.md"
    show step "GPU memory|experts|decode |FP4 experts|FAILED|HBM" 30
}

suite_serve_fits() {  # v41-s1 at full depth on one GPU: FP4 experts and host Engram tables, then FP8 experts
    serve_begin serve-fits 570
    { df -h /dev/shm; free -g; } | tee -a "$dir/host.txt"
    serve_ready --model v41-s1 --load-format dummy --engram-on-host --max-num-seqs 16 --max-model-len 4096
    grep -h -E "memory plan|model memory|pools:|Error" "$run_dir"/logs/engine-0.log | tail -12 | tee -a "$dir/engine-lines.log"
    run http 60 python3 scripts/gpu/serve_check.py http --url "http://127.0.0.1:$port/v1" --model v41-s1 \
        --out "$dir/http-fp4.json"
    tail -c 800 "$dir/http.log"
    serve_stop
    run up-fp8 200 python3 -m services.entrypoints.cli up --run-dir "$run_dir" --http-port "$port" --grpc-port 0 \
        --timeout 180 --model v41-s1 --load-format dummy --engram-on-host --expert-format fp8 --max-num-seqs 16 \
        --max-model-len 4096
    tail -5 "$dir/up-fp8.log"
    grep -h -E "memory plan|model memory|NotEnoughMemory|does not fit|ran out|OutOfMemory|pools:" \
        "$run_dir"/logs/engine-0.log | tail -8 | tee -a "$dir/engine-lines.log"
    serve_stop
}

suite_parallel() {
    begin parallel 570
    local gpus; gpus=$(nvidia-smi -L | wc -l)
    if [ "$gpus" -lt 2 ]; then note "parallel: needs 2 GPUs (nvidia-h100-x2), found $gpus"; return; fi
    run ep 170 python3 scripts/gpu/ep_check.py; tail -12 "$dir/ep.log"
    run ep-torch 120 python3 scripts/gpu/ep_check.py --backend torch; tail -12 "$dir/ep-torch.log"
    run ep-drafts 170 python3 scripts/gpu/ep_check.py --num-speculative-tokens 3; tail -12 "$dir/ep-drafts.log"
    run eplb-live 170 python3 scripts/gpu/eplb_live.py; tail -8 "$dir/eplb-live.log"
}

suite_ep_one_gpu() {
    begin ep-one-gpu 240
    run layer 80 "${gpu_tests[@]}" tests/kernels/test_ep_layout.py tests/services/worker/parallel/test_ep_kernel_moe.py
    show layer "^FAILED|^ERROR|^E  .*Error|passed|failed|skipped|^SKIPPED|no tests ran" 12
    run ep-path 95 env PYTHONUNBUFFERED=1 "${bench_step[@]}" --dp 1 --ep-path --layers "${EP_LAYERS:-8}" --batches "${EP_BATCHES:-64}" \
        ${EP_PROFILE:+--profile} --json "$dir/ep-path.json"
    show ep-path "^model|^decode|^profile|Error" 12
    run engine "$(( $(left) - 5 ))" "${gpu_tests[@]}" tests/services/worker/runners/test_ep_decode_graphs.py
    show engine "^FAILED|^ERROR|^E  .*Error|passed|failed|skipped|^SKIPPED|no tests ran" 12
}

suite_hosts() {
    begin hosts 400
    local gpus; gpus=$(nvidia-smi -L | wc -l)
    if [ "$gpus" -lt 2 ]; then note "hosts: needs 2 GPUs (nvidia-h100-x2), found $gpus"; return; fi
    local model=${HOSTS_MODEL:-tiny}
    local extra=(); [ "$model" = tiny ] || extra=(--load-format dummy)
    run two-hosts 380 python3 scripts/gpu/hosts_check.py --model "$model" --log-dir "$dir" "${extra[@]}"
    tail -12 "$dir/two-hosts.log"
}

suite_invariance() {
    begin invariance 560
    run batch 420 python3 scripts/gpu/batch_invariance.py --model v41-s1 --load-format dummy \
        --num-prompts "${INVARIANCE_PROMPTS:-64}"
    grep -E "^\{|differs" "$dir/batch.log" | tail -12
    if enough 60; then
        run graphs 140 python3 scripts/diagnostics/graph_invariance.py; tail -12 "$dir/graphs.log"
    fi
}

base_tree() {  # the baseline tree carried with the call, with its extension
    base=$(cd "${BASE_TREE:-base}" 2>/dev/null && pwd)
    if [ ! -d "$base/services" ]; then
        note "$suite: no baseline tree in ${BASE_TREE:-base}/ (scripts/README.md, 'Comparing two trees')"; return 1
    fi
}

suite_compare() {
    begin compare 570
    base_tree || return
    local i
    for i in 1 2; do  # the trees alternated, so drift between them shows
        PYTHONPATH="$base:$site" run "base-$i" 140 python3 scripts/gpu/decode_median.py --tree base
        PYTHONPATH="$PWD:$site" run "head-$i" 140 python3 scripts/gpu/decode_median.py --tree head
        grep -hv Warning "$dir/base-$i.log" "$dir/head-$i.log" | tee -a "$dir/medians.txt"
    done
}

suite_compare_profile() {
    begin compare-profile 300
    base_tree || return
    local args="--layers ${LAYERS:-8} --no-compare --no-async --batches 1 --contexts ${CONTEXTS:-32768} --prefill-tokens 1024 --profile"
    # shellcheck disable=SC2086 # a list of arguments
    (cd "$base" && PYTHONPATH="$PWD:$site" run base 130 python3 -m services.bench.step.run $args --json "$dir/base.json")
    # shellcheck disable=SC2086 # a list of arguments
    run head 130 "${bench_step[@]}" $args --json "$dir/head.json"
    grep -H "decode  ctx\|prefill  \|^profile" "$dir/base.log" "$dir/head.log"
    python3 scripts/gpu/compare_profiles.py "$dir/base.json" "$dir/head.json" | tee "$dir/compare.txt"
}

# --- the call ----------------------------------------------------------------------------------------------------
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$summary"
for s in "$@"; do
    if [ $(( limit - SECONDS )) -lt 30 ]; then note "== $s: skipped (the call's LIMIT_S is spent)"; continue; fi
    "suite_${s//-/_}"
done
note "== done in $SECONDS s"
# The device returns at most 8 files (2 folders down): pack each suite's folder when there are more.
if [ -n "${OUT:-}" ] && [ "$(find "$out" -type f | wc -l)" -gt "${OUT_MAX_FILES:-8}" ]; then
    for s in "$@"; do
        [ -d "$out/$s" ] && tar -czf "$out/$s.tar.gz" -C "$out" "$s" && rm -rf "${out:?}/$s"
    done
    ls -la "$out"
fi
