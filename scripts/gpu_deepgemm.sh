#!/usr/bin/env bash
# One device call: build DeepGEMM (third_party/deepgemm-src, carried untracked: docs/performance.md, "DeepGEMM on
# the device") into /tmp, then time its grouped FP8 GEMMs against the Triton grouped GEMM and the cuBLASLt
# per-expert loop at v41-s1's MoE shapes (services/bench/kernels_deepgemm_moe.py), with accuracy checks, and run
# then its GPU tests in the time left (DEEPGEMM_BUILD_ONLY=1: the build and the import check only). Writes
# under $OUT (or ./out): build.log, bench.log, deepgemm.json, pytest.log. Every step is under `timeout`; the whole call stays under BUDGET_S (default 460 s). Usage: bash scripts/gpu_deepgemm.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
budget="${BUDGET_S:-460}"
t0=$(date +%s)
left() { echo $(( budget - ($(date +%s) - t0) )); }
say() { echo "[gpu_deepgemm +$(( $(date +%s) - t0 ))s] $*"; }

src=third_party/deepgemm-src
if [ ! -f "$src/setup.py" ] || [ ! -d "$src/third-party/cutlass/include/cute" ]; then
    say "FAIL: $src is missing or incomplete (carry it: docs/performance.md, 'DeepGEMM on the device')"; exit 2
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
export CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}"
say "CUDA_HOME=$CUDA_HOME; $("$CUDA_HOME/bin/nvcc" --version | tail -1); g++: $(command -v g++ || echo MISSING)"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"

# --- build: DeepGEMM's own setup.py (build_ext --inplace, as its develop.sh), else g++ directly -----------------
build=/tmp/deepgemm
if [ -n "${DEEPGEMM_BUILD:-}" ] && ls "$DEEPGEMM_BUILD"/deep_gemm/_C*.so >/dev/null 2>&1; then
    build=$DEEPGEMM_BUILD; say "using the build in $build"
else
rm -rf "$build"; cp -r "$src" "$build"
ln -sfn "$build/third-party/cutlass/include/cute" "$build/deep_gemm/include/cute"     # as develop.sh links them
ln -sfn "$build/third-party/cutlass/include/cutlass" "$build/deep_gemm/include/cutlass"
# setup.py imports wheel.bdist_wheel and packaging: setuptools vendors both (checked with setuptools 81).
python3 -c "import setuptools, wheel.bdist_wheel, packaging.version; print('setuptools', setuptools.__version__)" \
    || say "setuptools, wheel or packaging missing: expect the g++ build"
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 DG_USE_LOCAL_VERSION=0
say "building deep_gemm._C with setup.py"
# -include cuda_fp8.h: the host compile sizes device structs holding __nv_fp8_e4m3 (layout/mqa_logits.cuh), and a
# syntax-only g++ check of csrc/python_api.cpp against pip's CUDA 13 headers found that type incomplete there.
# CXX=/usr/bin/g++: built by /opt/gcc's g++ (the device's default), _C crashed in std::regex's constructor (a null
# locale facet) on its first call; the system g++ of the same version builds one that runs.
( cd "$build" && CXX=/usr/bin/g++ CC=/usr/bin/gcc CFLAGS="-include cuda_fp8.h" \
    timeout 240 python3 setup.py build_ext --inplace ) > "$out/build.log" 2>&1
if ! ls "$build"/deep_gemm/_C*.so >/dev/null 2>&1; then
    say "setup.py build failed; its last 60 lines:"; tail -60 "$out/build.log"
    say "building deep_gemm._C with g++ directly (c++17, as setup.py)"
    flags=$(python3 - <<'EOF'
import sysconfig, torch
from torch.utils import cpp_extension as ce
inc = ce.include_paths(device_type="cuda") + [sysconfig.get_paths()["include"]]
lib = ce.library_paths(device_type="cuda")
print(" ".join([f"-I{p}" for p in inc] + [f"-L{p}" for p in lib] + [f"-Wl,-rpath,{p}" for p in lib]
               + [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]))
EOF
)
    so="$build/deep_gemm/_C$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
    # shellcheck disable=SC2086 # a list of flags
    ( cd "$build" && timeout 240 /usr/bin/g++ -std=c++17 -O3 -fPIC -shared -Wno-psabi -Wno-deprecated-declarations \
        -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C -include cuda_fp8.h $flags \
        -I"$CUDA_HOME/include" -I"$CUDA_HOME/include/cccl" -Ideep_gemm/include -Ithird-party/cutlass/include \
        -Ithird-party/fmt/include csrc/python_api.cpp -o "$so" -L"$CUDA_HOME/lib64" \
        -lc10 -ltorch -ltorch_cpu -ltorch_python -lc10_cuda -ltorch_cuda -lcudart -lnvrtc ) >> "$out/build.log" 2>&1 \
        || { say "FAIL: g++ build failed; last 60 lines:"; tail -60 "$out/build.log"; exit 3; }
fi
fi
say "built: $(ls "$build"/deep_gemm/_C*.so)"
export PYTHONPATH="$PWD:$build" DG_JIT_CACHE_DIR=/tmp/deepgemm-jit
python3 -c "import deep_gemm, torch; print('deep_gemm', deep_gemm.__version__, 'M alignment',
deep_gemm.get_mk_alignment_for_contiguous_layout())" 2>&1 | tee -a "$out/build.log" | tail -5 \
    || { say "FAIL: deep_gemm does not import"; exit 4; }

[ -n "${DEEPGEMM_BUILD_ONLY:-}" ] && exit 0

# --- the bench: stops starting new sizes early enough to print its table within the budget -----------------------
bench_s=$(( $(left) - 75 )); [ "$bench_s" -ge 150 ] || bench_s=150
say "bench: ${bench_s}s at most, no new size after $(( bench_s - 90 ))s"
SHINKAI_DEEPGEMM_BENCH_S=$(( bench_s - 90 )) timeout "$bench_s" python3 -m services.bench.kernels --only deepgemm_moe \
    --json "$out/deepgemm.json" "$@" 2>&1 | tee "$out/bench.log" | grep -v "^\s*$" | tail -60

# --- the GPU tests (the probe, the grouped outputs against the torch reference, the layout kernel byte for byte)
say "tests"
timeout $(( $(left) > 40 ? $(left) - 15 : 25 )) python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/test_deepgemm_moe.py tests/kernels/test_moe_contiguous.py tests/kernels/test_quant_fp8.py 2>&1 \
    | tee "$out/pytest.log" | tail -15

say "done; $(left)s of the budget left"
