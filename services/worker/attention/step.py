"""One step's attention, layer by layer, over the paged caches: the one flow every runner uses.

Per attention layer, for the step's R rows (every row its own query, shape [R, ...]):

1. project: q = wq_b(q_norm(wq_a x)) and the shared K = V latent k = kv_norm(wkv x), RoPE on both at
   the rows' positions; k goes through the rounding hook ("fp8") before anything stores it;
2. compress (a KV source): this step's complete groups into the layer's pool (``backend.compress``);
3. index-select (a compressed layer): an index source picks each row's entries, other compressed
   layers keep the nearest selection (``backend.select``);
4. attend: K into the window rings, then each row over its window and its entries, with the sink
   (``backend.attend``);
5. project out: the model's ``Attention.project_out`` (undo RoPE, grouped ``wo_a``, ``wo_b``), or the
   kernel backend's converted ``wo_a`` / ``wo_b`` on the RoPE-undone output.

The backend (services/worker/attention/backend.py) decides how 2–4 run and what order its ring reads
and writes need; this class is the same for the torch reference, the Triton kernels and the
graph-safe decode form, so a change to the layer's flow is made once.
"""

from __future__ import annotations

import torch
from torch import nn

from model.deepseek_v41.attention import Attention
from model.deepseek_v41.rope import apply_rope, apply_rope_, rope_angles, rope_turns
from services.worker.attention.backend import AttentionBackend, StepRounding
from services.worker.kernel_model.moe import KernelRMSNorm


class AttentionStep:
    def __init__(
        self,
        backend: AttentionBackend,
        positions: torch.Tensor,
        row_requests: torch.Tensor,
        rounding: StepRounding | None = None,
    ) -> None:
        self.backend = backend
        self.positions = positions  # [R] each row's position
        self.row_requests = row_requests  # [R] each row's request (index into the step's requests)
        self.rounding = rounding or StepRounding()
        # Attention.rope_key → the rows' RoPE turns complex [R, P], computed by the first layer of that
        # frequency set (they depend on the positions and freqs only). Valid for one step: ``reset`` forgets
        # them when the positions change.
        self._turns: dict[bool, torch.Tensor] = {}

    def reset(self) -> None:
        """A new step (a static step reuses one AttentionStep over refilled position buffers)."""
        self._turns = {}

    def attend(self, attn: Attention, x: torch.Tensor) -> torch.Tensor:
        """x [R, D] (attn_norm output) → [R, D]."""
        angles = self._turns.get(attn.rope_key)  # [R, P] complex: the turns stand in for the angles
        if angles is None:
            angles = self._turns[attn.rope_key] = rope_turns(rope_angles(self.positions, attn.freqs))
        q_latent = attn.query_latent(x)  # [R, q_lora]
        q = attn.wq_b(q_latent).unflatten(-1, (attn.num_heads, attn.head_dim))  # [R, H, hd]: its own tensor
        kv = attn.wkv(x)  # [R, hd]
        if isinstance(attn.kv_norm, KernelRMSNorm) and attn.kv_norm.rope_fits(kv, angles, q):
            k = attn.kv_norm.forward_rope(kv, angles, q)  # kv_norm and both RoPEs (q's in place): one launch
        else:
            q, k = apply_rope_(q, angles), apply_rope_(attn.kv_norm(kv), angles)
        k = self.rounding("fp8", attn.layer, k, self.row_requests, self.positions)  # [R, hd]
        if attn.ratio:
            if attn.compressor is not None:
                self.backend.compress(attn, x)
            self.backend.select(attn, x, q_latent, angles)
        out = self.backend.attend(attn, q, k)  # [R, H, hd]
        return self.project_out(attn, out, angles)

    def project_out(self, attn: Attention, out: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """out [R, H, hd] (RoPE undone iff the backend ``undoes_rope``), angles [R, P] (fp32, or
        their turns: ``rope_turns``) → [R, D]."""
        if isinstance(attn.wo_a, nn.Linear):  # the model's projection (angle 0 where RoPE is already undone)
            # Angle 0 where RoPE is undone; as turns, polar(1, 0) = 1 + 0i exactly, what the model makes of 0.
            none = torch.ones_like if angles.is_complex() else torch.zeros_like
            rotated = none(angles) if self.backend.undoes_rope else angles
            return attn.project_out(out.unsqueeze(1), rotated.unsqueeze(1))[:, 0]
        if not self.backend.undoes_rope:
            out = apply_rope(out, angles, inverse=True)
        return attn.wo_b(attn.wo_a(out.reshape(out.shape[0], attn.num_groups, -1)))  # the kernel backend's
