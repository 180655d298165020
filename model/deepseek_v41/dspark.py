"""DSpark draft (spec §3.12; checkpoint ``mtp.0..``): K stages propose a block of ``bs`` tokens at once.

    taps    = concat_t mean_streams(h entering target layer t's attention mixer)   [B, C, T·D]
    ctx     = main_norm(main_proj(taps))                        context vector per target position [B, C, D]
    block   = [anchor token, noise, …, noise] at positions anchor … anchor+bs−1   (anchor = the last sampled
              target token, whose position has no target row yet)
    h = n copies of embed(block) [.., n, D]; pre = one-hot(stream 0)
    for stage k (a ratio-0 backbone layer with its own MoE; Block.run):
        ctx_kv_k = fp8(rope(kv_norm_k(wkv_k ctx)))               the stage's context K=V, at context positions
        attention: a block query sees ctx_kv_k at [anchor−W, anchor−1] and all bs slots of its own block
                   (bidirectional), through the stage's own wq/wkv/sink/wo and the main rope
    hidden   = Collapse(h, pre)                                  pre-norm h [.., D] (learned collapse)
    logits_j = head(norm(hidden_j)) + markov_head(markov_embed(prev_j))   prev_0 = anchor, prev_j = draft_{j−1}
    conf_j   = σ(confidence_proj([hidden_j ; markov_embed(prev_j)]))     (pre-norm h, as released)

Slot j predicts the token at anchor + j + 1. The stages do not read ``prev``, so one backbone pass
serves the whole block and only the Markov bias and the confidence are sequential ("semi-AR").

Two ways in: ``forward`` (full sequence: every context position, any number of anchors per row, as
NeMo's training module) and ``DraftContext`` (the draft's own K=V state: the last W context entries
per stage, appended as the target accepts tokens), which ``blocks_from_context`` reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.deepseek_v41.block import Block
from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.draft_attention import DraftAttention
from model.deepseek_v41.mhc import collapse, initial_pre
from model.deepseek_v41.norm import RMSNorm
from model.deepseek_v41.rope import rope_angles, rope_turns


@dataclass(frozen=True)
class DraftBlocks:
    """The stages' output for A blocks per row, before the Markov bias."""

    streams: list[torch.Tensor]  # per stage: its output streams [B, A, bs, n, D]
    hidden: torch.Tensor  # pre-norm collapse after the last stage [B, A, bs, D]
    logits: torch.Tensor  # head(norm(hidden)), fp32 [B, A, bs, V]


@dataclass(frozen=True)
class DraftHeads:
    """Per-slot outputs once each slot's previous token is known."""

    logits: torch.Tensor  # draft logits with the Markov bias, fp32 [B, A, bs, V]
    confidence_logits: torch.Tensor  # fp32 [B, A, bs]; σ of it is the confidence


