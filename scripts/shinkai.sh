#!/usr/bin/env bash
# Runs the `shinkai` CLI from a checkout, building the venv and the extension first if needed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/dev-env.sh"
exec shinkai "$@"
