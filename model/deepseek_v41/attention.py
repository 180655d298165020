"""Attention with a shared K=V latent, sliding window, sink and sparse long-range branch (spec §3.5).

Per layer: q = wq_b(q_norm(wq_a x)) (64 heads, no per-head norm); one latent k = kv_norm(wkv x)
serves as key and value; RoPE on the trailing rope channels (main base for ratio 0, compress base
+ YaRN otherwise); window K rounded to FP8. A query at p sees the window max(0, p−w+1)..p plus,
for ratio>0, the compressed entries its index source selected. One sink logit per head adds
exp(sink) to the softmax denominator. RoPE is undone on the output, which then goes through the
grouped low-rank ``wo_a`` (one block per group of heads) and ``wo_b``.

Cross-layer sharing (spec §3.4) travels in ``SparseState``: a KV source replaces it, an index
source replaces its selection, other compressed layers reuse it unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model import batch_invariant
from model.deepseek_v41.compressor import Compressor, compressed_entries, group_positions
from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.indexer import Indexer, candidate_mask, select_entries, selection_mask, visible_entries
from model.deepseek_v41.norm import RMSNorm
from model.deepseek_v41.quant import fake_quant_fp8_e4m3
from model.deepseek_v41.rope import apply_rope, rope_angles, rope_frequencies


@dataclass(frozen=True)
class SparseState:
    """What KV/index sources publish for the layers after them (one forward, never mutated)."""

    ratio: int = 0
    compressed_kv: torch.Tensor | None = None  # [B, W, hd], rotated, FP4-rounded
    index_keys: torch.Tensor | None = None  # [B, W, di], rotated, FP4-rounded
    selected: torch.Tensor | None = None  # [B, S, ≤topk] ascending entry ids, −1 = none
    candidates: torch.Tensor | None = None  # [B, S, W] bool, published by the candidate source


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.ratio = cfg.ratio(layer)
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.num_groups = cfg.o_groups
        self.window = cfg.sliding_window
        self.index_topk = cfg.index_topk
        self.is_candidate_source = layer == cfg.candidate_source_layer_id
        self.uses_candidates = cfg.uses_candidates(layer)
        self.candidate_topk_blocks = cfg.candidate_topk_blocks
        self.candidate_block_size = cfg.candidate_block_size
        d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.wq_a = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, h * hd, bias=False)
        self.wkv = nn.Linear(d, hd, bias=False)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        # wo_a rows g·R … (g+1)·R−1 project group g's concatenated heads (H/G · hd channels).
        self.wo_a = nn.Linear(h * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, d, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(h))
        self.register_buffer("freqs", rope_frequencies(cfg, compressed=self.ratio > 0), persistent=False)
        # Which frequency set ``freqs`` holds (the compress base with YaRN, or the main base): layers with
        # equal keys have equal freqs, so a step computes their RoPE turns once (AttentionStep).
        self.rope_key = self.ratio > 0
        is_kv_source = layer in cfg.kv_source_layer_ids
        self.compressor = Compressor(cfg, self.ratio) if is_kv_source else None
        self.indexer = Indexer(cfg, owns_keys=is_kv_source) if layer in cfg.index_source_layer_ids else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: SparseState) -> tuple[torch.Tensor, SparseState]:
        """x [B, S, D] (attn_norm output), positions [B, S] = 0..S−1 → ([B, S, D], state for later layers)."""
        angles = rope_angles(positions, self.freqs)  # [B, S, P]
        q_latent, q = self.queries(x, angles)
        kv = self.window_kv(x, angles)  # [B, S, hd]
        if self.ratio:
            state = self._sparse(x, positions, q_latent, state)
        if batch_invariant.active():
            out = self._attend_per_query(q, kv, state)
            return self.project_out(out, angles), state
        allowed = window_mask(positions, self.window)  # [B, S, S]
        if self.ratio:
            width = state.compressed_kv.shape[1]
            kv = torch.cat((kv, state.compressed_kv), dim=1)  # [B, S + W, hd]
            allowed = torch.cat((allowed, selection_mask(state.selected, width)), dim=-1)
        out = sink_attention(q, kv, allowed, self.attn_sink, self.head_dim**-0.5)  # [B, S, H, hd]
        return self.project_out(out, angles), state

    def queries(self, x: torch.Tensor, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, D], angles [B, S, P] → (q latent [B, S, q_lora], rotated queries [B, S, H, hd])."""
        q_latent = self.query_latent(x)  # [B, S, q_lora]
        return q_latent, apply_rope(self.query_heads(q_latent), angles)  # [B, S, H, hd]

    def query_latent(self, x: torch.Tensor) -> torch.Tensor:
        """q_norm(wq_a x): x [B, S, D] → [B, S, q_lora]."""
        return self.q_norm(self.wq_a(x))

    def query_heads(self, q_latent: torch.Tensor) -> torch.Tensor:
        """The queries before RoPE: q latent [B, S, q_lora] → wq_b's heads [B, S, H, hd]."""
        return self.wq_b(q_latent).unflatten(-1, (self.num_heads, self.head_dim))

    def kv_latent(self, x: torch.Tensor) -> torch.Tensor:
        """The K=V latent before RoPE and rounding: kv_norm(wkv x), x [B, S, D] → [B, S, hd]."""
        return self.kv_norm(self.wkv(x))

    def window_kv(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """The K=V latent of ``x`` as the window cache holds it: kv_norm(wkv x), rotated, FP8-rounded.
        x [B, S, D], angles [B, S, P] → [B, S, hd]."""
        return fake_quant_fp8_e4m3(apply_rope(self.kv_latent(x), angles))

    def _attend_per_query(self, q: torch.Tensor, kv: torch.Tensor, state: SparseState) -> torch.Tensor:
        """``sink_attention`` with every query's keys gathered in the cached engine's layout (window
        p−w+1 … p, then ``index_topk`` selected entries, −1 padded): each query reduces over the same keys
        in the same order at any sequence length (model/batch_invariant.py). q [B, S, H, hd] → same."""
        b, s, hd = kv.shape
        pos = (
            torch.arange(s, device=kv.device).unsqueeze(-1)
            - self.window
            + 1
            + torch.arange(self.window, device=kv.device)
        )
        keys = kv[:, pos.clamp_min(0)]  # [B, S, w, hd]
        allowed = (pos >= 0).expand(b, s, self.window)
        if self.ratio:
            sel = F.pad(state.selected, (0, self.index_topk - state.selected.shape[-1]), value=-1)  # [B, S, k]
            entries = state.compressed_kv
            picked = (
                entries[torch.arange(b, device=kv.device).view(b, 1, 1), sel.clamp_min(0)]
                if entries.shape[1]
                else entries.new_zeros(b, s, self.index_topk, hd)
            )
            keys = torch.cat((keys, picked.to(keys.dtype)), dim=2)
            allowed = torch.cat((allowed, sel >= 0), dim=-1)
        out = sink_attention(
            q.flatten(0, 1).unsqueeze(1),
            keys.flatten(0, 1),
            allowed.flatten(0, 1).unsqueeze(1),
            self.attn_sink,
            self.head_dim**-0.5,
        )  # [B·S, 1, H, hd]
        return out.view(b, s, *out.shape[2:])

    def _sparse(
        self, x: torch.Tensor, positions: torch.Tensor, q_latent: torch.Tensor, state: SparseState
    ) -> SparseState:
        if self.compressor is not None:
            latent = self.compressor(x)  # [B, W, hd]
            group_angles = rope_angles(group_positions(positions, self.ratio), self.freqs)  # [B, W, P]
            # KV entries are rounded before the index keys (the reference's order; oracle tests pair the calls).
            entries = compressed_entries(latent, group_angles)
            state = SparseState(
                ratio=self.ratio, compressed_kv=entries, index_keys=self.indexer.keys(latent, group_angles)
            )
        if state.ratio != self.ratio or state.compressed_kv is None:
            raise ValueError(f"layer {self.layer} needs a preceding KV source with ratio {self.ratio}")
        if self.indexer is None:
            return state  # reuse the nearest index source's selection
        visible = visible_entries(positions, self.ratio)  # [B, S]
        scores = self.indexer.scores(x, q_latent, rope_angles(positions, self.freqs), state.index_keys, visible)
        scores, candidates = self.restrict_to_candidates(scores, visible, state.candidates)
        return dataclasses.replace(state, selected=select_entries(scores, self.index_topk), candidates=candidates)

    def restrict_to_candidates(
        self, scores: torch.Tensor, visible: torch.Tensor, candidates: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The candidate source picks this layer's candidate blocks; a layer that uses them masks its
        scores outside them. Returns (scores, candidates to carry on). Shared by the cached path."""
        if self.is_candidate_source:
            candidates = candidate_mask(
                scores, visible, num_blocks=self.candidate_topk_blocks, block_size=self.candidate_block_size
            )
        elif self.uses_candidates:
            scores = scores.masked_fill(~candidates, -torch.inf)
        return scores, candidates

    def project_out(self, out: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """Attention output [B, S, H, hd] (RoPE still applied at ``angles`` [B, S, P]) → [B, S, D]: RoPE
        undone, the grouped low-rank ``wo_a``, then ``wo_b``. Public: the engine's cached step ends with it.
        ``wo_a`` is the grouped ``nn.Linear``, or a kernel backend's replacement with the same map
        [..., G, H/G·hd] → [..., G·R] (services/worker/kernel_model/fp8_linear.py ``GroupedKernelLinear``)."""
        return self.project(apply_rope(out, angles, inverse=True))

    def project(self, out: torch.Tensor) -> torch.Tensor:
        """``project_out`` once RoPE is undone: [B, S, H, hd] → the grouped ``wo_a``, then ``wo_b``, [B, S, D]."""
        grouped = out.reshape(*out.shape[:2], self.num_groups, -1)  # [B, S, G, H/G·hd]
        if not isinstance(self.wo_a, nn.Linear):
            return self.wo_b(self.wo_a(grouped))
        w = self.wo_a.weight.view(self.num_groups, -1, grouped.shape[-1])  # [G, R, H/G·hd]
        low = torch.einsum("bsgi,gri->bsgr", grouped, w)  # [B, S, G, R]
        return self.wo_b(low.flatten(2))  # [B, S, D]


def window_mask(positions: torch.Tensor, window: int) -> torch.Tensor:
    """Bool [B, S, S]: key j visible to query i iff p_i − window < p_j ≤ p_i."""
    q = positions.unsqueeze(-1)
    k = positions.unsqueeze(-2)
    return (k <= q) & (k > q - window)


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention with K = V and one sink logit per head.

    q [B, S, H, hd]; kv [B, T, hd]; allowed [B, S, T] bool; sink [H] → [B, S, H, hd].
    The sink is a zero-valued key whose logit is ``sink[h]``: it only adds exp(sink) to the denominator.
    """
    b, s, h, _ = q.shape
    logits = torch.einsum("bshd,btd->bhst", q.float(), kv.float()) * scale  # [B, H, S, T]
    logits = logits.masked_fill(~allowed.unsqueeze(1), -torch.inf)
    sink_col = sink.float().view(1, h, 1, 1).expand(b, h, s, 1)
    probs = torch.cat((logits, sink_col), dim=-1).softmax(dim=-1)[..., :-1]  # [B, H, S, T]
    return torch.einsum("bhst,btd->bshd", probs, kv.float()).to(q.dtype)
