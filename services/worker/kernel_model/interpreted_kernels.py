"""The kernel backend's kernel sets interpreted on the CPU (``--kernels interpreted``): the kernel backend's code
path, the expert-parallel exchange included, on a machine without a GPU, for debugging and CI. Each set is a
context (``LLM(kernels=…)``, ``RankSpec.kernels``) that turns Triton's interpreter on for its block
(kernels/interpret.py) and yields the ``KernelSet``; the functions are module-level, so a ``functools.partial`` of
one crosses a spawn to the rank processes.

``step_kernels`` interprets what the expert-parallel MoE layer calls (the router, its send and received layouts, the
FP8 activation quantisation, the grouped GEMM and its combine, the MXFP4 grouped GEMM for ``expert_format`` "fp4")
and the RMSNorm, decode and prefill attention a step needs; mHC, the compressor, the indexer and the sampler stay
torch, which the interpreter would take minutes to run (mHC alone took half of a 50 s step of tiny's eight layers).
A kernel set's batch-invariant mode (kernels/invariance.py) covers only its kernels, so with ``batch_invariant`` the
set also runs the CPU's batch-invariant torch maths (model/batch_invariant.py) for the parts that stay torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kernels.interpret import interpreter, load_interpreted
from model.batch_invariant import batch_invariant as torch_batch_invariant
from services.worker.kernel_model.kernel_set import KernelSet

STEP_KERNELS = ("rmsnorm", "quant_fp8", "moe_router", "moe_grouped_gemm", "decode_attention")
"""``step_kernels``' positional kernels, in ``KernelSet``'s order; ``prefill_attention``, ``moe_fp4`` and ``ep_layout``
beside them."""


@contextlib.contextmanager
def step_kernels(batch_invariant: bool = False) -> Iterator[KernelSet]:
    """The MoE path's, the norms' and attention's kernels interpreted, the rest torch (module docstring)."""
    with interpreter(), torch_batch_invariant() if batch_invariant else contextlib.nullcontext():
        yield KernelSet(
            *(load_interpreted(name) for name in STEP_KERNELS),
            prefill_attention=load_interpreted("prefill_attention"),
            moe_fp4=load_interpreted("moe_fp4"),
            ep_layout=load_interpreted("ep_layout"),
            interpreted=True,
        )
