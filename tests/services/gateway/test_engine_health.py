"""The gateway's dependency poll against real grpc.health.v1 servers: an engine answering NOT_SERVING gets
no requests and, when it was the only one, the gateway reports "no engine"; a tokenizer that is gone is a
problem of its own; a stopped server counts at once; everything recovers when they answer SERVING."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.engine.service import ShuttingDown
from services.gateway.engine_health import NO_ENGINE, NO_TOKENIZER, EngineHealth
from services.gateway.remote import RemoteEngine
from services.gateway.router import EngineRouter

pytestmark = pytest.mark.timeout(60)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def health_server():
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", SERVING)
    return server, servicer, f"127.0.0.1:{port}"


def test_the_poll_follows_engines_and_tokenizer():
    async def run():
        (s0, h0, a0), (s1, h1, a1), (st, ht, at) = [await health_server() for _ in range(3)]
        router = EngineRouter([RemoteEngine("engine-0", a0), RemoteEngine("engine-1", a1)])
        problems = []

        async def on_change(problem):
            problems.append(problem)

        tokenizer = grpc.aio.insecure_channel(at)
        poll = EngineHealth(router, on_change, interval_s=0.5, tokenizer_channel=tokenizer)
        assert await poll.poll() is None and problems == []
        await h0.set("", NOT_SERVING)  # engine-0's worker is gone
        assert await poll.poll() is None
        assert all(router.pick().engine.replica == "engine-1" for _ in range(4))
        await s1.stop(None)  # engine-1's process is gone: no answer at all
        assert await poll.poll() == NO_ENGINE
        with pytest.raises(ShuttingDown):
            router.pick()
        await h0.set("", SERVING)
        assert await poll.poll() is None
        assert router.pick().engine.replica == "engine-0"
        await ht.set("", NOT_SERVING)
        assert await poll.poll() == NO_TOKENIZER
        await ht.set("", SERVING)
        assert await poll.poll() is None
        assert problems == [NO_ENGINE, None, NO_TOKENIZER, None]
        await router.close()
        await tokenizer.close()
        await s0.stop(None)
        await st.stop(None)

    asyncio.run(run())


def test_with_no_engine_serving_the_problem_names_the_starting_engines_phase():
    from services.gateway.startup_server import StartupServer
    from services.worker.startup import StartupProgress

    async def run():
        progress = StartupProgress()
        starting = StartupServer(progress, "127.0.0.1", 0)
        await starting.start()
        router = EngineRouter([RemoteEngine("engine-0", f"127.0.0.1:{starting.grpc_port}")])

        async def on_change(problem):
            pass

        poll = EngineHealth(router, on_change)
        with progress.phase("capturing", total=11) as step:
            step.advance("64 rows")
            problem = await poll.poll()
        await router.close()
        await starting.stop()
        return problem

    problem = asyncio.run(run())
    assert problem.startswith(f"{NO_ENGINE} (engine-0: capturing 1/11 (64 rows) ")


def test_a_gateway_started_beside_its_engines_reads_the_first_one_that_serves():
    """`first_serving` waits through a port nobody listens on yet and an engine still starting (NOT_SERVING), and
    returns the engine that serves first."""
    from services.gateway.engine_health import first_serving
    from services.ports import free_port

    async def run():
        server, servicer, address = await health_server()
        await servicer.set("", NOT_SERVING)
        absent = RemoteEngine("engine-0", f"127.0.0.1:{free_port('127.0.0.1')}")
        starting = RemoteEngine("engine-1", address)
        waiting = asyncio.create_task(first_serving([absent, starting], interval_s=0.02))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await servicer.set("", SERVING)
        assert await asyncio.wait_for(waiting, 5) is starting
        await server.stop(None)

    asyncio.run(run())
