"""The set of kernel modules the worker's kernel backend calls.

``KernelSet`` names the ``kernels.*`` modules a converted model calls: the compiled ones on a GPU, or
interpreted copies (kernels/interpret.py) for CPU tests, which then run inside ``interpreter()``, or the
kernels' torch references (``KernelSet.references()``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import torch


@dataclass(frozen=True)
class KernelSet:
    """The kernel modules a converted model calls. ``interpreted``: CPU copies under Triton's
    interpreter (no bf16 ``tl.dot`` there, so attention uses its fp32-dot option)."""

    rmsnorm: ModuleType
    quant_fp8: ModuleType
    moe_router: ModuleType
    moe_grouped_gemm: ModuleType
    decode_attention: ModuleType
    # The step's other kernels (services/worker/attention/triton_backend.py, kernel_sampler.py). None: that
    # part stays torch (the FP8 test's torch-reference set); ``compiled()`` and the interpreted sets have them all.
    compressor: ModuleType | None = None
    indexer: ModuleType | None = None
    prefill_attention: ModuleType | None = None
    mhc: ModuleType | None = None
    sampler: ModuleType | None = None
    window_write: ModuleType | None = None  # the window-K FP8 write (else CacheEngine.write_window's torch form)
    indexer_quant: ModuleType | None = None  # the indexer query's FP4 rounding (else quant.fake_quant_indexer)
    entry_slots: ModuleType | None = None  # selected entries → pool slots (else reference.entry_slots)
    engram_gate: ModuleType | None = None  # Engram's gate and residual add (else RowTiledEngram's torch form)
    draft_attention: ModuleType | None = None  # the DSpark draft's block attention (else its torch form)
    moe_contiguous: ModuleType | None = None  # DeepGEMM's contiguous layout (else deepgemm_moe's torch form)
    moe_fp4: ModuleType | None = None  # the MXFP4 experts' grouped GEMM (else routed experts are converted to FP8)
    ep_layout: ModuleType | None = None  # the expert-parallel layer's layouts (else exchange_layout.py's torch form)
    interpreted: bool = False

    NAMES = (
        "rmsnorm",
        "quant_fp8",
        "moe_router",
        "moe_grouped_gemm",
        "decode_attention",
        "compressor",
        "indexer",
        "prefill_attention",
        "mhc",
        "sampler",
        "window_write",
        "indexer_quant",
        "entry_slots",
        "engram_gate",
        "draft_attention",
        "moe_contiguous",
        "moe_fp4",
        "ep_layout",
    )

    @staticmethod
    def compiled() -> KernelSet:
        return KernelSet(*(importlib.import_module(f"kernels.{name}") for name in KernelSet.NAMES))

    @staticmethod
    def references() -> KernelSet:
        """The kernels' torch references (kernels/reference.py) in this shape, on any device: the FP8
        path's formats and wiring without a Triton kernel, i.e. its format noise floor. Compressor,
        indexer and mHC are left out: TritonAttention then compresses and selects with TorchAttention
        (the model's functions). ``interpreted`` (fp32 dot options) is moot for the references."""
        from kernels import reference

        def grouped_gemm(a, w, w_scale, meta, *, gather, swiglu_limit=None, out_dtype=torch.bfloat16, **_):
            return reference.moe_grouped_gemm(
                a,
                w,
                w_scale,
                meta["counts"],
                row_ids=meta["row_ids"] if gather else None,
                route_w=meta["route_w"],
                swiglu_limit=swiglu_limit,
                out_dtype=out_dtype,
            )

        def attention(*args, dot_fp32=False, **_):
            return reference.sparse_decode_attention(*args)

        def prefill(*args, dot_fp32=False, **_):
            return reference.sparse_prefill_attention(*args)

        return KernelSet(
            SimpleNamespace(rmsnorm=reference.rmsnorm),
            SimpleNamespace(quantize_act=reference.quantize_act),
            SimpleNamespace(moe_router=reference.moe_router),
            SimpleNamespace(moe_grouped_gemm=grouped_gemm, moe_experts=reference.moe_experts),
            SimpleNamespace(sparse_decode_attention=attention),
            prefill_attention=SimpleNamespace(sparse_prefill_attention=prefill),
            interpreted=True,
        )
