"""services/worker/startup.py: the phases of a start, their steps and seconds, on a clock the test moves; a phase
beside the others (its own count and seconds, the threads that work for it)."""

from __future__ import annotations

import threading

import pytest

from services.worker.startup import BesideState, StartupProgress, StartupState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_count_steps_and_seconds_and_a_nested_phase_pauses_the_outer():
    clock = Clock()
    progress = StartupProgress(clock)
    assert progress.state() == StartupState(None, 0, None, None, 0.0, 0.0)
    with progress.phase("loading"):
        clock.now += 20
        assert progress.state().describe() == "loading 20 s"
    with progress.phase("profiling"):
        clock.now += 5
        with progress.phase("compiling", total=4) as step:  # the profile's step compiling its kernels
            clock.now += 30
            step.advance("moe")
            state = progress.state()
            assert (state.phase, state.done, state.total, state.detail) == ("compiling", 1, 4, "moe")
            assert state.describe(bar_width=8) == "compiling [##------] 1/4 (moe) 30 s"
            assert state.started_s == 55
        clock.now += 5
    with progress.phase("capturing", total=2) as step:
        clock.now += 3
        step.advance("16 rows")
        step.advance("8 rows")
        assert progress.durations() == {"loading": 20, "profiling": 10, "compiling": 30, "capturing": 3}
    assert progress.state().describe() == "between phases"
    assert progress.state().started_s == 63


def test_an_unknown_phase_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown startup phase 'warming'"):
        with StartupProgress().phase("warming"):
            pass


def test_the_state_travels_as_json():
    state = StartupState("capturing", 3, 11, "64 rows", 12.34, 80.06)
    assert StartupState.from_json(state.to_json()) == StartupState("capturing", 3, 11, "64 rows", 12.3, 80.1)


def test_a_phase_beside_the_others_is_reported_with_its_own_count_and_seconds():
    clock = Clock()
    progress = StartupProgress(clock)
    with progress.beside("compiling") as beside:
        with progress.phase("loading", total=10) as step:
            clock.now += 4
            beside.count(30, 130)
            step.advance("layer 0")
            state = progress.state()
            assert (state.phase, state.done, state.total) == ("loading", 1, 10)
            assert state.beside == (BesideState("compiling", 30, 130, 4.0),)
            assert (
                state.describe(bar_width=10) == "loading [#---------] 1/10 (layer 0) 4 s; beside: compiling 30/130 4 s"
            )
            assert StartupState.from_json(state.to_json()) == state
        clock.now += 2  # the load is done, the compiles are not: they are the phase reported
        beside.count(100, 130)
        state = progress.state()
        assert (state.phase, state.done, state.total, state.beside) == ("compiling", 100, 130, ())
        assert state.describe() == "compiling 100/130 6 s"
    with progress.phase("profiling"):
        clock.now += 1
    # Each phase's own wall time: loading and compiling overlapped, so they add up to more than the 7 s it took.
    assert progress.durations() == {"loading": 4, "profiling": 1, "compiling": 6}
    assert progress.state().started_s == 7


def test_threads_marked_for_a_phase_beside_work_for_it_until_it_ends():
    progress = StartupProgress()
    seen: dict[str, str | None] = {}

    def work(name: str, step=None) -> None:
        if step is not None:
            step.mark_thread()
        seen[name] = progress.working_phase()

    with progress.phase("loading"):
        with progress.beside("compiling") as step:
            assert progress.working_phase() == "compiling"  # the thread that entered it
            for name, marked in (("pool", step), ("loader", None)):
                thread = threading.Thread(target=work, args=(name, marked))
                thread.start()
                thread.join()
        assert progress.working_phase() == "loading"
    assert seen == {"pool": "compiling", "loader": "loading"}


def test_a_state_of_another_release_still_reads():
    """A process of an earlier release answers without ``beside``; a later one may add fields."""
    later = '{"phase": "loading", "done": 1, "total": 2, "detail": null, "phase_s": 1.0, "started_s": 2.0, "eta_s": 3, '
    later += '"beside": [{"phase": "compiling", "done": 0, "total": null, "phase_s": 0.5, "rate": 1}]}'
    assert StartupState.from_json(later) == StartupState(
        "loading", 1, 2, None, 1.0, 2.0, (BesideState("compiling", 0, None, 0.5),)
    )
    assert StartupState.from_json('{"phase": "loading", "done": 1, "total": 2, "detail": null, "phase_s": 1.0, '
                                  '"started_s": 2.0}').beside == ()  # fmt: skip
