"""Remote backends turn an unreachable service into ShuttingDown (a 503 / UNAVAILABLE), never a 500, and a
Detokenize stream whose service died into DetokenizerLost."""

import asyncio
import socket

import grpc
import pytest

from services.engine import SamplingParams
from services.engine.service import ShuttingDown
from services.gateway.backends import DetokenizerLost
from services.gateway.remote import RemoteEngine, RemoteTokenizer
from services.tokenizer.service import TokenizerApi, load_vocabulary

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


def test_a_detokenize_stream_whose_service_dies_raises_detokenizer_lost():
    """The tokenizer service stopping mid-stream breaks the Detokenize call: push says DetokenizerLost (the
    request then ends with finish reason error), never an RPC error or asyncio's InvalidStateError."""

    async def run():
        vocabulary, bos = load_vocabulary("tiny")
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((TokenizerApi(vocabulary, bos).handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        tokenizer = RemoteTokenizer(f"127.0.0.1:{port}")
        try:
            ids = await tokenizer.encode("Hello there")
            detokenizer = tokenizer.detokenizer()
            assert await detokenizer.push(ids[1:2])  # the stream works
            await server.stop(0)
            with pytest.raises(DetokenizerLost, match="Detokenize"):
                for _ in range(3):  # the write may still be taken before the break is seen
                    await detokenizer.push(ids[2:3])
                await detokenizer.finish()
            detokenizer.close()
        finally:
            await tokenizer.close()

    asyncio.run(run())
