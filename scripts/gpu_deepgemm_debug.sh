#!/usr/bin/env bash
# Where DeepGEMM's grouped FP8 GEMM segfaults on the device (scripts/gpu_deepgemm.sh's probe did, first call):
# builds it as gpu_deepgemm.sh does, then runs, each in its own process under faulthandler (and gdb's backtrace
# when gdb is there): DeepGEMM's own masked and contiguous grouped cases from its tests/generators.py, then
# kernels/deepgemm_moe.py's probe. Writes $OUT (or ./out)/debug-*.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 DG_USE_LOCAL_VERSION=0
export DG_JIT_DEBUG=1 DG_JIT_PRINT_COMPILER_COMMAND=1 DG_JIT_CACHE_DIR=/tmp/deepgemm-jit
build=/tmp/deepgemm; rm -rf "$build"; cp -r third_party/deepgemm-src "$build"
ln -sfn "$build/third-party/cutlass/include/cute" "$build/deep_gemm/include/cute"
ln -sfn "$build/third-party/cutlass/include/cutlass" "$build/deep_gemm/include/cutlass"
( cd "$build" && CFLAGS="-include cuda_fp8.h" timeout 200 python3 setup.py build_ext --inplace ) > "$out/debug-build.log" 2>&1
ls "$build"/deep_gemm/_C*.so || { tail -30 "$out/debug-build.log"; exit 2; }
export PYTHONPATH="$build:$build/tests:$PWD:${PYTHONPATH:-}"
case_() {  # name, python source
    local name=$1 src=$2
    if command -v gdb >/dev/null; then
        timeout 60 gdb -q -batch -ex run -ex bt --args python3 -X faulthandler -c "$src" > "$out/debug-$name.log" 2>&1
    else
        timeout 60 python3 -X faulthandler -c "$src" > "$out/debug-$name.log" 2>&1
    fi
    echo "== $name rc $?"; grep -v "^\[New Thread\|^\[Thread" "$out/debug-$name.log" | tail -25
}
case_ masked "
import torch, deep_gemm, generators as g
print('deep_gemm', deep_gemm.__version__ if hasattr(deep_gemm, '__version__') else '?', flush=True)
a, b, m, _, d, ref = g.generate_m_grouped_masked(4, 256, 64, 512, 512)
print('a', a[0].shape, a[1].shape, a[1].stride(), 'b', b[0].shape, b[1].shape, flush=True)
deep_gemm.m_grouped_fp8_gemm_nt_masked(a, b, d, m, 64, disable_ue8m0_cast=True)
torch.cuda.synchronize(); print('masked ok', flush=True)"
case_ contiguous "
import torch, deep_gemm
x = torch.randn(256, 512, device='cuda').to(torch.float8_e4m3fn); xs = torch.ones(256, 4, device='cuda')
w = torch.randn(2, 512, 512, device='cuda').to(torch.float8_e4m3fn); ws = torch.ones(2, 4, 4, device='cuda')
d = torch.empty(256, 512, device='cuda', dtype=torch.bfloat16); mi = torch.zeros(256, dtype=torch.int32, device='cuda')
deep_gemm.m_grouped_fp8_gemm_nt_contiguous((x, xs), (w, ws), d, mi, disable_ue8m0_cast=True)
torch.cuda.synchronize(); print('contiguous ok', flush=True)"
case_ probe "
import torch, kernels.deepgemm_moe as m
print(m._probe(torch.device('cuda', 0)), flush=True)"
