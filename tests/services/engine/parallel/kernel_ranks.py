"""Shared by the kernel-backend rank tests: a three-layer tiny model (a sliding-window layer, the Engram layer
and a compressed one; no draft), the same with a one-stage DSpark draft tapping all three layers (its backbone
weights are the draft-less model's: the draft's tensors come last in the init order), and the kernel set they
run, the MoE's kernels interpreted (``--kernels interpreted``'s).

They are module-level so that spawned rank processes can import them (``RankSpec.load`` and ``.kernels``).
"""

from __future__ import annotations

import dataclasses
from functools import partial

from model.deepseek_v41.init import first_layers, random_checkpoint
from model.deepseek_v41.loader import assign_weights
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.presets import preset
from model.deepseek_v41.tokenizer import engram_token_map, load_v41_tokenizer
from services.engine.model_source import ModelSource
from services.worker.kernel_model.interpreted_kernels import step_kernels

NUM_LAYERS = 3


def three_layer_tiny(device: str) -> ModelSource:
    return _source(first_layers(preset("tiny"), NUM_LAYERS), device)


def three_layer_tiny_with_draft(device: str) -> ModelSource:
    """``three_layer_tiny`` with one DSpark stage tapping its three layers (tiny's own draft taps layers 5-7, so it
    needs all eight layers and three stages, minutes a run under the interpreter)."""
    cfg = first_layers(preset("tiny"), NUM_LAYERS)
    return _source(dataclasses.replace(cfg, num_nextn_predict_layers=1, dspark_target_layer_ids=(0, 1, 2)), device)


def _source(cfg, device: str) -> ModelSource:
    tokenizer = load_v41_tokenizer()
    token_map, num_compressed = engram_token_map(tokenizer) if cfg.engram_layer_ids else (None, None)
    net = DeepseekV41(cfg, token_map, num_compressed)
    assign_weights(net, random_checkpoint(cfg, 0))
    name = "tiny-3-draft" if cfg.num_nextn_predict_layers else "tiny-3"
    return ModelSource(name, cfg, net.eval().to(device), tokenizer, None)


moe_kernels = partial(step_kernels, batch_invariant=True)
"""The kernel set of ``--kernels interpreted`` (services/worker/kernel_model/interpreted_kernels.py) with the CPU's
batch-invariant torch maths for the parts that stay torch."""
