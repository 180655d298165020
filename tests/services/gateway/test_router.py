"""Routing by NATS load reports and lifecycle events, with real engine reporters on a real nats-server."""

import asyncio

import pytest

from services.engine.reporter import LoadReporter
from services.engine.service import ShuttingDown
from services.engine.stats import EngineStats
from services.gateway.remote import RemoteEngine
from services.gateway.router import EngineRouter

pytestmark = pytest.mark.timeout(60)


def stats(running: int) -> EngineStats:
    return EngineStats(free_blocks=10, total_blocks=10, free_state_slots=4, total_state_slots=4, num_waiting=0,
                       num_running=running, decode_step=0)


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
        reporters = [LoadReporter(nats_url, name, f"127.0.0.1:{i + 1}", lambda name=name: stats(loads[name]),
                                  interval_s=0.05) for i, name in enumerate(loads)]
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
