#!/usr/bin/env bash
# aiperf (NVIDIA's benchmark client, unmodified) against a running gateway — `shinkai up` or `shinkai serve`.
# aiperf lives in its own venv, because its pins conflict with requirements/dev.txt; this script builds it
# once (keyed by the aiperf version) and hands aiperf the model's own tokenizer from a local folder (no hub).
#
#   bash scripts/dev/aiperf.sh [URL] [more aiperf profile arguments]     # URL default: http://127.0.0.1:8000
#   SHINKAI_API_KEY=... bash scripts/dev/aiperf.sh                        # a gateway started with --api-key
#
# Writes aiperf's artifacts under ${AIPERF_OUT:-out/aiperf}; prints aiperf's table.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
version=0.13.0
venv="${SHINKAI_VENV_ROOT:-$HOME/.cache/shinkai}/aiperf-$version"
url="${1:-http://127.0.0.1:8000}"
shift || true
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  "${PYTHON:-python3.11}" -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet "aiperf==$version" >&2
  touch "$venv/.complete"
fi
flock -u 9
# The served model's tokenizer as a Hugging Face folder (aiperf counts tokens with it).
dev="$(bash "$root/scripts/dev/venv.sh")"
tokenizer="$(cd "$root" && PYTHONPATH="$root" "$dev/bin/python" - <<'PY'
import json, shutil
from model.deepseek_v41.tokenizer import v41_tokenizer_path
source = v41_tokenizer_path()
folder = source.parent / "hf"
folder.mkdir(exist_ok=True)
shutil.copyfile(source, folder / "tokenizer.json")
(folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
print(folder)
PY
)"
key=()
if [ -n "${SHINKAI_API_KEY:-}" ]; then key=(--api-key "$SHINKAI_API_KEY"); fi
out="${AIPERF_OUT:-$root/out/aiperf}"
mkdir -p "$out"
cd "$out"
# Not HF_HUB_OFFLINE: aiperf's offline path looks the folder up in the hub cache; online it loads a local
# folder as it is (and needs no network for one).
env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE "$venv/bin/aiperf" profile --model tiny --url "$url" --endpoint-type completions --streaming \
  --tokenizer "$tokenizer" --synthetic-input-tokens-mean 32 --output-tokens-mean 16 --extra-inputs ignore_eos:true \
  --use-legacy-max-tokens --concurrency 8 --request-count 100 --warmup-request-count 4 --random-seed 1 \
  --output-artifact-dir "$out" "${key[@]}" "$@"
