# Sourced by the README's commands: activates the pinned venv (building it if needed) and builds the
# Rust extension into the source tree, so `scheduler_rs._core` imports from a checkout.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$(bash "$root/scripts/dev/venv.sh")"
# shellcheck disable=SC1091
. "$venv/bin/activate"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# cargo test links libpython (PyO3 without extension-module), which lives beside the interpreter.
export LD_LIBRARY_PATH="$(python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYO3_PYTHON="$venv/bin/python"
# The extension is rebuilt only when a Rust source or manifest is newer than it, or it does not import
# with this venv's Python (each `scripts/shinkai.sh` call would otherwise pay maturin's 1-2 s).
so="$(ls "$root"/scheduler_rs/_core*.so 2>/dev/null | head -n 1 || true)"  # none yet in a fresh clone (pipefail)
if [ -z "$so" ] || [ -n "$(find "$root/scheduler_rs/src" "$root/scheduler_rs/Cargo.toml" "$root/Cargo.toml" \
    "$root/Cargo.lock" -newer "$so" -print -quit 2>/dev/null)" ] \
    || ! (cd "$root" && python -c "import scheduler_rs._core" 2>/dev/null); then
  log="$(mktemp)"
  if ! (cd "$root" && maturin develop --release >"$log" 2>&1); then
    cat "$log" >&2; rm -f "$log"; echo "building scheduler_rs failed" >&2; return 1
  fi
  rm -f "$log"
fi
