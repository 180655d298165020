"""The heartbeat's unbroken run of answers, the engine's settle before a lost worker counts as back, and the
releases a stalled worker is sent again: with stand-ins for the worker's health and worker services."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
from grpc_health.v1 import health_pb2

from services.engine.remote.heartbeat import WorkerHeartbeat
from services.engine.remote.remote_worker import RemoteWorker
from services.entrypoints import engine as process

SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class _Missed(grpc.RpcError):
    pass


class _Health:
    """A worker's health service that answers SERVING while ``up``."""

    def __init__(self) -> None:
        self.up = True

    def Check(self, request, timeout):  # noqa: N802 (the gRPC method's name)
        if not self.up:
            raise _Missed()
        return SERVING


def _heartbeat(health: _Health, timeout_s: float = 3.0) -> WorkerHeartbeat:
    beat = WorkerHeartbeat(grpc.insecure_channel("127.0.0.1:1"), "stand-in", interval_s=0.05, timeout_s=timeout_s)
    beat.stub = health
    return beat


def test_a_miss_restarts_the_run_of_answers():
    health = _Health()
    beat = _heartbeat(health)
    assert beat.beat() and beat.answering_for() >= 0.0
    health.up = False
    assert not beat.beat() and beat.answering_for() == 0.0
    assert beat.alive  # one miss: still within the timeout, but no longer answering steadily
    health.up = True
    beat.beat()
    first = beat.answering_for()
    beat.beat()
    assert beat.answering_for() >= first
    beat.mark_lost()
    assert not beat.alive and beat.answering_for() == 0.0


def test_gone_needs_a_failed_check_not_only_an_old_answer():
    """A heartbeat thread that did not get to run (a starved engine process) has no failed check: the busy worker
    stays alive however old its latest answer; once a check fails past the timeout, it is gone."""
    health = _Health()
    beat = _heartbeat(health, timeout_s=0.05)
    beat.start()
    beat.stop()  # the thread checks no more, as if starved
    assert beat.beat()
    time.sleep(0.1)  # the latest answer is older than the timeout
    assert beat.alive
    health.up = False
    assert not beat.beat() and not beat.alive
    health.up = True
    assert beat.beat() and beat.alive


class _Api:
    def __init__(self) -> None:
        self.problems: list[str | None] = []

    async def set_problem(self, problem: str | None) -> None:
        self.problems.append(problem)


def test_a_lost_worker_is_back_only_after_answering_steadily():
    """Lost, then one answer and a miss (a flap): health stays NOT_SERVING; back only after settle_s of answers."""
    remote = SimpleNamespace(address="stand-in", alive=True, steady=0.0, checked=0)
    remote.answering_for = lambda: remote.steady
    remote.check_model = lambda source, timeout: setattr(remote, "checked", remote.checked + 1)
    api = _Api()

    async def scenario() -> None:
        watch = asyncio.create_task(process.watch_worker(remote, None, api, None, interval_s=0.01, settle_s=1.0))
        await asyncio.sleep(0.05)
        remote.alive = False  # lost
        await asyncio.sleep(0.05)
        remote.alive, remote.steady = True, 0.2  # answering again, not yet steadily
        await asyncio.sleep(0.05)
        assert api.problems == ["the worker at stand-in is not answering"] and remote.checked == 0
        remote.steady = 1.5
        await asyncio.sleep(0.05)
        watch.cancel()

    asyncio.run(scenario())
    assert api.problems == ["the worker at stand-in is not answering", None] and remote.checked == 1


class _WorkerStub:
    def __init__(self) -> None:
        self.released: list[str] = []

    def Release(self, request, timeout):  # noqa: N802
        self.released.append(request.request_id)


def test_releases_while_the_worker_stalls_are_sent_before_its_next_step():
    remote = RemoteWorker("127.0.0.1:1")
    try:
        stub = remote.stub = _WorkerStub()
        remote.heartbeat.mark_lost()
        remote.release("a")
        remote.release("b")
        assert stub.released == [] and remote.unreleased == {"a", "b"}
        remote.heartbeat.stub = _Health()
        assert remote.heartbeat.beat()  # answering again
        remote.stub = SimpleNamespace(Release=stub.Release, ExecuteStep=None)
        try:
            remote.execute(SimpleNamespace(step_id=0), [])
        except Exception:  # the stand-in has no ExecuteStep: the releases come first
            pass
        assert stub.released == ["a", "b"] and remote.unreleased == set()
    finally:
        remote.close()
