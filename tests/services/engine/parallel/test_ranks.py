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

from services.engine.llm import LLM
from services.engine.parallel.ranks import spread_by_load
from services.engine.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 37)), [17, 18], [40, 41, 42, 43, 44], [50]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5)
# Every rank's prompts fit one prefill step, so the group prefills once at the first ALL point and then
# decodes: no prompt waits 70 decode steps for the next vote point (tests/.../test_lockstep.py shows those).
ENGINE = dict(batch_invariant=True, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=16,
              device="cpu")


@pytest.fixture(scope="module")
def one_process(one_torch_thread):
    return [o.token_ids for o in LLM("tiny", **ENGINE).generate(PROMPTS, GREEDY)]


def test_requests_spread_by_load():
    requests = [(str(i), [1] * n, SamplingParams(max_tokens=m)) for i, (n, m) in
                enumerate([(10, 10), (3, 2), (4, 1), (30, 5), (1, 1)])]
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
    # A second call: ids continue, unique across ranks. (Its prefill waits for the next ALL point: the
    # first call left decode_step a few steps past 0, and ALL points come every 70 decode steps.)
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
