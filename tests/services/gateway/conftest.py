"""One in-process `shinkai serve` (HTTP + gRPC on random loopback ports) for the gateway tests.

The server's event loop runs in a background thread; tests talk to it over real sockets with real clients.
After the module, the server drains and its engine's pools must be whole.
"""

import asyncio
import threading

import pytest

from services.engine import LLM
from services.engine.stats import EngineStats
from services.gateway.server import ServeConfig, Server


class ServerThread:
    def __init__(self, config: ServeConfig) -> None:
        self.server = Server(config)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.start())
        self._ready.set()
        self.loop.run_forever()

    def start(self) -> "ServerThread":
        self._thread.start()
        assert self._ready.wait(60), "server did not start"
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)

    @property
    def http_url(self) -> str:
        return self.server.urls()["http"]

    @property
    def grpc_target(self) -> str:
        return self.server.urls()["grpc"]


def pools_whole(stats: EngineStats) -> bool:
    return (
        stats.free_blocks == stats.total_blocks
        and stats.free_state_slots == stats.total_state_slots
        and stats.num_running == stats.num_waiting == 0
    )


# Both engines in batch-invariant mode (docs/batch-invariance.md): the server batches a request with whatever
# else is in flight, LLM.generate runs it alone, and in this mode that cannot move a bit, so texts and
# logprobs compare under ==.
@pytest.fixture(scope="package")
def served():
    thread = ServerThread(
        ServeConfig(
            model="tiny",
            http_port=0,
            grpc_port=0,
            max_queued=300,
            drain_timeout_s=10,
            engine_args={"max_num_seqs": 32, "batch_invariant": True},
        )
    ).start()
    yield thread
    thread.stop()
    assert pools_whole(thread.server.engine.stats())


@pytest.fixture(scope="package")
def reference_llm():
    """A second tiny model with the same weights, driven only by LLM.generate."""
    return LLM("tiny", max_num_seqs=32, batch_invariant=True)
