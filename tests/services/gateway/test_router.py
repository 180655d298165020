"""Routing by NATS load reports and lifecycle events, with real engine reporters on a real nats-server."""

import asyncio

import pytest

from services.engine.reporting.reporter import LoadReporter
from services.engine.service import ShuttingDown
from services.engine.stats import EngineStats
from services.gateway.remote import RemoteEngine
from services.gateway.router import EngineRouter

pytestmark = pytest.mark.timeout(60)


def stats(running: int) -> EngineStats:
    return EngineStats(
        free_blocks=10,
        total_blocks=10,
        free_state_slots=4,
        total_state_slots=4,
        num_waiting=0,
        num_running=running,
        decode_step=0,
    )


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_reports_and_lifecycle_steer_the_router(nats_url):
    async def run():
        # Engines are never called here: only the router's choice is under test.
        router = EngineRouter([RemoteEngine("engine-0", "127.0.0.1:1"), RemoteEngine("engine-1", "127.0.0.1:2")])
        await router.subscribe(nats_url)
        loads = {"engine-0": 0, "engine-1": 0}
        reporters = [
            LoadReporter(nats_url, name, f"127.0.0.1:{i + 1}", lambda name=name: stats(loads[name]), interval_s=0.05)
            for i, name in enumerate(loads)
        ]
        for r in reporters:
            await r.start()
        try:
            await until(lambda: router.num_reports >= 2)
            # Idle and equal: round robin spreads the picks.
            assert {router.pick().engine.replica for _ in range(4)} == {"engine-0", "engine-1"}
            loads["engine-0"] = 5
            await until(lambda: router.states["engine-0"].reported_load == 5)
            assert {router.pick().engine.replica for _ in range(6)} == {"engine-1"}
            # A draining engine gets nothing new even when it is the least loaded.
            loads["engine-0"], loads["engine-1"] = 0, 9
            await until(lambda: router.states["engine-1"].reported_load == 9)
            assert router.pick().engine.replica == "engine-0"
            await reporters[0].lifecycle("draining")
            await until(lambda: not router.states["engine-0"].accepting)
            assert router.pick().engine.replica == "engine-1"
            await reporters[1].stop()  # publishes "down"
            await until(lambda: not router.states["engine-1"].accepting)
            with pytest.raises(ShuttingDown):
                router.pick()
        finally:
            for r in reporters:
                await r.stop()
            await router.close()

    asyncio.run(run())


class _Stream:
    """A stand-in for a `RemoteStream`: one final delta, then the end."""

    num_prompt_tokens = 1

    def __init__(self) -> None:
        self.done = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        from services.engine.service import Delta

        if self.done:
            raise StopAsyncIteration
        self.done = True
        return Delta(token_ids=[1], logprobs=[], top_logprobs=None, num_output_tokens=1, finish_reason="length")

    def close(self) -> None:
        self.done = True


def test_without_nats_the_score_is_the_live_count_and_falls_when_a_stream_ends(monkeypatch):
    """No load reports: a finished request no longer counts. One engine holds a long request while the other
    serves two short ones; the next request goes to the idle engine (counting every request ever sent, the
    idle one scores 2 against 1 and the busy engine would get it)."""

    async def submit(*args, **kwargs):
        return _Stream()

    async def run():
        engines = [RemoteEngine("engine-0", "127.0.0.1:1"), RemoteEngine("engine-1", "127.0.0.1:2")]
        for engine in engines:
            monkeypatch.setattr(engine, "submit", submit)
        router = EngineRouter(engines)
        long = await router.submit("r0", "c0", [1], None)  # never read: stays live
        for i in (1, 2):
            short = await router.submit(f"r{i}", f"c{i}", [1], None)
            assert short.state is not long.state
            async for _ in short:
                pass
        assert long.state.score == 1 and short.state.score == 0
        nxt = await router.submit("r3", "c3", [1], None)
        assert nxt.state is short.state

    asyncio.run(run())
