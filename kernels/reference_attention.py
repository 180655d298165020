"""Plain-PyTorch references of the attention-side kernels (``kernels/reference.py`` has the rest and
re-exports these): the sparse decode and prefill attention over the FP8 window ring and the FP4
compressed entries, the entry → pool slot map, and the indexer's scoring and selection. Each computes
what its Triton kernel computes, in the same formats (see ``reference.py``)."""

from __future__ import annotations

import torch

# ---------------------------------------------------------------- sparse decode attention


def entry_slots(entries: torch.Tensor, block_tables: torch.Tensor, entries_per_block: int) -> torch.Tensor:
    """Entry ids [R, k] (−1 = none) of each row's request, with that request's block table [R, width],
    → pool slots int32 [R, k] (block · epb + entry mod epb, the cache engine's ``entry_writes`` slots;
    −1 stays −1). Device ops only: graph-safe."""
    e = entries.long()
    block = block_tables.long().gather(1, (e.clamp_min(0) // entries_per_block))
    slots = block * entries_per_block + e.clamp_min(0) % entries_per_block
    return torch.where(e >= 0, slots, -1).to(torch.int32)


def decode_keys(
    dim: int,
    ring: torch.Tensor,
    state_slots: torch.Tensor,
    positions: torch.Tensor,
    window: int,
    kv_pool: torch.Tensor,
    selected: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each decode row's keys as ``sparse_decode_attention`` reads them (same arguments; ``dim`` = D):
    (fp32 [R, w + k, D]: the window positions pos−w+1 … pos in order, then the ``selected`` entries in
    their order, dequantised; bool [R, w + k]: position ≥ 0, slot ≠ −1)."""
    from model.deepseek_v41.quant import COMPRESSED_KV_BLOCK, dequantize_fp4_cache, dequantize_fp8_cache

    ring_size = ring.shape[1]
    pos = positions.long()
    win_pos = pos[:, None] - window + 1 + torch.arange(window, device=ring.device)  # [R, w] ascending
    raw = ring[state_slots.long()[:, None], win_pos % ring_size]  # [R, w, D + D/32]
    win = dequantize_fp8_cache(raw[..., :dim].view(torch.float8_e4m3fn), raw[..., dim:].view(torch.float8_e8m0fnu))
    epb = kv_pool.shape[1]
    sel = selected.long()
    ent_raw = kv_pool[sel.clamp_min(0) // epb, sel.clamp_min(0) % epb]  # [R, k, D/2 + D/16]
    ent = dequantize_fp4_cache(
        ent_raw[..., : dim // 2], ent_raw[..., dim // 2 :].view(torch.float8_e4m3fn), COMPRESSED_KV_BLOCK
    )
    return torch.cat((win, ent), dim=1), torch.cat((win_pos >= 0, sel >= 0), dim=1)


def sparse_decode_attention(
    q: torch.Tensor,
    ring: torch.Tensor,
    state_slots: torch.Tensor,
    positions: torch.Tensor,
    window: int,
    kv_pool: torch.Tensor,
    selected: torch.Tensor,
    sink: torch.Tensor,
    freqs: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode query per row over its FP8 window ring and its selected FP4 compressed entries.

    q [R, H, D] (post-RoPE); ``ring`` uint8 [slots, ring_size, D + D/32] (``CacheEngine.ring``:
    e4m3 values then e8m0 scales per 32 channels), read at state slot ``state_slots[r]`` and ring
    index p mod ring_size for the window positions p = pos−window+1 … pos that are ≥ 0 (the step has
    already written this row's own K there); ``kv_pool`` uint8 [blocks, epb, D/2 + D/16]
    (``CacheEngine.entries(layer)[0]``: packed e2m1, even channel in the low nibble, then e4m3 scales
    per 16 channels), read at pool slots ``selected`` [R, k] (block · epb + offset, −1 = none; see
    ``entry_slots``). One softmax over window and entries (no de-duplication: a ratio-1 layer may
    see a token twice) with ``exp(sink[h])`` added to the denominator; then RoPE is undone on the
    trailing 2·len(freqs) channels at angle pos · freqs. fp32 throughout; returns q.dtype [R, H, D].
    Equals ``TorchAttention.attend``'s ``sink_attention`` + ``apply_rope(inverse=True)`` up to fp32 order
    (tested): its cos/sin undo-RoPE rounds otherwise than the model's ``torch.polar`` complex product.
    """
    num_rows, num_heads, dim = q.shape
    keys, allowed = decode_keys(dim, ring, state_slots, positions, window, kv_pool, selected)  # K = V
    pos = positions.long()
    logits = torch.einsum("rhd,rtd->rht", q.float(), keys) * scale
    logits = logits.masked_fill(~allowed[:, None, :], -torch.inf)
    sink_col = sink.float().view(1, num_heads, 1).expand(num_rows, num_heads, 1)
    probs = torch.cat((logits, sink_col), dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.einsum("rht,rtd->rhd", probs, keys)  # [R, H, D] fp32
    # Undo RoPE: pairs (2i, 2i+1) of the trailing channels rotate by −pos·freqs[i].
    rot = 2 * freqs.shape[0]
    angles = pos.float()[:, None] * freqs.float()[None, :]  # [R, P]
    even, odd = out[..., dim - rot :: 2], out[..., dim - rot + 1 :: 2]
    cos, sin = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]
    out = out.clone()
    out[..., dim - rot :: 2] = even * cos + odd * sin
    out[..., dim - rot + 1 :: 2] = odd * cos - even * sin
    return out.to(q.dtype)


# ---------------------------------------------------------------- sparse prefill attention


def sparse_prefill_attention(
    q: torch.Tensor,
    step_k: tuple[torch.Tensor, torch.Tensor],
    ring: torch.Tensor,
    state_slots: torch.Tensor,
    positions: torch.Tensor,
    first: torch.Tensor,
    window: int,
    kv_pool: torch.Tensor,
    selected: torch.Tensor,
    sink: torch.Tensor,
    freqs: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The rows of a prefill chunk: ``sparse_decode_attention`` per row over a private copy of its
    ring, into which this step's K rows (``step_k`` = ``quantize_fp8_cache`` of them, the ring's own
    bytes) are written at the row's window positions ≥ ``first`` [R] (its request's first position
    this step). ``ring`` is read as it was before this step's writes; a request's rows are
    consecutive with positions ascending by one, so position p of row r's request is step row
    r − pos[r] + p. Equals ``TorchAttention.attend`` + undo-RoPE (tested); q.dtype [R, H, D].
    """
    values, scales = step_k
    num_rows = q.shape[0]
    ring_size = ring.shape[1]
    if window >= ring_size:
        raise ValueError(f"window {window} must be below the ring size {ring_size}")
    rows = torch.cat((values.view(torch.uint8), scales.view(torch.uint8)), dim=-1)  # [R, D + D/32]
    own = ring[state_slots.long()].clone()  # [R, ring, D + D/32]
    pos = positions.long()
    win = pos[:, None] - window + 1 + torch.arange(window, device=q.device)  # [R, w]
    in_step = (win >= first.long()[:, None]) & (win >= 0)
    r, j = in_step.nonzero(as_tuple=True)
    own[r, win[r, j] % ring_size] = rows[r - pos[r] + win[r, j]]  # distinct ring indices: window < ring
    own_slots = torch.arange(num_rows, device=q.device)
    return sparse_decode_attention(q, own, own_slots, positions, window, kv_pool, selected, sink, freqs, scale)


# ---------------------------------------------------------------- indexer scoring and selection


def indexer_select(
    q: torch.Tensor,
    w: torch.Tensor,
    key_pool: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    width: int,
    *,
    index_topk: int,
    candidates: torch.Tensor | None = None,
    candidate_source: bool = False,
    candidate_block_size: int = 8,
    candidate_topk_blocks: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``kernels.indexer.indexer_select`` by the model's functions: keys gathered and dequantised as
    ``CacheEngine.read_entries`` does, ``Indexer.scores_quantized`` (with w given directly),
    ``Attention.restrict_to_candidates``' two cases and ``select_entries``.

    q [R, Hi, di], w [R, Hi] (already times (di·Hi)^-1/2), key_pool uint8 [blocks, epb, di/2 + di/32],
    block_tables [R, ·], positions [R]; candidates bool [R, width] (the model's entry mask) or None.
    Returns (scores fp32 [R, width] after the candidate restriction, entries int64 [R, min(k, width)],
    candidates bool [R, width] from the candidate source, else the ones given).
    """
    from types import SimpleNamespace

    from model.deepseek_v41.indexer import Indexer, candidate_mask, select_entries, visible_entries
    from model.deepseek_v41.quant import INDEXER_BLOCK, dequantize_fp4_cache

    num_rows, num_heads, dim = q.shape
    epb = key_pool.shape[1]
    e = torch.arange(width, device=q.device)
    raw = key_pool[block_tables.long()[:, e // epb], e % epb]  # [R, W, di/2 + di/32]
    keys = dequantize_fp4_cache(raw[..., : dim // 2], raw[..., dim // 2 :].view(torch.float8_e8m0fnu), INDEXER_BLOCK)
    visible = visible_entries(positions.long(), ratio).clamp(0, width).unsqueeze(-1)  # [R, 1]
    given_w = SimpleNamespace(weights_proj=lambda x: x, weight_scale=1.0)  # w = weights_proj(x)·1
    scores = Indexer.scores_quantized(given_w, q.float().unsqueeze(1), w.float().unsqueeze(1), keys, visible)
    if candidate_source:
        candidates = candidate_mask(scores, visible, num_blocks=candidate_topk_blocks, block_size=candidate_block_size)[
            :, 0
        ]
    elif candidates is not None:
        scores = scores.masked_fill(~candidates.unsqueeze(1), -torch.inf)
    return scores[:, 0], select_entries(scores, index_topk)[:, 0], candidates
