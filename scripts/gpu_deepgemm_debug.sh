#!/usr/bin/env bash
# Where DeepGEMM's grouped FP8 GEMM segfaults on the device (every grouped call did in session 11, before any
# JIT compile): builds it as gpu_deepgemm.sh does, prints the toolchain and what _C links, then runs, each in its
# own process under faulthandler and scripts/diagnostics/segv_backtrace.c (LD_PRELOAD: the native frames, mapped
# to source lines with addr2line where they fall in _C), DeepGEMM's own masked case from its tests/generators.py
# (again with DG_JIT_USE_NVRTC=1), a contiguous call, and kernels/deepgemm_moe.py's probe. Writes
# $OUT (or ./out)/debug-*.log.
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
so=$(ls "$build"/deep_gemm/_C*.so)
{ g++ --version | head -1; ldd "$so" | grep -E "stdc|cudart|cuda|nvrtc|torch_python"
  python3 -c "import torch; print('torch cuda', torch.version.cuda)"
  grep -o "GLIBCXX_3\.4\.[0-9]*" "$so" | sort -uV | tail -2; } 2>&1 | tee "$out/debug-toolchain.log"
gcc -shared -fPIC -O0 -o /tmp/segv_backtrace.so scripts/diagnostics/segv_backtrace.c -ldl
export PYTHONPATH="$build:$build/tests:$PWD:${PYTHONPATH:-}"
case_() {  # name, python source
    local name=$1 src=$2
    LD_PRELOAD=/tmp/segv_backtrace.so timeout 60 python3 -X faulthandler -c "$src" > "$out/debug-$name.log" 2>&1
    echo "== $name rc $?"; grep -v "^  File \"/opt" "$out/debug-$name.log" | tail -40
    # The frames inside _C, as source lines (built with -g).
    grep -o "_C[^ ]*\.so([^)]*) \[base+0x[0-9a-f]*\]" "$out/debug-$name.log" | sed 's/.*base+//; s/\]//' \
        | xargs -r addr2line -f -C -i -e "$so" 2>&1 | head -40
}
case_ masked "
import torch, deep_gemm, generators as g
print('deep_gemm', deep_gemm.__version__ if hasattr(deep_gemm, '__version__') else '?', flush=True)
a, b, m, _, d, ref = g.generate_m_grouped_masked(4, 256, 64, 512, 512)
print('a', a[0].shape, a[1].shape, a[1].stride(), 'b', b[0].shape, b[1].shape, flush=True)
deep_gemm.m_grouped_fp8_gemm_nt_masked(a, b, d, m, 64, disable_ue8m0_cast=True)
torch.cuda.synchronize(); print('masked ok', flush=True)"
DG_JIT_USE_NVRTC=1 case_ masked-nvrtc "
import torch, deep_gemm, generators as g
a, b, m, _, d, ref = g.generate_m_grouped_masked(4, 256, 64, 512, 512)
deep_gemm.m_grouped_fp8_gemm_nt_masked(a, b, d, m, 64, disable_ue8m0_cast=True)
torch.cuda.synchronize(); print('masked (nvrtc) ok', flush=True)"
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
