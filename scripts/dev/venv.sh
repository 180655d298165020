#!/usr/bin/env bash
# Prints the path of the development venv, building it first if it does not exist.
# The venv lives outside the clone, keyed by a hash of requirements/, so CI reuses it across clones
# and a pin change builds a fresh one. torch is installed with pip (the CUDA build from PyPI).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
key="$(cat "$root"/requirements/*.txt | sha256sum | cut -c1-16)"
venv="${SHINKAI_VENV_ROOT:-$HOME/.cache/shinkai}/venv-$key"
mkdir -p "$(dirname "$venv")"
# One build at a time per venv: a second caller waits, then finds it complete.
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  py="${PYTHON:-python3.11}"
  command -v "$py" >/dev/null || py=python3
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$py" -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --upgrade pip==25.3 >&2
  "$venv/bin/pip" install --quiet -r "$root/requirements/dev.txt" >&2
  "$venv/bin/pip" install --quiet --no-deps -r "$root/requirements/oracle.txt" >&2
  # Hugging Face's `kernels` package would shadow our top-level `kernels`.
  "$venv/bin/pip" uninstall --quiet -y kernels >/dev/null 2>&1 || true
  touch "$venv/.complete"
fi
echo "$venv"
