"""``LLM(data_parallel_size=N)``: real rank processes over gloo. Greedy tokens in the batch-invariant mode
equal one process's for the same prompts spread over 2 and 4 ranks; bad input is refused before anything
reaches a rank; a rank killed mid-generate ends the call with an error naming it, and no rank process is
left behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from model.deepseek_v41.presets import TINY
from services.engine.llm import LLM
from services.engine.model_source import load_model
from services.engine.parallel.rank import apply_expert_layouts
from services.engine.parallel.ranks import spread_by_load
from services.engine.sampling_params import SamplingParams
from services.eplb.layout import Layout

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 37)), [17, 18], [40, 41, 42, 43, 44], [50]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5)
# Every rank's prompts fit one prefill step, so the group prefills once at the first ALL point and then
# decodes: no prompt waits 70 decode steps for the next vote point (tests/.../test_lockstep.py shows those).
ENGINE = dict(
    batch_invariant=True, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=16, device="cpu"
)


# Two ranks at start-up: rank 0 holds experts 0-3, rank 1 experts 4-7. After the move (10 slots, 5 a rank):
# rank 0 holds 7, 0, 3, 3, 5 (0 and 3 its own, 3 twice; 7 and 5 from rank 1) and rank 1 holds 6, 1, 2, 4, 0
# (6 and 4 its own; 1, 2 and 0 from rank 0).
MOVED = Layout((7, 0, 3, 3, 5, 6, 1, 2, 4, 0), num_gpus=2, num_logical=8)


def _expert_weights(rank) -> list[tuple]:
    """On a rank: each layer's kept (w1, w3, w2) as numpy arrays, slot order."""
    return [
        tuple(getattr(block.ffn.moe, n).detach().numpy().copy() for n in ("w1", "w3", "w2"))
        for block in rank.model.layers
    ]


@pytest.fixture(scope="module")
def one_process(one_torch_thread):
    return [o.token_ids for o in LLM("tiny", **ENGINE).generate(PROMPTS, GREEDY)]


def test_requests_spread_by_load():
    requests = [
        (str(i), [1] * n, SamplingParams(max_tokens=m))
        for i, (n, m) in enumerate([(10, 10), (3, 2), (4, 1), (30, 5), (1, 1)])
    ]
    # loads after each: [20, 0] → [20, 5] → [20, 10] → [20, 45] → [21, 45]
    assert [[r[0] for r in share] for share in spread_by_load(requests, 2)] == [["0", "4"], ["1", "2", "3"]]


@pytest.fixture(scope="module")
def two_ranks():
    llm = LLM("tiny", data_parallel_size=2, rank_timeout_s=20.0, **ENGINE)
    yield llm
    llm.close()


def test_two_ranks_equal_one_process(two_ranks, one_process):
    outputs = two_ranks.generate(PROMPTS, GREEDY)
    assert [o.request_id for o in outputs] == [str(i) for i in range(len(PROMPTS))]
    assert [o.token_ids for o in outputs] == one_process
    assert all(o.finish_reason == "length" for o in outputs)
    # Bad input is refused before anything is queued, and the group keeps serving.
    with pytest.raises(ValueError, match="outside the vocabulary"):
        two_ranks.generate([[5, 10**7]], GREEDY)
    # An EPLB layout applied between steps (MOVED): experts cross both ways, 0 and 3 get a second copy.
    received = two_ranks.ranks.call(apply_expert_layouts, [MOVED] * TINY.num_hidden_layers)
    assert received == [TINY.num_hidden_layers * 2, TINY.num_hidden_layers * 3]  # peer copies per rank
    full = load_model("tiny", 0).model
    for rank, layers in enumerate(two_ranks.ranks.call(_expert_weights)):
        for layer, (w1, w3, w2) in enumerate(layers):
            moe = full.layers[layer].ffn
            experts = list(MOVED.phy2log[rank * 5 : rank * 5 + 5])
            for got, want in ((w1, moe.w1), (w3, moe.w3), (w2, moe.w2)):  # byte for byte
                assert got.tobytes() == want[experts].detach().numpy().tobytes()
    # A second call, on the moved experts: the same tokens; ids continue, unique across ranks. (The first
    # call ended on a work-left vote that found every rank idle, so this call's first step is an ANY point
    # and its prompts prefill at once, though decode_step rests a few steps past 0.)
    again = two_ranks.generate(PROMPTS[:2], GREEDY)
    assert [o.request_id for o in again] == [str(len(PROMPTS)), str(len(PROMPTS) + 1)]
    assert [o.token_ids for o in again] == one_process[:2]


def test_four_ranks_with_expert_copies_equal_one_process(one_process):
    # 8 experts + at least 2 copies, rounded up to 12 slots: 3 per rank, copies of experts 0-3.
    llm = LLM("tiny", data_parallel_size=4, num_redundant_experts=2, **ENGINE)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == one_process
    finally:
        llm.close()
    assert not any(p.is_alive() for p in llm.ranks.processes)


def test_a_killed_rank_is_an_error_and_leaves_no_process(two_ranks):
    llm = two_ranks
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40))
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(3.0)  # well inside the run: 40 decode steps take far longer
    os.kill(llm.ranks.pids[1], signal.SIGKILL)
    start = time.monotonic()
    thread.join(timeout=60)
    assert not thread.is_alive(), "generate hung after a rank was killed"
    assert time.monotonic() - start < 20.0 + 10.0  # within the rank timeout, plus the poll and the stop
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "rank 1 exited with code -9" in str(errors[0]) and "group is stopped" in str(errors[0])
    for p in llm.ranks.processes:
        assert not p.is_alive()
    with pytest.raises(RuntimeError, match="stopped"):
        llm.generate(PROMPTS[:1], GREEDY)
