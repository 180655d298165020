"""Remote backends turn an unreachable service into ShuttingDown (a 503 / UNAVAILABLE), never a 500."""

import asyncio
import socket

import pytest

from services.engine import SamplingParams
from services.engine.service import ShuttingDown
from services.gateway.remote import RemoteEngine, RemoteTokenizer

pytestmark = pytest.mark.timeout(60)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens here once the socket closes


def test_unreachable_tokenizer_and_engine_are_unavailable():
    async def run():
        tokenizer = RemoteTokenizer(f"127.0.0.1:{closed_port()}")
        engine = RemoteEngine("engine-0", f"127.0.0.1:{closed_port()}")
        try:
            with pytest.raises(ShuttingDown, match="tokenizer"):
                await tokenizer.encode("Hello")
            with pytest.raises(ShuttingDown):
                await tokenizer.render_chat({"messages": [{"role": "user", "content": "Hi"}]})
            with pytest.raises(ShuttingDown):
                await engine.submit("r", "r", [0, 1], SamplingParams(max_tokens=1))
        finally:
            await tokenizer.close()
            await engine.close()

    asyncio.run(run())
