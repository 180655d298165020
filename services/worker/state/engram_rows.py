"""Engram's table rows for a step's rows, from the state slots' compressed-id history (spec §3.8).

A row at position p hashes the compressed ids of positions p, p−1, …, p−max_ngram+1: those from this
step's rows are computed here, the earlier ones are read from the slot's history (read before this
step writes it; writes keep only each request's last ``size`` positions, so a position-mod-size
index never collides within one step). Positions before the start take the pad's id.
"""

from __future__ import annotations

import torch

from model.deepseek_v41.engram import EngramHasher
from services.worker.batch.step_batch import StepBatch
from services.worker.state.cache_engine import CacheEngine


def engram_rows(cache: CacheEngine, batch: StepBatch, hasher: EngramHasher) -> torch.Tensor:
    """Table rows [1, R, L, heads] of every row of ``batch``; writes the rows' compressed ids to the history."""
    b, history = batch, cache.engram_history()
    size = history.shape[1]
    comp = hasher.token_map[b.input_ids]  # [R]
    carried = history[b.state_slots].long()  # [N, size], read before this step's writes
    look = b.positions.unsqueeze(-1) - torch.arange(hasher.max_ngram, device=b.device)  # [R, m]: p, p−1, …
    in_step = look >= b.row_first().unsqueeze(-1)
    tokens = torch.where(
        in_step, comp[b.row_index(b.row_requests, look)], carried[b.row_requests.unsqueeze(-1), look % size]
    )
    tokens = torch.where(look >= 0, tokens, hasher.pad)  # before the start: the pad's id
    # Rows outside their request's last ``size`` positions write the null slot 0 (a boolean-mask index
    # would read the mask's count back to the host: a stream sync on CUDA).
    slots = torch.where(b.tail(size), b.state_slots[b.row_requests], 0)
    history[slots, b.positions % size] = comp.to(torch.int32)
    return hasher.rows(tokens.unsqueeze(0))


def static_engram_rows(
    cache: CacheEngine,
    hasher: EngramHasher,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    state_slots: torch.Tensor,
    first: torch.Tensor,
    seqlens_k: torch.Tensor,
) -> torch.Tensor:
    """``engram_rows`` for G static decode rows with device ops and fixed shapes only (graph-safe). A
    request's rows are contiguous at consecutive positions (one row, or 1 + the drafts verified), so the
    row holding an in-step position q ≥ first of row i's request is row i − (p_i − q). Only rows among
    their request's last ``size`` positions write the history; the others write the null slot 0, as
    placeholder rows do. input_ids, positions, state_slots (the row's request's), first and seqlens_k
    (its request's, per row) [G] → [1, G, L, heads]."""
    history = cache.engram_history()
    size = history.shape[1]
    comp = hasher.token_map[input_ids]  # [G]
    back = torch.arange(hasher.max_ngram, device=positions.device)  # [m]
    look = positions.unsqueeze(-1) - back  # [G, m]: p, p−1, …
    carried = history[state_slots.unsqueeze(-1), look % size].long()  # read before the write below
    rows = (torch.arange(positions.shape[0], device=positions.device).unsqueeze(-1) - back).clamp_min(0)  # [G, m]
    tokens = torch.where(look >= first.unsqueeze(-1), comp[rows], carried)
    tokens = torch.where(look >= 0, tokens, hasher.pad)  # before the start: the pad's id
    tail = positions >= seqlens_k - size
    history[torch.where(tail, state_slots, 0), positions % size] = comp.to(torch.int32)
    return hasher.rows(tokens.unsqueeze(0))
