"""Launch configs of the MoE grouped GEMM measured on a device, looked up by the GEMM's shape and token count.

One JSON file per device, ``kernels/configs/moe_grouped_gemm-<device>.json`` (``<device>``: the CUDA device's
name, lower case, spaces as dashes), written by ``shinkai bench kernels --only moe_configs --write-configs``::

    {"E49 N4608 K5120 swiglu a8 out8": {"1": {"num_warps": 4, "num_stages": 4, "programs_per_sm": 1}, ...}, ...}

A config holds only what spreads a tile's work over warps, pipeline stages and programs. None of it changes
the arithmetic: every output element is one program's K loop in the same order, so each config gives the
default launch's bits (the GPU test of ``tests/kernels/test_moe_configs.py`` checks the measured table).
``BLOCK_M``, which batch-invariant mode fixes, stays the launcher's. The table is not read in that mode,
nor under the CPU interpreter, nor with ``SHINKAI_MOE_CONFIGS=0`` (the bench's A/B switch).

A lookup takes the entry at the measured token count nearest the call's (vLLM's fused-MoE rule); a shape
without an entry keeps the launcher's defaults.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from kernels import invariance

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
ENV = "SHINKAI_MOE_CONFIGS"  # "0": the launcher's defaults everywhere
FIELDS = ("num_warps", "num_stages", "programs_per_sm")


@functools.cache  # called at every launch: the key is built once per shape
def shape_key(num_experts: int, n_w: int, k: int, *, swiglu: bool, a_fp8: bool, out_dtype: torch.dtype) -> str:
    """The table's key of one GEMM: its stacked experts, weight shape and the kernel variant."""
    out = {torch.float8_e4m3fn: "out8", torch.bfloat16: "out16", torch.float32: "out32"}[out_dtype]
    return f"E{num_experts} N{n_w} K{k} {'swiglu' if swiglu else 'plain'} {'a8' if a_fp8 else 'a16'} {out}"


def config_path(device_name: str) -> Path:
    return CONFIG_DIR / f"moe_grouped_gemm-{device_name.lower().replace(' ', '-')}.json"


@functools.cache
def _table(device_name: str) -> dict[str, dict[int, dict[str, int]]]:
    path = config_path(device_name)
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {
        key: {int(t): {f: int(c[f]) for f in FIELDS if f in c} for t, c in by_tokens.items()}
        for key, by_tokens in raw.items()
    }


def nearest(by_tokens: dict[int, dict[str, int]], num_tokens: int) -> dict[str, int]:
    """The entry at the measured token count nearest ``num_tokens`` (the smaller one on a tie)."""
    return by_tokens[min(by_tokens, key=lambda t: (abs(t - num_tokens), t))]


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def lookup(device: torch.device, key: str, num_tokens: int) -> dict[str, int]:
    """The measured config of GEMM ``key`` at ``num_tokens`` on ``device``; {} where there is none to use."""
    if device.type != "cuda" or invariance.active():
        return {}
    by_tokens = _table(_device_name(device)).get(key)  # before the environment: its read costs ~1 µs a launch
    return nearest(by_tokens, num_tokens) if by_tokens and os.environ.get(ENV) != "0" else {}
