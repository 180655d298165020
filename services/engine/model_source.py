"""Where the engine's model comes from: a checkpoint directory, or a preset built in memory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from model.deepseek_v41.config import ModelConfig, load_config
from model.deepseek_v41.loader import assign_weights, check_tensors, load_checkpoint
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.presets import GPU_ONLY, PRESETS, preset
from model.deepseek_v41.tokenizer import engram_token_map, load_tokenizer, load_v41_tokenizer


@dataclass
class ModelSource:
    name: str  # the preset name or checkpoint directory it came from
    config: ModelConfig
    model: DeepseekV41 | None  # None: weights not loaded here (an engine whose remote worker holds them)
    tokenizer: Tokenizer
    # What fixes the weights without reading them (weights_identity); None: only the weights themselves
    # tell (services/worker/service.py model_hashes then hashes their bytes).
    weights_id: str | None = None


def weights_identity(model: str, seed: int, load_format: str) -> str:
    """What determines a model's weights, computed from headers only: a preset or ``dummy`` by its seed,
    a checkpoint by every stored tensor's name, dtype, shape and offsets and each file's size (the
    safetensors headers). Engine and worker compare it to agree on the model without the weights' bytes."""
    import hashlib

    if model in PRESETS or load_format == "dummy":
        return f"random {model if model in PRESETS else 'dummy'} seed {seed}"
    from model.deepseek_v41.safetensors_io import checkpoint_files

    h = hashlib.sha256()
    for file in sorted(set(checkpoint_files(model).values())):
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            h.update(f"{file.name}|{file.stat().st_size}|".encode() + f.read(length))
    return f"checkpoint {h.hexdigest()}"


def load_model(
    model: str,
    seed: int = 0,
    device: str = "cpu",
    load_format: str = "auto",
    precision: str | None = None,
    weights: bool = True,
    expert_format: str = "fp8",
    engram_on_host: bool = False,
) -> ModelSource:
    """``model`` is a checkpoint directory or a preset name; a preset's weights come from ``seed``.

    On CPU (and on CUDA with ``precision`` None, the torch model) the model is built in fp32, as
    released weights dequantised. On CUDA with a kernel ``precision`` ("fp8", "fp32") it is built layer
    by layer straight into the kernel backend's form: a checkpoint through the GPU loader
    (services/worker/kernel_model/weight_loader.py), a preset or ``load_format="dummy"`` from weights drawn on the
    device (services/worker/kernel_model/gpu_model.py). ``load_format="dummy"`` reads only a directory's config and
    tokenizer. In the kernel form the routed experts are kept in ``expert_format`` ("fp4": MXFP4 as released,
    "fp8"), and with ``engram_on_host`` the Engram tables never reach the device (the worker then moves them
    into host shared memory, services/worker/state/engram_host.py)."""
    path = Path(model)
    if model not in PRESETS and not path.is_dir():
        raise ValueError(f"model {model!r} is neither a checkpoint directory nor a preset ({', '.join(PRESETS)})")
    identity = weights_identity(model, seed, load_format)
    if not weights:  # config, tokenizer and identity only: the weights live in a remote worker
        if model in PRESETS:
            return ModelSource(model, preset(model), None, load_v41_tokenizer(), identity)
        return ModelSource(str(path), load_config(path), None, load_tokenizer(path), identity)
    kernel_form = device.startswith("cuda") and precision is not None
    if model in PRESETS or load_format == "dummy":
        if model in PRESETS:
            cfg, tokenizer = preset(model), load_v41_tokenizer()
        else:
            cfg, tokenizer = load_config(path), load_tokenizer(path)
        if kernel_form:
            return _random_kernel_source(
                model,
                cfg,
                tokenizer,
                seed,
                device,
                precision,
                identity,
                expert_format,
                engram_on_host,  # type: ignore[arg-type]
            )
        if model in GPU_ONLY:
            raise ValueError(
                f"preset {model!r} is built in GPU memory only, in the kernel backend's form "
                f"(device cuda with the kernel backend); this engine runs on {device}"
            )
        from model.deepseek_v41.init import random_checkpoint

        tensors = random_checkpoint(cfg, seed)
        check_tensors(cfg, tensors)
        token_map, num_compressed = engram_token_map(tokenizer) if cfg.engram_layer_ids else (None, None)
        net = DeepseekV41(cfg, token_map, num_compressed)
        assign_weights(net, tensors)
        return ModelSource(model, cfg, net.eval().to(device), tokenizer, identity)
    if kernel_form:
        from services.worker.kernel_model.weight_loader import load_kernel_model

        net, tokenizer, _ = load_kernel_model(
            path,
            device,
            precision,
            expert_format=expert_format,
            engram_on_host=engram_on_host,  # type: ignore[arg-type]
        )
        return ModelSource(str(path), net.cfg, net, tokenizer, identity)
    loaded = load_checkpoint(path)
    return ModelSource(str(path), loaded.config, loaded.model.to(device), load_tokenizer(path), identity)


def _random_kernel_source(
    name: str,
    cfg: ModelConfig,
    tokenizer: Tokenizer,
    seed: int,
    device: str,
    precision: str,
    identity: str,
    expert_format: str,
    engram_on_host: bool,
) -> ModelSource:
    import torch

    from services.worker import startup
    from services.worker.kernel_model.gpu_model import build_random_kernel_model, num_parts

    token_map, num_compressed = engram_token_map(tokenizer) if cfg.engram_layer_ids else (None, None)
    with startup.phase("loading", total=num_parts(cfg)) as step:  # each part drawn counts
        net = build_random_kernel_model(
            cfg,
            seed,
            device,
            precision,
            None if token_map is None else torch.as_tensor(token_map),
            num_compressed,
            expert_format=expert_format,
            engram_on_host=engram_on_host,
            on_part=lambda prefix, _: step.advance(prefix.rstrip(".")),
        )
    return ModelSource(name, cfg, net, tokenizer, identity)
