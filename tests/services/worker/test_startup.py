"""services/worker/startup.py: the phases of a start, their steps and seconds, on a clock the test moves."""

from __future__ import annotations

import pytest

from services.worker.startup import StartupProgress, StartupState


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
