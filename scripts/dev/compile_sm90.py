"""Compile a Triton kernel for the H200 (sm_90a) on this CPU machine and print its resources.

No device is needed: Triton builds PTX and runs its bundled ptxas, which reports registers, spills and
shared memory. Use it to catch compile errors and register pressure before spending device time.

    python scripts/dev/compile_sm90.py kernels.rmsnorm:_rmsnorm_kernel \
        'x_ptr=*bf16,w_ptr=*fp32,y_ptr=*bf16,turn_ptr=*fp32,q_ptr=*bf16,num_rows=i32,num_channels=i32,x_row_stride=i32,y_row_stride=i32,eps=fp32,turn_row_stride=i32,q_row_stride=i32,q_head_stride=i32,num_heads=i32,q_dim=i32' \
        'ROWS=4,BLOCK_C=8192,ROPE_PAIRS=0,BLOCK_P=1,BLOCK_H=1' [num_warps=4] [num_stages=3]

From Python: ``compile_sm90(fn, signature: dict[str, str], constexprs: dict[str, object], num_warps=4,
num_stages=3)`` returns the compiled kernel (``.asm['ptx']``, ``.asm['sass']`` where available) and
the ptxas report. Constexpr arguments go in ``constexprs`` only (their signature type is filled in).
"""  # noqa: E501 - the example's signature argument is one shell word and cannot be split

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def _ptxas() -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    found = get_ptxas(90)
    return found.path if hasattr(found, "path") else found[0]


def ptxas_report(ptx: str) -> str:
    """ptxas -v on the PTX for sm_90a: the 'Used N registers, … spill …' lines."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [_ptxas(), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        )
    return "\n".join(
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if re.search(r"registers|spill|error|smem|stack", line)
    )


def compile_sm90(
    fn,
    signature: dict[str, str],
    constexprs: dict[str, object],
    num_warps: int = 4,
    num_stages: int = 3,
    divisible: tuple[str, ...] | None = None,
):
    """``divisible``: the arguments a launch specialises as multiples of 16 (pointers of 16-byte-aligned
    tensors, ints divisible by 16); None: every pointer, as a launch on torch's allocations does. Without
    it the compiler cannot vectorise loads (byte loads of e4m3 tiles, more registers)."""
    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    if divisible is None:
        divisible = tuple(k for k, v in signature.items() if v.startswith("*"))
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in divisible}
    src = ASTSource(
        fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()}, attrs=attrs
    )
    kernel = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    return kernel, ptxas_report(kernel.asm["ptx"])


def _pairs(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",") if item)


def main(argv: list[str]) -> int:
    module, name = argv[0].split(":")
    fn = getattr(importlib.import_module(module), name)
    consts = {
        k: (int(v) if v.lstrip("-").isdigit() else v) for k, v in _pairs(argv[2] if len(argv) > 2 else "").items()
    }
    opts = {k: int(v) for k, v in (a.split("=") for a in argv[3:])}
    kernel, report = compile_sm90(fn, _pairs(argv[1]), consts, **opts)
    print(f"{name}: compiled for sm_90a, shared {kernel.metadata.shared} bytes")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
