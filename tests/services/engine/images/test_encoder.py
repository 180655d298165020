"""`MultimodalClient`: the multimodal service's spans arrive as the tower's own rows; its INVALID_ARGUMENT is
bad input (`ImageInputError`); a service that is not there is `ImageEncoderUnavailable` at once, never a hang."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
import torch

from services.engine.images.encoder import InProcessEncoder, MultimodalClient
from services.engine.images.prompt import ImageEncoderUnavailable
from services.multimodal.encoder_source import load_encoder
from services.multimodal.preprocess import ImageInputError
from services.multimodal.service import GRPC_OPTIONS, MultimodalApi
from tests.services.multimodal.test_service import png

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tiny_encoder():
    return load_encoder("tiny", 0)


def test_remote_spans_equal_the_in_process_api(tiny_encoder):
    cfg, encoder = tiny_encoder
    image = png(100, 80, seed=4)

    async def main():
        api = MultimodalApi(cfg, encoder)
        server = grpc.aio.server(options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers((api.handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = MultimodalClient(f"127.0.0.1:{port}")
        try:
            remote = await client.encode(image)
            local = await InProcessEncoder(MultimodalApi(cfg, encoder)).encode(image)
            with pytest.raises(ImageInputError, match="not in a supported format"):
                await client.encode(b"not an image")
            again = await client.encode(image)  # still serving after bad input
        finally:
            await client.close()
            await server.stop(None)
        return remote, local, again

    remote, local, again = asyncio.run(main())
    assert remote.dtype == torch.float32 and remote.shape == (10, cfg.hidden_size)
    assert torch.equal(remote, local) and torch.equal(again, remote)


def test_a_service_that_is_down_is_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening

        async def main():
            client = MultimodalClient(f"127.0.0.1:{port}", timeout_s=30)
            try:
                await client.encode(png(30, 30))
            finally:
                await client.close()

        with pytest.raises(ImageEncoderUnavailable) as refused:
            asyncio.run(main())
        # The client hears the status, not the transport's text or the internal address (those go to the log).
        assert str(refused.value) == "the multimodal service cannot encode images now (UNAVAILABLE); try again shortly"
