"""NeMo AutoModel 0.7.0's DSpark module as the draft's oracle, with the backbone harness's ideas
(oracle_harness.py): both sides' FP8 roundings and MoE selections are recorded and paired in order;
ours replays NeMo's decision only at elements within FLIP_BOUNDARY_TOL of a rounding boundary (a
traced flip, counted); any other rounding or selection difference fails, and so does an oracle
selection whose k-th and (k+1)-th scores are a near tie (reseed the case).

The draft is fed NeMo's own target features (the taps, captured at NeMo's attention-mixer inputs and
checked against ours separately), so the draft comparison does not inherit backbone noise.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tests import tolerances as tol
from tests.model.deepseek_v41.oracle_harness import QuantCall, Recording, record_ours

BACKEND = dict(
    attn="eager",
    linear="torch",
    rms_norm="torch_fp32",
    rope="torch",
    experts="torch",
    dispatcher="torch",
    enable_hf_state_dict_adapter=True,
    gate_precision="float32",
)


def nemo_draft(ckpt: Path):
    """NeMo's DeepseekV41DSparkModel with ``embed``, ``head`` and ``mtp.*`` loaded (strictly) from our checkpoint."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel
    from safetensors.torch import load_file

    text = DeepseekV41Config(**json.loads((ckpt / "config.json").read_text())).text_config
    model = DeepseekV41DSparkModel(text, BackendConfig(**BACKEND), num_anchors=1, enable_confidence_head=True).eval()
    native = model.state_dict_adapter.from_hf(load_file(str(ckpt / "model.safetensors")))
    model.load_state_dict(native, strict=True)
    return model


def nemo_taps(nemo_backbone, ids: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """NeMo's target features: the streams entering each tapped layer's attention mixer, averaged over
    streams (as its DSpark target wrapper does), concatenated: [B, S, T·D]."""
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        nemo_backbone.model.layers[str(i)].attn_hc.register_forward_pre_hook(
            lambda module, args, i=i: captured.__setitem__(i, args[0].float().mean(dim=2))
        )
        for i in layer_ids
    ]
    try:
        nemo_backbone(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat([captured[i] for i in layer_ids], dim=-1)


@dataclass
class NemoDraft:
    streams: list[torch.Tensor]  # per stage [B, A·bs, n, D]
    hidden: torch.Tensor  # pre-norm collapse [B, A·bs, D]
    logits: torch.Tensor  # fp32 [B, A·bs, V]
    confidence_logits: torch.Tensor  # from the pre-norm h (the released model's input) [B, A·bs]
    confidence_logits_normed: torch.Tensor  # NeMo's own choice (normed h), only to show the two differ


def run_nemo_draft(
    model, ids: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor, prev: torch.Tensor
) -> NemoDraft:
    """NeMo's draft backbone and heads at the given anchors [B, A]; ``prev`` [B, A·bs] each slot's previous token."""
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkBackbone
    from nemo_automodel.components.speculative.dspark.common import create_noise_embed

    cfg = model.config
    keep = torch.ones_like(anchors, dtype=torch.bool)
    noise = create_noise_embed(
        model.embed_tokens,
        ids,
        anchors,
        keep,
        mask_token_id=cfg.dspark_noise_token_id,
        block_size=cfg.dspark_block_size,
    )
    streams: list[torch.Tensor] = []
    prenorm: list[torch.Tensor] = []
    hooks = [stage.register_forward_hook(lambda m, a, out: streams.append(out.streams)) for stage in model.mtp]
    hooks.append(model.mtp[-1].norm.register_forward_pre_hook(lambda m, args: prenorm.append(args[0])))
    try:
        out = DeepseekV41DSparkBackbone.forward(
            model,
            noise,
            taps,
            position_ids=model.build_position_ids(anchors, ids.shape[1]),
            attention_mask=model.build_attention_mask(anchors, keep, ids.shape[1], noise.dtype),
            previous_token_ids=prev,
        )
    finally:
        for hook in hooks:
            hook.remove()
    logits = model.compute_logits(out.normalized_hidden_states) + out.transition_logits.float()
    markov = model.mtp[-1].markov_head.embed(prev)
    conf = model.mtp[-1].confidence_head(prenorm[0], markov)
    return NemoDraft(streams, prenorm[0], logits, conf, out.confidence_pred)


@contextlib.contextmanager
def record_nemo_draft():
    """Record the FP8 roundings of NeMo's draft attention and every top-k (its MoE gates)."""
    import nemo_automodel.components.models.deepseek_v41.dspark as nemo_dspark

    rec = Recording()
    original_quant, original_topk = nemo_dspark.quantize_cache, torch.Tensor.topk

    def quantize_cache(values, *, format, block_size):
        out = original_quant(values, format=format, block_size=block_size)
        rec.quant.append(QuantCall("fp8", values.detach().clone(), out.detach().clone()))
        return out

    def topk(self, k, *args, **kwargs):
        result = original_topk(self, k, *args, **kwargs)
        rec.topk.append((self.detach().clone(), int(k), result.indices.clone()))
        return result

    nemo_dspark.quantize_cache = quantize_cache
    torch.Tensor.topk = topk
    try:
        yield rec
    finally:
        nemo_dspark.quantize_cache = original_quant
        torch.Tensor.topk = original_topk


def check_pairing(ours: Recording, nemo: Recording) -> tuple[int, float]:
    """Every rounding equal once traced flips are replayed, every selection equal, no oracle near tie.
    Returns (replayed flips, smallest oracle top-k margin)."""
    assert [c.kind for c in ours.quant] == [c.kind for c in nemo.quant], "rounding call sequences differ"
    for i, (o, n) in enumerate(zip(ours.quant, nemo.quant)):
        assert o.after.shape == n.after.shape, f"rounding call {i}: {tuple(o.after.shape)} vs {tuple(n.after.shape)}"
        bad = int((o.after != n.after).sum())
        assert bad == 0, f"rounding call {i}: {bad} elements differ away from a rounding boundary (untraced)"
    assert len(ours.topk) == len(nemo.topk), f"{len(ours.topk)} selections in ours vs {len(nemo.topk)} in NeMo"
    smallest = float("inf")
    for i, ((ov, _, op), (nv, k, np_)) in enumerate(zip(ours.topk, nemo.topk)):
        top = nv.float().sort(dim=-1, descending=True).values
        gap = float((top[..., k - 1] - top[..., k]).min()) if nv.shape[-1] > k else float("inf")
        smallest = min(smallest, gap)
        assert gap >= tol.TOPK_MARGIN_MIN, f"selection {i}: oracle near tie (gap {gap:.3g}): reseed the case"
        assert torch.equal(op.reshape(-1, k).sort(-1).values, np_.reshape(-1, k).sort(-1).values), (
            f"selection {i}: different experts without a near tie"
        )
    return sum(ours.replayed), smallest


def run_ours_draft(
    model, taps: torch.Tensor, anchors: torch.Tensor, anchor_tokens: torch.Tensor, prev: torch.Tensor, replay: Recording
):
    """Our draft (full-sequence) on the same taps, replaying NeMo's near-boundary roundings."""
    with record_ours(replay=replay) as rec:
        blocks = model.draft(taps, anchor_tokens, anchors, model.embed, model.head)
        heads = model.draft.heads(blocks, prev.view(*anchors.shape, -1))
    return blocks, heads, rec
