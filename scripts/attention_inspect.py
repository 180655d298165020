"""Print the compiled sparse decode attention kernels' resources (registers, spills, shared memory)
and the MMA instructions in their PTX, at R=1 (split keys) and R=256 (one program per row); run on
the GPU machine after the tests (``scripts/kernels-h200.sh``)."""

from __future__ import annotations

import re

import torch

import kernels.decode_attention as da
from services.bench.kernels import decode_attention_args, decode_attention_problem

compiled = []
for fn in (da._decode_attention_kernel, da._combine_kernel):
    def _record(*args, _run=fn.run, **kwargs):
        kernel = _run(*args, **kwargs)
        compiled.append(kernel)
        return kernel

    fn.run = _record
gen = torch.Generator("cuda").manual_seed(0)
for rows in (1, 256):
    compiled.clear()
    da.sparse_decode_attention(*decode_attention_args(decode_attention_problem(rows, 4096, gen)))
    torch.cuda.synchronize()
    for k in compiled:
        ptx = k.asm.get("ptx", "")
        ops = sorted(set(re.findall(r"\b(wgmma\.\w+|mma\.sync\.\w+|cp\.async\.bulk\.\w+|cp\.async\.\w+)", ptx)))
        print(f"R={rows}: {k.name} regs={k.n_regs} spills={k.n_spills} shared={k.metadata.shared} ops={ops}")
