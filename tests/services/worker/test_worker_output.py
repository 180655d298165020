"""A worker's step output: the deferred read-back, read once and only when asked, and its public observer."""

from scheduler_rs import StepResult
from services.worker.worker_output import WorkerOutput


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
