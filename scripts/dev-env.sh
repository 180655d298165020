# Sourced by the README's commands: activates the pinned venv (building it if needed) and builds the
# Rust extension into the source tree, so `scheduler_rs._core` imports from a checkout.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/venv.sh")"
# shellcheck disable=SC1091
. "$venv/bin/activate"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# cargo test links libpython (PyO3 without extension-module), which lives beside the interpreter.
export LD_LIBRARY_PATH="$(python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYO3_PYTHON="$venv/bin/python"
log="$(mktemp)"
if ! (cd "$root" && maturin develop --release >"$log" 2>&1); then
  cat "$log" >&2; rm -f "$log"; echo "building scheduler_rs failed" >&2; return 1
fi
rm -f "$log"
