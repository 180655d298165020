"""The engine's parts share its scheduler, worker and configuration (engine_parts.py): a worker set on the engine
after it was built is the one that runs the steps, synchronous or async, and gets every request's release,
the n > 1 prefix's included; a scheduler set so is the one every part plans, forks and updates with."""

from collections import Counter

from services.engine import LLM, SamplingParams


class _Counting:
    """The engine's worker, counting the calls made on it by name."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def test_a_worker_and_scheduler_set_on_the_engine_run_every_step_and_get_every_release_and_fork():
    llm = LLM("tiny", max_num_seqs=4)
    engine = llm.engine
    real, real_scheduler = engine.worker, engine.scheduler
    params = [SamplingParams(max_tokens=3, seed=1), SamplingParams(n=2, max_tokens=3, seed=2)]
    try:
        for async_scheduling in (False, True):
            engine.config = engine.config.replace(async_scheduling=async_scheduling)
            counting, scheduling = _Counting(real), _Counting(real_scheduler)
            engine.worker, engine.scheduler = counting, scheduling
            outputs = llm.generate(["Hello there", "Say it again"], params)
            assert [len(o.token_ids) for o in outputs] == [3, 3, 3]
            assert counting.calls["execute"] >= 3, counting.calls  # a prefill and two decode steps at least
            # One release per request of the scheduler's: the plain one, the prefix and its two choices.
            assert counting.calls["release"] == 4, counting.calls
            # The scheduler set on the engine plans, takes the requests, updates and forks the n > 1 prefix.
            assert scheduling.calls["schedule"] >= 3 and scheduling.calls["update"] >= 3, scheduling.calls
            assert scheduling.calls["add_request"] == 2 and scheduling.calls["fork"] == 2, scheduling.calls
    finally:
        engine.worker, engine.scheduler = real, real_scheduler
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks and stats.free_state_slots == stats.total_state_slots
