"""The expert-parallel kernel layer inside the engine's decode graphs, on one GPU (``gpu``-marked): a one-rank NCCL
group (``all_to_all_single`` to itself, captured) runs the path a rank of a group runs, and in the
batch-invariant mode its tokens and logprobs equal the engine without it with ``==``; decode steps replay graphs,
and a placeholder step (a rank with no work in a lockstep step) replays the smallest graph, routing nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.bench.step.ep_path import one_rank_parallel
from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.model_source import load_model
from services.engine.sampling_params import SamplingParams
from services.worker.build import build_runner
from services.worker.parallel.ep_kernel_moe import ExpertParallelKernelMoE, unshard_kernel_experts

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ENGINE = dict(
    kernel_backend="fp8",
    expert_format="fp8",
    batch_invariant=True,
    cuda_graphs=True,
    async_scheduling=False,
    max_num_seqs=4,
    max_model_len=96,
    block_size=16,
    num_blocks=32,
    device="cuda",
)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 37))]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12),
    SamplingParams(temperature=0.8, seed=5, max_tokens=12),
    SamplingParams(temperature=0.0, max_tokens=7),
]


@gpu
@pytest.mark.gpu
def test_the_ep_path_in_decode_graphs_equals_the_engine_without_it():
    source = load_model("tiny", device="cuda", precision="fp8", expert_format="fp8")
    plain = LLM(source=source, **ENGINE)
    want = plain.generate(PROMPTS, PARAMS)
    del plain
    config = EngineConfig(**ENGINE)
    parallel = one_rank_parallel(source.config, config.max_num_seqs, "cuda")
    runner = build_runner(source.model, config.worker_config(), expert_parallel=parallel)
    try:
        assert all(isinstance(b.ffn, ExpertParallelKernelMoE) for b in source.model.layers)
        llm = LLM(source=source, runner=runner, **ENGINE)
        got = llm.generate(PROMPTS, PARAMS)
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids
            assert g.logprobs == w.logprobs
        assert runner.num_replays > 0  # decode steps replayed graphs with the exchange in them
        replays = runner.num_replays
        placeholder = SimpleNamespace(is_placeholder=True, num_rows=0, block_copies=[], state_copies=[])
        out = runner.execute(placeholder)
        assert runner.num_replays == replays + 1 and out.logits.shape[0] == 0
        assert int(out.expert_counts.sum()) == 0  # its rows routed nowhere
    finally:
        unshard_kernel_experts(source.model)