class DSpark(nn.Module):
    """The draft's own weights; the token embedding and the head are the target's (passed in)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, rank = cfg.hidden_size, cfg.dspark_markov_rank
        self.cfg = cfg
        self.block_size = cfg.dspark_block_size
        self.noise_token_id = cfg.dspark_noise_token_id
        self.window = cfg.sliding_window
        stage_cfg = dataclasses.replace(
            cfg, n_routed_experts=cfg.dspark_n_routed_experts, num_experts_per_tok=cfg.dspark_num_experts_per_tok
        )
        self.main_proj = nn.Linear(d * len(cfg.dspark_target_layer_ids), d, bias=False)
        self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.stages = nn.ModuleList(
            Block(stage_cfg, cfg.num_hidden_layers + k) for k in range(cfg.num_nextn_predict_layers)
        )
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.markov_embed = nn.Embedding(cfg.vocab_size, rank)
        self.markov_head = nn.Linear(rank, cfg.vocab_size, bias=False)
        self.confidence_proj = nn.Linear(d + rank, 1, bias=False)
        self.block_attention = DraftAttention()  # no weights; a kernel backend swaps it

    # ---- context ---------------------------------------------------------------------------------

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """Target features [B, C, T·D] → context vectors [B, C, D]."""
        return self.main_norm(self.main_proj(taps))

    def context_kv(self, stage: int, ctx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Stage ``stage``'s context K=V: ctx [B, C, D] at positions [B, C] → [B, C, hd] (rotated, FP8)."""
        attn = self.stages[stage].attn
        return attn.window_kv(ctx, rope_angles(positions, attn.freqs))

    # ---- the stages ------------------------------------------------------------------------------

    def forward(
        self,
        taps: torch.Tensor,
        anchor_tokens: torch.Tensor,
        anchor_positions: torch.Tensor,
        embed: nn.Embedding,
        head: nn.Module,
    ) -> DraftBlocks:
        """Full sequence: taps [B, C, T·D] at positions 0..C−1; A anchors per row (tokens and positions
        int [B, A], each position ≤ C). A block sees the context window [anchor−W, anchor−1]."""
        b, c, _ = taps.shape
        ctx = self.context(taps)  # [B, C, D]
        positions = torch.arange(c, device=taps.device).expand(b, c)
        window = anchor_positions.unsqueeze(-1) - self.window + torch.arange(self.window, device=taps.device)
        rows = torch.arange(b, device=taps.device).view(b, 1, 1)

        def stage_window(k: int) -> torch.Tensor:  # the context K=V of every position, gathered per block
            return self.context_kv(k, ctx, positions)[rows, window.clamp_min(0)]  # [B, A, W, hd]

        return self._run(stage_window, window >= 0, anchor_tokens, anchor_positions, embed, head)

    def blocks_from_context(
        self, context: DraftContext, anchor_tokens: torch.Tensor, embed: nn.Embedding, head: nn.Module
    ) -> DraftBlocks:
        """One block per row from the draft's K=V state: anchor tokens int [B] at ``context.next_position``."""
        return self._run(
            lambda k: context.kv[k].unsqueeze(1),
            context.positions.unsqueeze(1) >= 0,
            anchor_tokens.unsqueeze(1),
            context.next_position.unsqueeze(1),
            embed,
            head,
        )

    def _run(
        self,
        stage_window: Callable[[int], torch.Tensor],
        visible: torch.Tensor,
        anchor_tokens: torch.Tensor,
        anchor_positions: torch.Tensor,
        embed: nn.Embedding,
        head: nn.Module,
    ) -> DraftBlocks:
        """stage_window(k) → stage k's context K=V of each block's window, oldest first [B, A, W, hd];
        visible bool [B, A, W] (False: before position 0); anchors int [B, A]. Every block attends over
        the same key layout (its W window slots, then its bs own slots) whichever way in, so the cached
        and full-sequence drafts reduce in the same order."""
        b, a = anchor_tokens.shape
        bs, n = self.block_size, self.cfg.hc_mult
        ids = torch.full((b, a, bs), self.noise_token_id, dtype=anchor_tokens.dtype, device=anchor_tokens.device)
        ids[..., 0] = anchor_tokens
        ids = ids.flatten(1)  # [B, T = A·bs]
        block_positions = (anchor_positions.unsqueeze(-1) + torch.arange(bs, device=ids.device)).flatten(1)  # [B, T]
        h = embed(ids).unsqueeze(2).expand(-1, -1, n, -1)  # [B, T, n, D]
        pre = initial_pre(ids.shape, n, ids.device)
        streams = []
        turns_of: dict[bool, torch.Tensor] = {}  # per RoPE frequency set: the block's turns, computed once
        for k, stage in enumerate(self.stages):
            attn = stage.attn
            if attn.rope_key not in turns_of:  # same bits as passing the angles (rope_turns)
                turns_of[attn.rope_key] = rope_turns(rope_angles(block_positions, attn.freqs))  # [B, T, P]

            def attend(x: torch.Tensor, attn=attn, k=k) -> torch.Tensor:  # x [B, T, D] → [B, T, D]
                window = stage_window(k)  # context first: the reference's rounding order
                return self.block_attention(attn, x, turns_of[attn.rope_key], window, visible)

            h, pre = stage.run(h, pre, attend, None, None)
            streams.append(h.unflatten(1, (a, bs)))
        hidden = collapse(h, pre)  # [B, T, D]
        # The target's head as a module: the model's fp32 nn.Linear (the same bits as F.linear on its fp32 weight),
        # or the kernel backend's (its bf16 weight read as is: a `.float()` of it would copy 2.6 GB at v41 widths).
        logits = head(self.norm(hidden).float())  # [B, T, V] fp32
        return DraftBlocks(streams, hidden.unflatten(1, (a, bs)), logits.unflatten(1, (a, bs)))

    # ---- heads -----------------------------------------------------------------------------------

    def heads(self, blocks: DraftBlocks, prev_ids: torch.Tensor) -> DraftHeads:
        """prev_ids int [B, A, bs]: the token before each slot (anchor, then the drafts or given tokens)."""
        emb = self.markov_embed(prev_ids)  # [B, A, bs, r]
        return DraftHeads(self.markov_logits(blocks.logits, emb), self.confidence_logits(blocks.hidden, emb))

    def markov_logits(self, logits: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """The slots' logits fp32 [..., V] plus the Markov bias of their previous tokens' ``markov_embed``."""
        return logits + self.markov_head(emb).float()

    def confidence_logits(self, hidden: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """fp32 [...] from the slots' hidden states [..., D] and previous tokens' ``markov_embed`` [..., r]."""
        return F.linear(torch.cat((hidden.float(), emb.float()), dim=-1), self.confidence_proj.weight.float()).squeeze(
            -1
        )

    def propose(
        self,
        blocks: DraftBlocks,
        anchor_tokens: torch.Tensor,
        choose: Callable[[torch.Tensor, int], torch.Tensor],
        num_slots: int | None = None,
    ) -> tuple[torch.Tensor, DraftHeads]:
        """Semi-AR drafting of the first ``num_slots`` slots (None: all bs): ``choose(logits fp32 [B, A, V],
        slot) → tokens [B, A]`` (argmax, or a sampler keyed by position). anchor_tokens [B, A] → (drafts
        [B, A, num_slots], heads with each slot's prev = the previous draft). A slot reads only the slots
        before it, so the first slots do not depend on how many are drafted. Only the Markov logits chain
        through the slots; the confidences, which no slot reads, are one product over every slot after the
        loop (``heads``' per-row values: equal to slot by slot in the batch-invariant mode)."""
        prev = anchor_tokens
        num = self.block_size if num_slots is None else num_slots
        drafts, logits, embs = [], [], []
        for j in range(num):
            emb = self.markov_embed(prev.unsqueeze(-1))  # [B, A, 1, r]
            slot_logits = self.markov_logits(blocks.logits[:, :, j : j + 1], emb)  # [B, A, 1, V]
            prev = choose(slot_logits[:, :, 0], j)
            drafts.append(prev)
            logits.append(slot_logits)
            embs.append(emb)
        conf = self.confidence_logits(blocks.hidden[:, :, :num], torch.cat(embs, dim=2))
        return torch.stack(drafts, dim=-1), DraftHeads(torch.cat(logits, dim=2), conf)


@dataclass
class DraftContext:
    """The draft's own context K=V state for B rows: the last W (= sliding_window) context entries of
    every stage, oldest first. Invariant: row b holds the entries at positions
    ``next_position[b] − W … next_position[b] − 1`` that exist (−1 marks an empty slot, left-padded), so a
    block anchored at ``next_position`` sees exactly its window."""

    kv: list[torch.Tensor]  # per stage [B, W, hd]
    positions: torch.Tensor  # int64 [B, W]; −1 = empty
    next_position: torch.Tensor  # int64 [B]: the position the next entry (and the next anchor) takes

    @classmethod
    def empty(cls, draft: DSpark, batch: int, device: torch.device | str = "cpu") -> DraftContext:
        w, hd = draft.window, draft.cfg.head_dim
        return cls(
            [torch.zeros(batch, w, hd, device=device) for _ in draft.stages],
            torch.full((batch, w), -1, dtype=torch.long, device=device),
            torch.zeros(batch, dtype=torch.long, device=device),
        )

    def append(self, draft: DSpark, taps: torch.Tensor) -> None:
        """Add the target features of the next N positions of every row: taps [B, N, T·D], rows accepted by
        the target only (a rejected draft's row never enters the context)."""
        b, num, _ = taps.shape
        positions = self.next_position.unsqueeze(1) + torch.arange(num, device=taps.device)  # [B, N]
        ctx = draft.context(taps)
        w = self.positions.shape[1]
        for k in range(len(self.kv)):
            self.kv[k] = torch.cat((self.kv[k], draft.context_kv(k, ctx, positions)), dim=1)[:, -w:]
        self.positions = torch.cat((self.positions, positions), dim=1)[:, -w:]
        self.next_position = self.next_position + num
