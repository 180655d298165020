#!/usr/bin/env bash
# The CPU-profile matrix: a few CPU tests whose results rest on the CPU's own kernels (the Triton interpreter's
# numpy/OpenBLAS dot, torch's ATen kernels, thread counts), re-run under other profiles than this machine's:
# torch's ATen dispatch capped by ATEN_CPU_CAPABILITY, OpenBLAS's micro-kernels forced by OPENBLAS_CORETYPE,
# and another thread count. A test that passes only on the developer's or CI's own CPU fails here.
# (tests/services/engine/test_batch_invariant.py covers the engine's thread counts × capabilities in-suite.)
# Usage: bash scripts/dev/cpu_profiles.sh [pytest args]; scripts/test.sh runs it after the suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
files=(
  tests/kernels/test_interpret.py          # an interpreted run, then a compile for sm_90 in the same process
  tests/kernels/test_moe_contiguous.py     # interpreted against torch, byte for byte
  tests/kernels/test_moe_grouped_gemm.py   # interpreted tl.dot (numpy) against torch's matmul
  tests/kernels/test_moe_router.py         # interpreted tl.dot, routing ties
)
profiles=(
  "ATEN_CPU_CAPABILITY=default OPENBLAS_CORETYPE=Haswell OMP_NUM_THREADS=1"
  "ATEN_CPU_CAPABILITY=avx2 OPENBLAS_CORETYPE=Sandybridge OMP_NUM_THREADS=2"
)
for profile in "${profiles[@]}"; do
  echo "-- $profile"
  env $profile TRITON_CACHE_DIR="$(mktemp -d)" python -m pytest -q -p no:cacheprovider "${files[@]}" "$@"
done
