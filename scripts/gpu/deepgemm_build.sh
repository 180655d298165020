#!/usr/bin/env bash
# Builds DeepGEMM on the device from the carried third_party/deepgemm-src (docs/performance.md, "DeepGEMM on the
# device") into /tmp/deepgemm (DEEPGEMM_BUILD: a folder with a build already there is used as it is), then checks
# that it imports. Called by scripts/gpu/run.sh's deepgemm suites; the build log goes to $1 (default
# /tmp/deepgemm-build.log). Afterwards: PYTHONPATH=…:/tmp/deepgemm DG_JIT_CACHE_DIR=/tmp/deepgemm-jit.
# Exit 2: the source is missing; 3: neither build worked; 4: the build does not import.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
log="${1:-/tmp/deepgemm-build.log}"
t0=$(date +%s)
say() { echo "[deepgemm_build +$(( $(date +%s) - t0 ))s] $*"; }

src=third_party/deepgemm-src
build="${DEEPGEMM_BUILD:-/tmp/deepgemm}"
export CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}"
if ls "$build"/deep_gemm/_C*.so >/dev/null 2>&1; then
    say "using the build in $build"
else
    if [ ! -f "$src/setup.py" ] || [ ! -d "$src/third-party/cutlass/include/cute" ]; then
        say "FAIL: $src is missing or incomplete (carry it: docs/performance.md, 'DeepGEMM on the device')"; exit 2
    fi
    say "CUDA_HOME=$CUDA_HOME; $("$CUDA_HOME/bin/nvcc" --version | tail -1); g++: $(command -v g++ || echo MISSING)"
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    rm -rf "$build"; cp -r "$src" "$build"
    ln -sfn "$build/third-party/cutlass/include/cute" "$build/deep_gemm/include/cute"     # as develop.sh links them
    ln -sfn "$build/third-party/cutlass/include/cutlass" "$build/deep_gemm/include/cutlass"
    # setup.py imports wheel.bdist_wheel and packaging: setuptools vendors both (checked with setuptools 81).
    python3 -c "import setuptools, wheel.bdist_wheel, packaging.version; print('setuptools', setuptools.__version__)" \
        || say "setuptools, wheel or packaging missing: expect the g++ build"
    export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 DG_USE_LOCAL_VERSION=0
    say "building deep_gemm._C with setup.py"
    # -include cuda_fp8.h: the host compile sizes device structs holding __nv_fp8_e4m3 (layout/mqa_logits.cuh), and
    # a syntax-only g++ check of csrc/python_api.cpp against pip's CUDA 13 headers found that type incomplete there.
    # CXX=/usr/bin/g++: built by /opt/gcc's g++ (the device's default), _C crashed in std::regex's constructor (a
    # null locale facet) on its first call; the system g++ of the same version builds one that runs.
    ( cd "$build" && CXX=/usr/bin/g++ CC=/usr/bin/gcc CFLAGS="-include cuda_fp8.h" \
        timeout 240 python3 setup.py build_ext --inplace ) > "$log" 2>&1
    if ! ls "$build"/deep_gemm/_C*.so >/dev/null 2>&1; then
        say "setup.py build failed; its last 60 lines:"; tail -60 "$log"
        say "building deep_gemm._C with g++ directly (c++17, as setup.py)"
        flags=$(python3 - <<'PY'
import sysconfig, torch
from torch.utils import cpp_extension as ce
inc = ce.include_paths(device_type="cuda") + [sysconfig.get_paths()["include"]]
lib = ce.library_paths(device_type="cuda")
print(" ".join([f"-I{p}" for p in inc] + [f"-L{p}" for p in lib] + [f"-Wl,-rpath,{p}" for p in lib]
               + [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]))
PY
)
        so="$build/deep_gemm/_C$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
        # shellcheck disable=SC2086 # a list of flags
        ( cd "$build" && timeout 240 /usr/bin/g++ -std=c++17 -O3 -fPIC -shared -Wno-psabi -Wno-deprecated-declarations \
            -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C -include cuda_fp8.h $flags \
            -I"$CUDA_HOME/include" -I"$CUDA_HOME/include/cccl" -Ideep_gemm/include -Ithird-party/cutlass/include \
            -Ithird-party/fmt/include csrc/python_api.cpp -o "$so" -L"$CUDA_HOME/lib64" \
            -lc10 -ltorch -ltorch_cpu -ltorch_python -lc10_cuda -ltorch_cuda -lcudart -lnvrtc ) >> "$log" 2>&1 \
            || { say "FAIL: g++ build failed; last 60 lines:"; tail -60 "$log"; exit 3; }
    fi
fi
say "built: $(ls "$build"/deep_gemm/_C*.so)"
PYTHONPATH="$PWD:$build${PYTHONPATH:+:$PYTHONPATH}" DG_JIT_CACHE_DIR=/tmp/deepgemm-jit python3 -c "import deep_gemm
print('deep_gemm', deep_gemm.__version__, 'M alignment', deep_gemm.get_mk_alignment_for_contiguous_layout())" \
    2>&1 | tee -a "$log" | tail -5
[ "${PIPESTATUS[0]}" = 0 ] || { say "FAIL: deep_gemm does not import"; exit 4; }
