"""The same decode step three ways, on one model and the same plans:

1. eager: the model's own PyTorch modules (the torch backend's cached runner), fp32 weights;
2. compiled: the same, with every layer's modules around attention (``torch.compile`` of the MoE,
   the hyper-connection mixes, the norms, Engram) and the attention's projections compiled;
3. engine: the kernel backend (FP8 weights, Triton kernels) on the same model, converted in place,
   its decode steps replaying CUDA graphs on a GPU, as the engine serves.

v41-s1's 40 fp32 layers do not fit in GPU memory, so the comparison runs on the 8-layer subset with
one layer of every kind (``step_build.KINDS_OF_V41``) and also reports times scaled to 40 layers.
"""

from __future__ import annotations

from typing import Any

COMPILED_CHILDREN = ("ffn", "hc_attn", "hc_ffn", "attn_norm", "ffn_norm", "engram")
COMPILED_ATTENTION = ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_b")


def _compile_layers(model) -> list:
    import torch

    done = []
    for block in model.layers:
        modules = [getattr(block, n) for n in COMPILED_CHILDREN if getattr(block, n, None) is not None]
        modules += [getattr(block.attn, n) for n in COMPILED_ATTENTION]
        for m in modules:
            m.forward = torch.compile(m.forward, dynamic=True)  # an instance attribute: `del` restores it
            done.append(m)
    return done


def _uncompile(modules: list) -> None:
    for m in modules:
        del m.forward


def compare(model: str, device, layers: int | None, sizes: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    from services.bench.step.build import KINDS_OF_V41, full_depth, load_source, model_config
    from services.bench.step.timing import decode_model_len, time_decode
    from services.engine import LLM
    from services.engine.config import EngineConfig
    from services.worker.runners.model_runner import ModelRunner

    if layers is None and model == "v41-s1":
        layers = len(KINDS_OF_V41)
    cfg = model_config(model, layers)
    source = load_source(model, cfg, device, "torch")
    context = sizes["contexts"][0]
    batches = sizes.get("compare_batches", (1, 64) if device.type == "cuda" else (1, 4))
    scale = full_depth(model) / cfg.num_hidden_layers

    def run(label: str, batch: int, **runner_args: Any) -> dict[str, Any]:
        args = {
            "block_size": 128,
            "max_num_seqs": batch,
            "max_model_len": decode_model_len(batch, context, sizes["steps"]),
        }
        config = EngineConfig(**args).worker_config()
        runner = ModelRunner(source.model, config, **runner_args)
        cache = runner.cache
        if label == "engine" and device.type == "cuda":  # the engine as it serves: decode replays CUDA graphs
            from services.worker.runners.decode_step_graphs import DecodeStepGraphs

            runner = DecodeStepGraphs(runner, config, use_graphs=True, attention="triton")
        llm = LLM(source=source, runner=runner, **args)
        t = time_decode(
            llm.engine, cache, batch=batch, context=context, steps=sizes["steps"], vocab_size=cfg.vocab_size
        )
        print(
            f"three ways  {label:9} batch {batch:>4}: {t.median * 1e3:9.2f} ms "
            f"({t.median * 1e3 * scale:.1f} ms scaled to {full_depth(model)} layers)"
        )
        return {
            "section": "three ways",
            "way": label,
            "batch": batch,
            "context": context,
            "layers": cfg.num_hidden_layers,
            "ms": t.median * 1e3,
            "ms_full_depth": t.median * 1e3 * scale,
        }

    rows = [run("eager", b) for b in batches]
    compiled = _compile_layers(source.model)
    try:
        rows += [run("compiled", b) for b in batches]
    finally:
        _uncompile(compiled)
        torch._dynamo.reset()
    if device.type == "cuda":
        rows += [run("engine", b, backend="kernels") for b in batches]  # converts the model in place
    by = {(r["way"], r["batch"]): r["ms"] for r in rows}
    for b in batches:
        if ("engine", b) in by:
            ratio = {
                "section": "three ways ratio",
                "batch": b,
                "eager_over_engine": by[("eager", b)] / by[("engine", b)],
                "compiled_over_engine": by[("compiled", b)] / by[("engine", b)],
            }
            rows.append(ratio)
            print(
                f"three ways  batch {b:>4}: engine is {ratio['eager_over_engine']:.2f}× eager, "
                f"{ratio['compiled_over_engine']:.2f}× compiled"
            )
    return rows
