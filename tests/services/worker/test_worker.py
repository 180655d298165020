"""The worker's step output: the deferred read-back and the per-request last tokens (async inputs)."""

import torch

from kernels.sampler_output import SamplerOutput
from scheduler_rs import StepResult
from services.worker.worker import WorkerOutput, last_tokens


def _sampled(tokens, errors):
    n = len(tokens)
    return SamplerOutput(
        token_ids=torch.tensor(tokens),
        logprobs=torch.zeros(n),
        top_token_ids=torch.zeros(n, 0, dtype=torch.long),
        top_logprobs=torch.zeros(n, 0),
        errors=torch.tensor(errors),
    )


def test_last_tokens_take_each_requests_last_row_and_mark_failures():
    # Requests sample 1, 0, 2 and 1 rows; the third request's first row failed.
    sampled = _sampled([11, 12, 13, 14], [False, True, False, False])
    assert last_tokens(sampled, [1, 0, 2, 1]).tolist() == [11, -1, -1, 14]
    assert last_tokens(_sampled([], []), [0, 0]).tolist() == [-1, -1]


def test_result_is_read_once_and_only_when_asked():
    calls = []

    def read():
        calls.append(1)
        return StepResult([1], [5])

    out = WorkerOutput(read, None, None, 1)
    assert calls == []
    assert out.result.token_ids == [5] and out.result.token_ids == [5] and calls == [1]
    eager = WorkerOutput(StepResult([0], []), None, None, 0)
    assert eager.result.num_tokens == [0]


def test_a_read_back_observer_is_called_once_just_before_the_read_and_never_for_a_host_result():
    events = []

    def read():
        events.append("read")
        return StepResult([1], [5])

    out = WorkerOutput(read, None, None, 1)
    assert out.on_read_back(lambda: events.append("observed"))
    assert events == []
    assert out.result.token_ids == [5] and out.result.token_ids == [5]
    assert events == ["observed", "read"]
    assert not out.on_read_back(lambda: events.append("late"))  # read already
    eager = WorkerOutput(StepResult([0], []), None, None, 0)
    assert not eager.on_read_back(lambda: events.append("eager"))
    assert eager.result.num_tokens == [0]
    assert events == ["observed", "read"]
