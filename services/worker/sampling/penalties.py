"""The penalties and min-p, the sampler's steps after the bans (CPU sampler's side; the kernel's pre-pass in
kernels/sampler.py does the same arithmetic, bit for bit).

Penalties (vLLM's order and semantics), per row with a token-count slot, for every token id ``t`` with ``c`` its
count in the output so far and ``seen`` = c > 0 or ``t`` in the prompt::

    y = float64(x)
    y = y / r if y > 0 else y * r        where seen          (repetition_penalty r)
    y = y − f · c                                             (frequency_penalty f)
    y = y − p · [c > 0]                                       (presence_penalty p)
    x = float32(y)

The penalty values act at their float32 rounding (``float32_value``), and the arithmetic runs in float64: a
float32 value times a count below 2²⁹ (or times a float32 value) is exact in float64, so a compiler's fused
multiply-add gives the same bits as a multiply then an add, and the division is IEEE's on every side.

min-p: with ``m`` the row's max after the penalties and ``T`` the pipeline's temperature (1 for greedy, else at
least float32's smallest normal), a token is dropped (→ -inf) where float32 ``(x − m) / T`` is below
``float32(log(min_p))``, i.e. its probability is below min_p times the top token's. The max always stays, so a
row keeps at least one token; an error row (NaN, +inf, nothing finite) stays one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kernels.device import upload

# ``rows`` below are SamplingRow sequences (sampler.py, which imports this module).

if TYPE_CHECKING:
    from services.worker.sampling.token_counts import TokenCounts


def float32_value(value: float) -> float:
    """``value`` rounded to the nearest float32 (as a Python float)."""
    return float(torch.tensor(value, dtype=torch.float32))


def min_p_threshold(min_p: float) -> float:
    """float32(log(min_p)); -inf for min_p = 0 (off: nothing is below it)."""
    return -math.inf if min_p <= 0 else float32_value(math.log(min_p))


def pipeline_temperature(temperature: float) -> float:
    """The temperature the pipeline divides by: 1 for greedy, else at least float32's smallest normal."""
    return max(temperature, torch.finfo(torch.float32).tiny) if temperature > 0 else 1.0


def _column(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return upload(torch.tensor(values, dtype=dtype), device).unsqueeze(-1)


def apply_penalties(x: torch.Tensor, rows: Sequence, counts: TokenCounts | None) -> None:
    """fp32 logits [n, V], in place: the penalties of every row that has them (module docstring)."""
    index = [i for i, r in enumerate(rows) if r.has_penalties]
    if not index:
        return
    if counts is None:
        raise ValueError("rows with penalties need the token counts (TokenCounts)")
    device = x.device
    picked = [rows[i] for i in index]
    rows_t = upload(torch.tensor(index, dtype=torch.int64), device)
    slots = upload(torch.tensor([r.history for r in picked], dtype=torch.int64), device)
    c = counts.output[slots].to(torch.float64)
    in_output = c > 0
    seen = in_output | counts.prompt[slots]
    # float32 values, widened: every product below is exact in float64.
    rep = _column([r.repetition_penalty for r in picked], torch.float32, device).to(torch.float64)
    freq = _column([r.frequency_penalty for r in picked], torch.float32, device).to(torch.float64)
    pres = _column([r.presence_penalty for r in picked], torch.float32, device).to(torch.float64)
    y = x[rows_t].to(torch.float64)
    y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
    y = y - freq * c
    y = y - pres * in_output.to(torch.float64)
    x[rows_t] = y.to(torch.float32)


def apply_min_p(x: torch.Tensor, rows: Sequence) -> None:
    """fp32 logits [n, V], in place: min-p's drops (module docstring)."""
    index = [i for i, r in enumerate(rows) if r.min_p > 0]
    if not index:
        return
    device = x.device
    picked = [rows[i] for i in index]
    rows_t = upload(torch.tensor(index, dtype=torch.int64), device)
    sub = x[rows_t]
    temperature = _column([pipeline_temperature(r.temperature) for r in picked], torch.float32, device)
    threshold = _column([min_p_threshold(r.min_p) for r in picked], torch.float32, device)
    s = (sub - sub.amax(dim=-1, keepdim=True)) / temperature
    x[rows_t] = sub.masked_fill(s < threshold, -math.inf)
