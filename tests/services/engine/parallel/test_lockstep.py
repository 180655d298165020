"""Lockstep over real collectives (gloo, CPU): the vote schedule of the walkthrough's worked example, and
every rank's logits equal to one process's in the batch-invariant mode, placeholder and vote-split steps
included."""

from __future__ import annotations

from functools import partial

import numpy as np

from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.model_source import load_model
from services.engine.parallel.rank import RankSpec, build_rank
from services.engine.sampling_params import SamplingParams
from tests.ranks_harness import run_ranks


class Recorder:
    """Wraps a runner: each step's (kind, placeholder) and each sampled row's logits by (request, position)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.steps: list[tuple[str, bool]] = []
        self.logits: dict[tuple[str, int], np.ndarray] = {}  # numpy: pickled by value across processes
        self.counts: np.ndarray | int = 0  # [layers, experts] summed over steps (the sending side)

    def execute(self, plan, *args, **kwargs):
        out = self.runner.execute(plan, *args, **kwargs)
        sample_rows = np.frombuffer(plan.sample_rows, np.int32)
        positions = np.frombuffer(plan.positions, np.int32)[sample_rows]
        owners = np.frombuffer(plan.row_requests, np.int32)[sample_rows]
        ids = plan.request_ids
        for i, (position, owner) in enumerate(zip(positions.tolist(), owners.tolist())):
            self.logits[(ids[owner], position)] = out.logits[i].numpy().copy()
        self.steps.append((plan.kind, plan.is_placeholder))
        self.counts = self.counts + out.expert_counts.numpy()
        return out

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)


def _config(world_size: int, scheduling: str) -> EngineConfig:
    return EngineConfig(
        data_parallel_size=world_size,
        scheduling=scheduling,
        batch_invariant=True,
        max_num_seqs=1,
        max_num_batched_tokens=16,
        max_model_len=64,
        block_size=16,
        device="cpu",
    )


def _lockstep_rank(
    rank: int, world_size: int, init_method: str, shares, abort_after: dict, scheduling: str = "separate"
) -> dict:
    """Adds this rank's requests held not ready (the walkthrough: no prompt is schedulable at the first
    schedule()), makes them ready after step 0, and steps in lockstep until no rank has work left.
    ``abort_after[request_id] = other``: abort that waiting request once ``other`` has finished (a client
    gone while its request waited for a vote point)."""
    built = build_rank(
        rank, RankSpec(_config(world_size, scheduling), partial(load_model, "tiny", 0), init_method, "cpu", 1)
    )
    engine = built.engine
    recorder = Recorder(engine.worker.runner)
    engine.worker.runner = recorder
    for request_id, ids, max_tokens in shares[rank]:
        engine.add_request(request_id, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), ready=False)
    outputs: dict[str, list[int]] = {}
    step = 0
    while built.vote.any_rank(engine.has_unfinished()):
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        if step == 0:
            for request_id, _, _ in shares[rank]:
                engine.scheduler.set_schedulable(request_id)
        for waiting, other in abort_after.items():
            if other in outputs and waiting not in outputs and engine.abort(waiting) is not None:
                outputs[waiting] = []
        step += 1
    return {
        "steps": recorder.steps,
        "logits": recorder.logits,
        "outputs": outputs,
        "slot_counts": built.parallel.take_slot_counts().numpy(),
        "local_experts": [s.local_experts for s in built.parallel.slots],
        "num_votes": built.vote.num_votes,
    }


def _reference(requests) -> tuple[dict, dict, np.ndarray]:
    """One process, no ranks: each request's sampled-row logits by (request, position), its tokens, and
    the expert counts [layers, experts] of every row computed."""
    llm = LLM(
        "tiny",
        batch_invariant=True,
        max_num_seqs=1,
        max_num_batched_tokens=16,
        max_model_len=64,
        block_size=16,
        device="cpu",
    )
    engine = llm.engine
    recorder = Recorder(engine.worker.runner)
    engine.worker.runner = recorder
    tokens = {}
    for request_id, ids, max_tokens in requests:
        engine.add_request(request_id, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    tokens[request_id] = out.token_ids
    return recorder.logits, tokens, recorder.counts


def _check_logits_and_tokens(ranks, requests) -> None:
    """Every rank's sampled-row logits and tokens equal one process's running the same requests."""
    logits, tokens, _ = _reference(requests)
    got: dict = {}
    for r in ranks:
        got.update(r["logits"])
    assert sorted(got) == sorted(logits)
    for key in logits:
        assert np.array_equal(got[key], logits[key]), key
    for r in ranks:
        for request_id, out in r["outputs"].items():
            assert out == tokens.get(request_id, []), request_id


def test_mixed_steps_take_no_vote_and_every_ranks_logits_match_one_process(tmp_path, one_torch_thread):
    # The same requests under mixed steps: no prefill vote, so nothing waits for a vote point. Step 0 has
    # nothing ready (placeholders); then each rank runs its own steps, and a rank with nothing runs a
    # placeholder while the other works. The only votes are the work-left votes, one per step and one to stop.
    a1, a2 = ("a1", list(range(5, 10)), 3), ("a2", [40, 41, 42, 43], 2)
    b1, b2 = ("b1", [7, 8, 9], 1), ("b2", [30, 31, 32, 33], 1)
    ranks = run_ranks(_lockstep_rank, 2, tmp_path, ([[a1, a2], [b1, b2]], {"a2": "a1"}, "mixed"))
    placeholder = ("decode", True)
    assert ranks[0]["steps"] == [placeholder, ("prefill", False), ("decode", False), ("decode", False)]
    assert ranks[1]["steps"] == [placeholder, ("prefill", False), ("prefill", False), placeholder]
    assert [r["num_votes"] for r in ranks] == [5, 5]
    assert ranks[0]["outputs"]["a2"] == []  # aborted while waiting
    _check_logits_and_tokens(ranks, [a1, b1, b2])


def test_vote_schedule_and_every_ranks_logits_match_one_process(tmp_path, one_torch_thread):
    # Rank 0: a1 (3 tokens out) and a2 behind it; rank 1: b1 and b2, each ending at its first token.
    # max_num_seqs = 1, so rank 0 cannot start a2 while a1 runs.
    a1, a2 = ("a1", list(range(5, 10)), 3), ("a2", [40, 41, 42, 43], 2)
    b1, b2 = ("b1", [7, 8, 9], 1), ("b2", [30, 31, 32, 33], 1)
    ranks = run_ranks(_lockstep_rank, 2, tmp_path, ([[a1, a2], [b1, b2]], {"a2": "a1"}))
    placeholder = ("decode", True)
    # Step 0 is an ALL point that fails (nothing is ready); the next ALL point is decode step 70, so both
    # ranks run 70 placeholder steps, then prefill together (walkthrough Pass 2, "The first engine steps
    # are empty").
    # Step 71 (an ALL point: a prompt step resets decode_step): both want prefill, only rank 1 can
    # schedule (b2), so rank 0 runs an empty prompt step alongside (the second vote).
    # Step 72: rank 0 still wants a2, rank 1 has nothing waiting: the ALL vote fails and rank 0 decodes a1
    # while rank 1 runs placeholders; a2 is aborted once a1 ends, and the work-left vote stops both.
    assert ranks[0]["steps"] == [placeholder] * 70 + [
        ("prefill", False),
        ("prefill", True),
        ("decode", False),
        ("decode", False),
    ]
    assert ranks[1]["steps"] == [placeholder] * 70 + [("prefill", False), ("prefill", False), placeholder, placeholder]
    assert ranks[0]["outputs"]["a2"] == []  # aborted while waiting
    logits, tokens, counts = _reference([a1, b1, b2])
    got: dict = {}
    for r in ranks:
        got.update(r["logits"])
    assert sorted(got) == sorted(logits)
    for key in logits:
        assert np.array_equal(got[key], logits[key]), key
    assert ranks[0]["outputs"]["a1"] == tokens["a1"]
    assert (ranks[1]["outputs"]["b1"], ranks[1]["outputs"]["b2"]) == (tokens["b1"], tokens["b2"])
    # Counts taken on the receiving side per physical slot add up, per logical expert, to the one
    # process's counts of the same rows.
    received = np.zeros_like(counts)
    for r in ranks:
        for layer, experts in enumerate(r["local_experts"]):
            np.add.at(received[layer], experts, r["slot_counts"][layer])
    assert np.array_equal(received, counts)
