"""Engram: hashed n-gram memory added to the residual streams (spec §3.8).

Every position looks back over its last ``max_ngram`` tokens, in the tokenizer's case/accent-folded
"compressed" ids. For each n-gram size n = 2..max_ngram and hash head e, the n-gram hashes to a row
of that layer's table (one prime-sized bucket range per (n, e)). The rows are concatenated and
projected to one key per stream and one shared value; a signed-sqrt sigmoid gate per stream decides
how much of the value each stream receives.

History is by absolute position: the look-back for position p uses tokens p−1, p−2, … of the same
sequence, so a cached engine must carry the last ``max_ngram − 1`` compressed ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from model.deepseek_v41.config import ModelConfig


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def engram_primes(cfg: ModelConfig) -> list[list[int]]:
    """Per Engram layer, its (max_ngram−1)·n_heads primes in (n, head) order.

    Distinct primes in increasing order above ``engram_vocab_size``: layer 1 takes the first ones,
    the next Engram layer the following ones (spec §3.8).
    """
    seen: set[int] = set()
    out = []
    for _ in cfg.engram_layer_ids:
        layer = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            p = cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                p += 1
                while not _is_prime(p) or p in seen:
                    p += 1
                seen.add(p)
                layer.append(p)
        out.append(layer)
    return out


def engram_multipliers(layer: int, compressed_vocab: int, max_ngram: int) -> list[int]:
    """Odd hash multipliers m_0..m_{max_ngram−1}: 2·U + 1, U ~ numpy default_rng(10007·layer) (spec §3.8)."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    draws = np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64)
    return [int(v) * 2 + 1 for v in draws]


DEAD = -1
"""The compressed id of a token Engram never reads (image span, padding): it blocks every look-back through it."""


class EngramHasher(nn.Module):
    """Token ids → table rows for every Engram layer. ``token_map`` maps token id → compressed id, and the
    image placeholder (with a vision tower) to DEAD: every image-span token is dead for Engram, whether
    the look-back comes from ``history`` or from a cached engine's carried compressed ids."""

    def __init__(self, cfg: ModelConfig, token_map: Sequence[int] | torch.Tensor, num_compressed: int) -> None:
        super().__init__()
        if num_compressed != cfg.engram_compressed_vocab_size:
            raise ValueError(
                f"the tokenizer's Engram map has {num_compressed} compressed ids but the config says "
                f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size} (the hash multipliers depend on it)"
            )
        # Hash tables are small integer data: always real CPU tensors, even when the weights are
        # built on the meta device (move the module to run it elsewhere).
        token_map = torch.as_tensor(token_map, dtype=torch.long, device="cpu").clone()
        if cfg.vision is not None:
            token_map[cfg.vision.image_token_id] = DEAD
        if not 0 <= cfg.engram_pad_token_id < token_map.numel():
            raise ValueError(f"engram_pad_token_id={cfg.engram_pad_token_id} is outside the tokenizer's ids")
        self.max_ngram = cfg.engram_max_ngram_size
        self.n_heads = cfg.engram_n_heads
        primes = engram_primes(cfg)
        for layer, rows, ps in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings, primes):
            if sum(ps) > rows:
                raise ValueError(f"Engram layer {layer} hashes into {sum(ps)} rows but its table has {rows}")
        offsets = [[sum(ps[:i]) for i in range(len(ps))] for ps in primes]
        mults = [engram_multipliers(layer, num_compressed, self.max_ngram) for layer in cfg.engram_layer_ids]
        self.pad = int(token_map[cfg.engram_pad_token_id])
        self.register_buffer("token_map", token_map, persistent=False)  # [vocab]
        self.register_buffer("primes", torch.tensor(primes, device="cpu"), persistent=False)  # [L, heads]
        self.register_buffer("offsets", torch.tensor(offsets, device="cpu"), persistent=False)  # [L, heads]
        self.register_buffer("multipliers", torch.tensor(mults, device="cpu"), persistent=False)  # [L, max_ngram]

    def history(self, ids: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        """Compressed ids of tokens p, p−1, …, p−max_ngram+1: ids [B, S] → [B, S, max_ngram].

        Once a look-back passes the start or a dead token (``live`` False: image span, padding),
        that slot and every older one hold the pad token's compressed id.
        """
        if bool(((ids < 0) | (ids >= self.token_map.numel())).any()):
            raise ValueError(f"token id outside the tokenizer's {self.token_map.numel()} ids")
        comp = self.token_map[ids]
        if live is not None:
            comp = torch.where(live, comp, DEAD)
        s = ids.shape[-1]
        pos = torch.arange(s, device=ids.device)
        blocked = torch.zeros_like(comp, dtype=torch.bool)
        slots = []
        for shift in range(self.max_ngram):
            src = pos - shift
            tok = comp[..., src.clamp_min(0)]
            blocked = blocked | (src < 0) | (tok == DEAD)
            slots.append(torch.where(blocked, self.pad, tok))
        return torch.stack(slots, dim=-1)

    def rows(self, history: torch.Tensor) -> torch.Tensor:
        """history [B, S, max_ngram] → table rows [B, S, L, (max_ngram−1)·n_heads] for every Engram layer.
        A DEAD slot (a cached engine's carried history) and every older one read as the pad's id."""
        dead = (history == DEAD).int().cummax(dim=-1).values.bool()  # [B, S, max_ngram]
        history = torch.where(dead, self.pad, history)
        products = history.unsqueeze(-2) * self.multipliers  # [B, S, L, max_ngram]; int64, cannot overflow
        value = products[..., 0]
        out = []
        for k in range(1, self.max_ngram):
            value = torch.bitwise_xor(value, products[..., k])  # hash of the (k+1)-gram
            heads = slice((k - 1) * self.n_heads, k * self.n_heads)
            out.append(value.unsqueeze(-1) % self.primes[:, heads])
        return torch.cat(out, dim=-1) + self.offsets


class Engram(nn.Module):
    """``embed`` [rows, de], ``wkv`` [(n+1)·D, heads·de], ``q_weight``/``k_weight`` [n, D]."""

    def __init__(self, cfg: ModelConfig, rows: int) -> None:
        super().__init__()
        n, d = cfg.hc_mult, cfg.hidden_size
        self.n, self.d = n, d
        self.eps = cfg.rms_norm_eps
        self.embed = nn.Embedding(rows, cfg.engram_head_dim)
        self.wkv = nn.Linear(cfg.engram_hash_heads() * cfg.engram_head_dim, (n + 1) * d, bias=False)
        self.q_weight = nn.Parameter(torch.ones(n, d))
        self.k_weight = nn.Parameter(torch.ones(n, d))

    def project(self, h: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [B, S, heads] → (key [B, S, n·D], value [B, S, D]): two views of one wkv product, whose input
        is the embedding in h's dtype."""
        emb = self.embed(rows).flatten(-2).to(h.dtype)  # [B, S, heads·de]; a module, so a GPU build can keep it FP8
        return self.wkv(emb).split((self.n * self.d, self.d), dim=-1)

    def forward(self, h: torch.Tensor, rows: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, S, n, D], rows [B, S, heads] → h + gate·value, [B, S, n, D]. Dead tokens get gate 0."""
        key, value = self.project(h, rows)
        key = key.float().unflatten(-1, (self.n, self.d))  # [B, S, n, D]
        hf = h.float()
        rstd = torch.rsqrt(hf.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (hf * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1) * rstd * self.d**-0.5  # [B, S, n]
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        if live is not None:
            gate = gate.masked_fill(~live.unsqueeze(-1), 0)
        return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)
