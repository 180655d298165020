"""Where graphs and eager part in the batch-invariant mode (GPU, the tiny model on the FP8 kernel backend).

The same 16 prompts (sampled, 5 top logprobs) through three runners on one model, each in the mode:
the static decode step replayed from CUDA graphs, the same static step run eagerly, and the eager
eager step (``TritonAttention``). Prints which pairs give ``==`` answers and the first differing prompt and position, so
a difference is placed either in the capture (graph vs static eager) or in the step's code (static
eager vs the eager step).

    python3 scripts/diagnostics/graph_invariance.py
"""

from __future__ import annotations

import json


def main() -> int:
    import torch

    from scheduler_rs import graph_sizes
    from services.engine import LLM, SamplingParams
    from services.worker.runners.decode_step_graphs import DecodeStepGraphs
    from services.worker.runners.model_runner import ModelRunner

    args = dict(
        model="tiny",
        device="cuda",
        block_size=16,
        max_num_batched_tokens=48,
        max_num_seqs=16,
        num_blocks=256,
        num_state_slots=17,
        max_model_len=256,
        batch_invariant=True,
    )
    base = LLM(**args)
    config = base.config
    fields = {f: getattr(config, f) for f in config.__dataclass_fields__}
    worker_config = config.worker_config()
    model = base.source.model

    def graphs(use_graphs: bool):
        runner = DecodeStepGraphs(
            ModelRunner(model, worker_config), worker_config, use_graphs=use_graphs, attention="triton"
        )
        if use_graphs:
            runner.capture(graph_sizes(config.max_num_seqs))
        return runner

    runners = {"graphs": graphs(True), "static_eager": graphs(False), "eager_step": ModelRunner(model, worker_config)}
    prompts = [
        torch.randint(3, 120_000, (5 + 7 * k,), generator=torch.Generator().manual_seed(k)).tolist() for k in range(16)
    ]
    params = [
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.7, logprobs=5, seed=1000 + k, ignore_eos=True)
        for k in range(16)
    ]
    answers = {}
    for name, runner in runners.items():
        outs = LLM(source=base.source, runner=runner, **{**fields, "cuda_graphs": False}).generate(prompts, params)
        answers[name] = [(o.token_ids, o.logprobs, o.top_logprobs) for o in outs]

    def first(a, b):
        for k, (x, y) in enumerate(zip(a, b)):
            if x != y:
                i = next((i for i, (p, q) in enumerate(zip(x[1], y[1])) if p != q), None)
                return {"prompt": k, "position": i, "logprob": None if i is None else [x[1][i], y[1][i]]}
        return None

    result = {
        f"{a} vs {b}": first(answers[a], answers[b])
        for a, b in (("graphs", "static_eager"), ("static_eager", "eager_step"), ("graphs", "eager_step"))
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
