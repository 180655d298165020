#!/usr/bin/env bash
# Runs the `shinkai` CLI from a checkout, building the venv and the extension first if needed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The caller's PATH, before the venv's bin joins it: the CLI's hints name a command that runs in the caller's shell.
export SHINKAI_CALLER_PATH="$PATH"
# A failed Rust build leaves the venv active: commands that need the extension then say so (exit 2), and
# the rest (`shinkai eplb`) still run.
. "$root/scripts/dev/dev-env.sh" || echo "shinkai: the Rust extension did not build; commands that need it will fail" >&2
# The module, not the console script: a venv shared across checkouts may hold an older script.
exec python -m services.entrypoints.cli "$@"
