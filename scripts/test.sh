#!/usr/bin/env bash
# The test command: builds what it needs on a fresh machine, then runs every CPU test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
. scripts/dev/dev-env.sh
echo "== cargo test"
cargo test --quiet --manifest-path scheduler_rs/Cargo.toml
echo "== cargo clippy"
cargo clippy --quiet --manifest-path scheduler_rs/Cargo.toml --all-targets -- -D warnings
echo "== stubtest"
python -m mypy.stubtest scheduler_rs._core
echo "== import contract (pyproject.toml [tool.importlinter])"
lint-imports --no-cache
echo "== ruff"
ruff check .
ruff format --check .
echo "== pytest"
python -m pytest -q --durations=25 "$@"
if [ $# -eq 0 ]; then
  echo "== CPU profiles (scripts/dev/cpu_profiles.sh)"
  bash scripts/dev/cpu_profiles.sh
fi
