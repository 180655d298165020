"""The expert-parallel kernel layer inside the engine's decode graphs, on one GPU (``gpu``-marked): a one-rank NCCL
group (``all_to_all_single`` to itself, captured) runs the path a rank of a group runs, and in the
batch-invariant mode its tokens and logprobs equal the engine without it with ``==``; decode steps replay graphs,
and a placeholder step (a rank with no work in a lockstep step) replays the smallest graph, routing nothing. On
the CPU, the path each step takes (static step, eager runner, the placeholder's static step) with the passes the
group agreed."""

from __future__ import annotations

import contextlib
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


def test_with_expert_parallelism_a_step_agrees_on_passes_and_picks_its_path(monkeypatch):
    """CPU, no graphs (``use_graphs=False`` runs the static steps eagerly): the routing alone, on a stand-in runner
    and static step. A placeholder step runs the smallest static step with every row a placeholder; a decode step
    of one agreed pass takes the static step; one whose group agreed on more passes runs on the eager runner; the
    agreement is cleared after every step."""
    from services.worker.parallel.ep_moe import ExpertParallel
    from services.worker.parallel.expert_slots import ExpertSlots
    from services.worker.runners import decode_step_graphs
    from services.worker.runners.decode_step_graphs import DecodeStepGraphs
    from services.worker.runners.reference_runner import RunnerOutput

    parallel = ExpertParallel(None, [ExpertSlots.startup(8, 1, 0, 0)], pass_tokens=2)  # type: ignore[arg-type]
    eager: list = []
    runner = SimpleNamespace(
        rounding=None,
        model=SimpleNamespace(embed=SimpleNamespace(weight=torch.zeros(1))),
        kernels=object(),
        expert_parallel=parallel,
        with_taps=False,
        cache=SimpleNamespace(copy=lambda *_: None),
        cfg=SimpleNamespace(vocab_size=5),
        invariant=lambda: contextlib.nullcontext(),
        execute=lambda plan, all_rows=False, pending=None: eager.append(plan) or RunnerOutput(torch.zeros(0, 5)),
    )
    config = EngineConfig(max_num_seqs=2, max_model_len=32, block_size=16, num_blocks=4).worker_config()
    graphs = DecodeStepGraphs(runner, config, use_graphs=False, attention="reference")  # type: ignore[arg-type]
    ran: list = []

    class Step:
        def __init__(self, size: int) -> None:
            self.size = size

        def fill_placeholders(self) -> None:
            ran.append(("placeholders", self.size))

        def fill(self, plan, pending=None) -> None:
            ran.append(("fill", self.size))

        def run(self):
            ran.append(("run", self.size))
            return torch.zeros(self.size, 5), torch.zeros(1, 8, dtype=torch.long), None

    monkeypatch.setattr(graphs, "step", Step)
    monkeypatch.setattr(decode_step_graphs.StaticDecodeStep, "fits", staticmethod(lambda plan: plan.kind == "decode"))

    def plan(kind: str, rows: int, **extra):
        return SimpleNamespace(
            kind=kind,
            num_rows=rows,
            is_placeholder=False,
            block_copies=[],
            state_copies=[],
            graph_size=2,
            sample_rows=torch.arange(rows),
            **extra,
        )

    out = graphs.execute(SimpleNamespace(is_placeholder=True, num_rows=0, block_copies=[], state_copies=[]))
    assert ran == [("placeholders", 1), ("run", 1)] and out.logits.shape == (0, 5)
    assert parallel.passes == 1 and not eager
    ran.clear()
    graphs.execute(plan("decode", 2))  # one pass: the static step
    assert ran == [("fill", 2), ("run", 2)] and not eager
    graphs.execute(plan("prefill", 5))  # three passes: eager (here it is this rank's own prefill)
    assert len(eager) == 1 and parallel.passes == 1  # cleared after the step
    agreed = []
    parallel.agree_passes = lambda n: agreed.append(n) or 3  # a peer's long prefill: the group agreed on 3
    graphs.execute(plan("decode", 2))
    assert len(eager) == 2 and agreed == [2]  # the decode step ran eagerly with the group's passes
