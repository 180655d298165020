"""A rank's engine with the features one process has (gloo, CPU, tiny, batch-invariant mode): async
scheduling and speculative decoding (fixed and varlen, rejection and deterministic) give the tokens of one
process, in one group of 2 ranks that builds an engine per configuration on the same process groups.
Greedy: dp 2 with async, and with fixed drafts, == one process without either. Seeded: the deterministic
mode's tokens with varlen and async on dp 2 == one process's with one draft (they depend on neither the
drafts verified nor the batch, tests/services/worker/spec/test_speculator.py)."""

from __future__ import annotations

import time
from functools import partial

import torch.distributed as dist

from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.model_source import load_model
from services.engine.parallel.rank import RankSpec, build_rank, run_to_completion
from services.engine.parallel.ranks import spread_by_load
from services.engine.sampling_params import SamplingParams
from services.worker.parallel.groups import init_rank_groups
from tests.ranks_harness import run_ranks

ENGINE = dict(batch_invariant=True, max_num_seqs=4, max_model_len=64, block_size=16, device="cpu")
# Three prompts over two ranks by load: rank 0 gets the first (10 tokens out), rank 1 the others (3 each),
# so rank 1 runs out first and steps on with placeholder steps (with async scheduling: while its own last
# step is still in flight).
PROMPTS = [[0, *range(3, 3 + n)] for n in (5, 2, 3)]
MAX_TOKENS = (10, 3, 3)
NEXTN = 3
GREEDY = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
SEEDED = [
    SamplingParams(max_tokens=n, temperature=0.9, seed=300 + i, ignore_eos=True) for i, n in enumerate(MAX_TOKENS)
]
# Varlen's step-cost curve (rows → ms), given so every rank chooses by the same curve: steep enough that
# requests verify different numbers of drafts.
CURVE = tuple((rows, 1.0 + 0.1 * rows) for rows in range(1, 4 * (1 + NEXTN) + 1))
# name → (engine arguments, sampling): every configuration the group runs, in order (dp 2 without either
# feature is tests/services/engine/parallel/test_ranks.py's).
RUNS = {
    "async": ({"async_scheduling": True}, GREEDY),
    "spec-fixed-rejection": ({"num_speculative_tokens": NEXTN}, GREEDY),
    "spec-varlen-deterministic-async-seeded": (
        {
            "num_speculative_tokens": NEXTN,
            "spec_sampling": "deterministic",
            "spec_varlen": True,
            "spec_step_cost_ms": CURVE,
            "async_scheduling": True,
        },
        SEEDED,
    ),
}


def known_drafts(reference: list[list[int]]):
    """Drafts = the reference continuation, every third one wrong (random draft weights accept almost
    nothing): acceptance, partial acceptance and rejection all happen. Request ids are prompt indices."""

    def rewrite(request_id: str, anchor: int, drafts: list[int]) -> list[int]:
        i = int(request_id)
        first = anchor + 1 - len(PROMPTS[i])  # output index of the token at anchor + 1
        out = reference[i]
        proposal = []
        for j, d in enumerate(drafts):
            token = out[first + j] if 0 <= first + j < len(out) else d
            proposal.append((token + 1) % 100 if (anchor + j) % 3 == 0 else token)
        return proposal

    return rewrite


def _requests(params) -> list:
    return [(str(i), ids, p) for i, (ids, p) in enumerate(zip(PROMPTS, params))]


def _rank(rank: int, world_size: int, init_method: str, references: dict) -> dict:
    """Every configuration of RUNS on this rank, one engine each on the same groups: name → (tokens by
    request id, drafts verified, drafts accepted, placeholder steps)."""
    base = EngineConfig(data_parallel_size=world_size, **ENGINE)
    groups = init_rank_groups(rank, world_size, init_method, "cpu", base.rank_timeout_s)
    assert dist.get_backend(groups.vote) == "gloo"  # the vote stays on the host, whatever the exchange runs
    got = {"vote_backend": dist.get_backend(groups.vote)}
    for name, (args, params) in RUNS.items():
        spec = RankSpec(base.replace(**args), partial(load_model, "tiny", 0), init_method, "cpu", 1)
        built = build_rank(rank, spec, groups)
        speculator = built.engine.worker.speculator
        if speculator is not None:
            speculator.rewrite_drafts = known_drafts(references[name])
        placeholders = []
        execute = built.engine.worker.execute

        def recording(plan, *rest, execute=execute, placeholders=placeholders):
            placeholders.append(plan.is_placeholder)
            return execute(plan, *rest)

        built.engine.worker.execute = recording
        share = spread_by_load(_requests(params), world_size)[rank]
        started = time.perf_counter()
        outputs = run_to_completion(built, share)
        print(
            f"rank {rank} {name}: {time.perf_counter() - started:.1f} s, {len(placeholders)} steps, "
            f"{sum(placeholders)} placeholders",
            flush=True,
        )
        got[name] = (
            {o.request_id: o.token_ids for o in outputs},
            speculator.num_drafts_verified if speculator else 0,
            speculator.num_drafts_accepted if speculator else 0,
            sum(placeholders),
        )
    return got


def _one_process(params, **engine_args) -> list[list[int]]:
    llm = LLM("tiny", **ENGINE, **engine_args)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_async_and_speculative_ranks_give_one_process_tokens(tmp_path, one_torch_thread):
    greedy = _one_process(GREEDY)
    seeded = _one_process(SEEDED, num_speculative_tokens=1, spec_sampling="deterministic")
    references = {name: seeded if params is SEEDED else greedy for name, (_, params) in RUNS.items()}
    ranks = run_ranks(_rank, 2, tmp_path, (references,))
    for name, (args, params) in RUNS.items():
        tokens: dict[str, list[int]] = {}
        for r in ranks:
            tokens.update(r[name][0])
        assert [tokens[str(i)] for i in range(len(PROMPTS))] == references[name], name
        assert sorted(ranks[0][name][0]) == ["0"], name  # the split the placeholder check relies on
        assert ranks[1][name][3] > 0, f"{name}: rank 1 never ran a placeholder step"
        if args.get("num_speculative_tokens"):
            verified = sum(r[name][1] for r in ranks)
            accepted = sum(r[name][2] for r in ranks)
            assert 0 < accepted < verified, (name, accepted, verified)
