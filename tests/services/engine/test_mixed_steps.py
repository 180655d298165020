"""Mixed steps (decode rows and prompt chunks in one step under the token budget) on the CPU cached path.

- Exact: in the batch-invariant mode every request's tokens and logprobs are the same bits under ``mixed`` and
  ``separate`` scheduling and under different budgets, with async scheduling, and with speculative decoding
  (greedy, and seeded with ``spec_sampling="deterministic"``). Every comparison is Python ``==``.
- No stalls: while 8 streams decode, a 3K-token prompt arrives; under ``separate`` some steps carry no decode
  row, under ``mixed`` every step carries all 8.

The model: the oracle-draft tiny config (vocabulary 256), as the speculative tests use (``draft_source``,
conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.worker.worker import Worker
from tests.model.deepseek_v41.oracle_configs import DRAFT_CASES

NEXTN = DRAFT_CASES[0].cfg.dspark_block_size
MAX_NUM_SEQS = 6
ENGINE = dict(device="cpu", batch_invariant=True, max_model_len=96, block_size=8, max_num_seqs=MAX_NUM_SEQS)
# Lengths from 2 to 41 tokens: at a budget of a few dozen rows the long prompts are chunked over several steps
# while the short ones already decode, so mixed steps carry both.
PROMPTS = [[0, *range(3 + k, 3 + k + n)] for k, n in enumerate((4, 40, 1, 23, 9, 31))]
MAX_TOKENS = 8

pytestmark = pytest.mark.usefixtures("pools_checked_after_every_step")  # conftest.py


@pytest.fixture(scope="module")
def source(draft_source):
    return draft_source


def generate(source, params, prompts=PROMPTS, **engine_args) -> tuple[list, list[str]]:
    """(outputs, the kind of every step the worker ran)."""
    llm = LLM(source=source, **{**ENGINE, **engine_args})
    kinds: list[str] = []
    worker: Worker = llm.engine.worker
    execute = worker.execute

    def recording(plan, rows, previous=None):
        kinds.append("placeholder" if plan.is_placeholder else plan.kind)
        return execute(plan, rows, previous)

    worker.execute = recording
    return llm.generate(prompts, params), kinds


def answers(outputs) -> list[tuple]:
    return [(o.token_ids, o.logprobs, o.top_logprobs, o.finish_reason) for o in outputs]


SEEDED = [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, logprobs=3, seed=40 + i, ignore_eos=True)
    for i in range(len(PROMPTS))
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=2, ignore_eos=True)


def test_mixed_separate_and_budgets_give_the_same_bits(source):
    decode_rows = MAX_NUM_SEQS
    base, kinds = generate(source, SEEDED, scheduling="separate", max_num_batched_tokens=decode_rows + 10)
    assert "mixed" not in kinds and "prefill" in kinds
    for scheduling, budget, async_scheduling in [
        ("mixed", decode_rows + 10, False),
        ("mixed", decode_rows + 3, False),
        ("mixed", 64, False),
        ("mixed", decode_rows + 10, True),
        ("separate", 64, True),
    ]:
        outs, kinds = generate(
            source,
            SEEDED,
            scheduling=scheduling,
            max_num_batched_tokens=budget,
            async_scheduling=async_scheduling,
        )
        assert (scheduling == "mixed") == ("mixed" in kinds), (scheduling, budget)
        assert answers(outs) == answers(base), (scheduling, budget, async_scheduling)


@pytest.mark.parametrize("spec_sampling", ["rejection", "deterministic"])
def test_speculative_decoding_in_mixed_steps_gives_the_same_bits(source, spec_sampling):
    """Greedy in both acceptance modes, and seeded in the deterministic one: tokens and logprobs under mixed
    steps (at two budgets, synchronous and async) equal those of separate steps."""
    decode_rows = MAX_NUM_SEQS * (1 + NEXTN)
    spec = dict(num_speculative_tokens=NEXTN, spec_sampling=spec_sampling)
    cases = [GREEDY] + ([SEEDED] if spec_sampling == "deterministic" else [])
    for params in cases:
        base, _ = generate(source, params, scheduling="separate", max_num_batched_tokens=decode_rows, **spec)
        for budget, async_scheduling in [(decode_rows + 4, False), (decode_rows + 20, True)]:
            outs, kinds = generate(
                source,
                params,
                scheduling="mixed",
                max_num_batched_tokens=budget,
                async_scheduling=async_scheduling,
                **spec,
            )
            assert "mixed" in kinds
            assert answers(outs) == answers(base), (budget, async_scheduling)


def test_a_long_prompt_stalls_separate_steps_but_not_mixed_ones(source):
    """8 streams decode; a 3,072-token prompt arrives. Separate: its six 512-token prefill steps carry no decode
    row. Mixed: every step until its first token carries all 8 streams' rows, and its chunks fill the rest."""
    args = dict(device="cpu", max_model_len=3200, block_size=16, max_num_seqs=9, max_num_batched_tokens=512)
    args.update(enable_prefix_caching=False)  # the long prompt starts with stream s0's prompt: it would resume
    for scheduling in ("separate", "mixed"):
        engine = LLM(source=source, scheduling=scheduling, **args).engine
        streams = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        for i in range(8):
            engine.add_request(f"s{i}", [0, 3 + i, 4 + i], streams)
        engine.step()  # the 8 prompts, prefilled together
        assert engine.last_plan.kind == "prefill" and engine.last_plan.num_requests == 8
        long = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        engine.add_request("long", [0, *(3 + (i % 200) for i in range(3071))], long)
        output = engine.requests["long"].output
        rows = []  # per step until the long prompt's first token: (decode requests, prompt rows)
        while not output.token_ids:
            engine.step()
            plan = engine.last_plan
            num_decode = plan.num_decode_requests
            rows.append((num_decode, int(plan.query_start[plan.num_requests] - plan.query_start[num_decode])))
        assert sum(prompt for _, prompt in rows) == 3072
        if scheduling == "separate":
            assert rows.count((0, 512)) == 6 and len(rows) == 6
        else:
            assert all(num_decode == 8 for num_decode, _ in rows)
            assert [prompt for _, prompt in rows] == [504] * 6 + [48]
        for request_id in list(engine.requests):
            engine.abort(request_id)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nextn", [0, NEXTN], ids=["plain", "drafts"])
def test_gpu_kernel_path_mixed_and_separate_give_the_same_bits(source, nextn):
    """The FP8 kernel backend with the CUDA defaults (CUDA graphs: decode-only steps replay, mixed steps run
    eagerly; async scheduling), batch-invariant: mixed steps at two budgets equal separate steps, seeded
    sampling without drafts, and with drafts greedy and seeded in the deterministic mode."""
    from services.engine.model_source import load_model

    decode_rows = MAX_NUM_SEQS * (1 + nextn)
    cuda = dict(device="cuda", kernel_backend="fp8", cuda_graphs=True, async_scheduling=True, num_blocks=128)
    if nextn:
        cuda.update(num_speculative_tokens=nextn, spec_sampling="deterministic")
    for params in [SEEDED] if not nextn else [GREEDY, SEEDED]:
        runs = [
            generate(
                load_model(source.name, device="cuda"), params, scheduling=scheduling, max_num_batched_tokens=b, **cuda
            )
            for scheduling, b in [
                ("separate", decode_rows + 10),
                ("mixed", decode_rows + 10),
                ("mixed", decode_rows + 3),
            ]
        ]
        (base, base_kinds), *mixed = runs
        assert "mixed" not in base_kinds
        for outs, kinds in mixed:
            assert "mixed" in kinds
            assert answers(outs) == answers(base)
