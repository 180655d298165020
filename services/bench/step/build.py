"""Models and engines for `shinkai bench step`.

``subset_config`` keeps chosen layers of a config, renumbered, with their roles (compress ratio,
KV / index / candidate source, Engram) carried over. The default subset of v41-s1 keeps one layer of
every kind the 40 have, in order:

    0 window only · 1 Engram · 2 ratio-2 KV + index source · 3 ratio-2 reader · 14 ratio-2 KV source
    with Engram · 20 ratio-1 KV + candidate source · 21 ratio-1 reader · 24 ratio-1 index source that
    uses the candidates

Engram tables shrink with ``engram_vocab_size`` (a gather's cost does not depend on the table's
row count), so the eager comparison's fp32/bf16 weights fit in GPU memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.presets import GPU_ONLY, preset

KINDS_OF_V41 = (0, 1, 2, 3, 14, 20, 21, 24)
SMALL_ENGRAM_VOCAB = 40_000


def subset_config(cfg: ModelConfig, layers: Sequence[int], engram_vocab: int | None = None) -> ModelConfig:
    """The config of a model made of ``layers`` (ascending ids of ``cfg``), renumbered 0…n−1. A DSpark draft stays
    (its target layers renumbered) where the subset keeps every layer it taps; otherwise the subset has none."""
    from model.deepseek_v41.engram import engram_primes

    layers = list(layers)
    if layers != sorted(set(layers)) or not 0 <= layers[0] or layers[-1] >= cfg.num_hidden_layers:
        raise ValueError(f"layers {layers} must be distinct ascending ids below {cfg.num_hidden_layers}")
    new = {old: i for i, old in enumerate(layers)}
    draft = bool(cfg.num_nextn_predict_layers) and all(t in new for t in cfg.dspark_target_layer_ids)
    extra = cfg.compress_ratios[cfg.num_hidden_layers :]  # entries past the backbone (nextn layers)
    engram_ids = [new[layer] for layer in cfg.engram_layer_ids if layer in new]
    out = dataclasses.replace(
        cfg,
        num_hidden_layers=len(layers),
        compress_ratios=tuple(cfg.ratio(layer) for layer in layers) + tuple(extra),
        kv_source_layer_ids=tuple(new[x] for x in cfg.kv_source_layer_ids if x in new),
        index_source_layer_ids=tuple(new[x] for x in cfg.index_source_layer_ids if x in new),
        candidate_source_layer_id=new.get(cfg.candidate_source_layer_id)
        if cfg.candidate_source_layer_id is not None
        else None,
        engram_layer_ids=tuple(engram_ids),
        num_nextn_predict_layers=cfg.num_nextn_predict_layers if draft else 0,
        dspark_target_layer_ids=tuple(new[t] for t in cfg.dspark_target_layer_ids)
        if draft
        else cfg.dspark_target_layer_ids,
        engram_num_embeddings=tuple(
            n for layer, n in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings) if layer in new
        ),
    )
    if engram_vocab is not None and engram_ids:
        shrunk = dataclasses.replace(out, engram_vocab_size=engram_vocab)
        rows = tuple(sum(p) for p in engram_primes(shrunk))
        out = dataclasses.replace(shrunk, engram_num_embeddings=rows)
    return out


def full_depth(model: str) -> int:
    return preset(model).num_hidden_layers


def model_config(model: str, layers: int | None) -> ModelConfig:
    cfg = preset(model)
    if layers is None:
        return cfg
    if model == "v41-s1" and layers == len(KINDS_OF_V41):
        return subset_config(cfg, KINDS_OF_V41, SMALL_ENGRAM_VOCAB)
    return subset_config(cfg, range(layers), SMALL_ENGRAM_VOCAB if cfg.engram_layer_ids and model in GPU_ONLY else None)


def builder(
    model: str, device, backend: str, layers: int | None, graphs: bool = False, expert_format: str = "fp4"
) -> tuple[Callable[..., Any], ModelConfig, int]:
    """(build(**engine_args) → LLM on one shared model, its config, the preset's full depth). With
    ``graphs`` (the kernel backend on CUDA) decode steps replay captured CUDA graphs, as
    ``EngineConfig.cuda_graphs`` makes the engine do. ``expert_format``: the kernel backend's routed experts
    (``EngineConfig.expert_format``)."""
    from services.engine import LLM

    cfg = model_config(model, layers)
    if backend == "kernels" and model in GPU_ONLY:
        source = load_kernel_source(model, cfg, device, expert_format)  # never whole in fp32
    else:
        source = load_source(model, cfg, device, backend)

    def build(expert_parallel: Any = None, **engine_args: Any) -> LLM:
        """``expert_parallel``: the runner's ``ExpertParallel`` (services/bench/step/ep_path.py), None: without."""
        from services.worker.runners.model_runner import ModelRunner

        # Step benchmarks time cold steps: no prefix cache (its snapshot cuts would split the profiled prompt).
        config_args = {"block_size": 128, "expert_format": expert_format, "enable_prefix_caching": False, **engine_args}
        from services.engine.config import EngineConfig

        config = EngineConfig(**config_args).worker_config()
        runner: Any = ModelRunner(source.model, config, expert_parallel=expert_parallel, **_runner_args(backend))
        if graphs:
            from services.worker.runners.decode_step_graphs import DecodeStepGraphs

            runner = DecodeStepGraphs(runner, config, use_graphs=True, attention="triton")
        return LLM(source=source, runner=runner, **config_args)

    return build, cfg, full_depth(model)


def runner_cache(llm: Any):
    """The pools of an LLM's runner, through a DecodeStepGraphs if there is one."""
    runner = llm.engine.worker.runner
    return runner.cache if hasattr(runner, "cache") else runner.runner.cache


def _runner_args(backend: str) -> dict[str, Any]:
    return {} if backend == "torch" else {"backend": backend}


def load_source(model: str, cfg: ModelConfig, device, backend: str):
    """The model for ``cfg``: random weights from seed 0, on ``device``."""
    import torch

    from model.deepseek_v41.init import random_checkpoint
    from model.deepseek_v41.loader import assign_weights, check_tensors
    from model.deepseek_v41.model import DeepseekV41
    from model.deepseek_v41.tokenizer import engram_token_map, load_v41_tokenizer
    from services.engine.model_source import ModelSource

    tokenizer = load_v41_tokenizer()
    token_map, num_compressed = engram_token_map(tokenizer) if cfg.engram_layer_ids else (None, None)
    if model in GPU_ONLY and torch.device(device).type != "cuda":
        raise ValueError(f"preset {model!r} is built in GPU memory only")
    tensors = random_checkpoint(cfg, 0) if model not in GPU_ONLY else _device_tensors(cfg, device)
    check_tensors(cfg, tensors)
    with torch.device(device):  # parameters are made where they live: 8 v41-s1 layers are ~60 GB in fp32
        net = DeepseekV41(cfg, token_map, num_compressed)
    assign_weights(net, tensors)
    net.to(device)  # the Engram hasher's buffers are made on the CPU whatever the default device
    return ModelSource(model, cfg, net.eval(), tokenizer)


def load_kernel_source(model: str, cfg: ModelConfig, device, expert_format: str = "fp4"):
    """The model for ``cfg`` built layer by layer straight into the kernel backend's FP8 form, routed experts
    in ``expert_format``."""
    import torch

    from model.deepseek_v41.tokenizer import engram_token_map, load_v41_tokenizer
    from services.engine.model_source import ModelSource
    from services.worker.kernel_model.gpu_model import build_random_kernel_model

    tokenizer = load_v41_tokenizer()
    token_map, num_compressed = engram_token_map(tokenizer) if cfg.engram_layer_ids else (None, None)
    net = build_random_kernel_model(
        cfg,
        0,
        device,
        "fp8",
        None if token_map is None else torch.as_tensor(token_map),
        num_compressed,
        expert_format=expert_format,
    )
    return ModelSource(model, cfg, net, tokenizer)


def _device_tensors(cfg: ModelConfig, device) -> dict:
    from model.deepseek_v41.init import random_stored_on_device

    out: dict = {}
    for entry in random_stored_on_device(cfg, 0, device):
        out.update(entry)
    return out
