"""Print the compiled MoE GEMM's resources (registers, spills, shared memory) and whether its PTX
uses Hopper's wgmma, for the default configs at T=1 and T=256 (run on the GPU machine)."""

from __future__ import annotations

import re
import sys

import torch

import kernels.moe_grouped_gemm as mg
from kernels.reference import route_metadata

compiled = []
_run = mg._moe_gemm_kernel.run


def _record(*args, **kwargs):
    kernel = _run(*args, **kwargs)
    compiled.append(kernel)
    return kernel


mg._moe_gemm_kernel.run = _record
gen = torch.Generator("cuda").manual_seed(0)
for tokens in (1, 256):
    experts = torch.rand(tokens, 48, device="cuda", generator=gen).argsort(-1)[:, :6]
    meta = route_metadata(experts, torch.rand(tokens, 6, device="cuda", generator=gen), 48)
    x = torch.randn(tokens, 5120, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(48, 4608, 5120, device="cuda").to(torch.float8_e4m3fn)
    s = torch.ones(48, 36, 40, device="cuda")
    mg.moe_grouped_gemm(x, w, s, meta, gather=True, swiglu_limit=10.0)
    torch.cuda.synchronize()
    k = compiled[-1]
    ptx = k.asm.get("ptx", "")
    ops = sorted(set(re.findall(r"\b(wgmma\.\w+|mma\.sync\.\w+|cp\.async\.bulk\.\w+|cp\.async\.\w+)", ptx)))
    print(f"T={tokens}: {k.name} regs={k.n_regs} spills={k.n_spills} shared={k.metadata.shared} ops={ops}")
    if len(sys.argv) > 1:
        with open(f"{sys.argv[1]}/moe_gemm_T{tokens}.ttgir", "w") as f:
            f.write(k.asm.get("ttgir", ""))
