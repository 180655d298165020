"""The engine's two `ImageEncoder`s (services/engine/images/prompt.py): the multimodal service over gRPC
(`shinkai up`), and a `MultimodalApi` in this process (`shinkai serve`).

Embeddings cross the process boundary as gRPC bytes (fp32 little-endian, `multimodal.v1.EncodeResponse`).
INVALID_ARGUMENT from the service is bad input (`ImageInputError`, a 400); any other failure, a deadline
included, means the service cannot answer now (`ImageEncoderUnavailable`, a 503), never a hang.
"""

from __future__ import annotations

import logging

import grpc
import numpy as np
import torch

from observability import tracing
from services import service_auth
from services.engine.images.prompt import ImageEncoderUnavailable
from services.multimodal.preprocess import ImageInputError
from services.multimodal.service import GRPC_OPTIONS, MultimodalApi
from services.proto.multimodal.v1 import multimodal_pb2 as pb
from services.proto.multimodal.v1 import multimodal_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_ENCODE_TIMEOUT_S = 120.0  # one image's Encode, queueing behind the service's other batches included


class MultimodalClient:
    def __init__(self, address: str, timeout_s: float = DEFAULT_ENCODE_TIMEOUT_S) -> None:
        self.address = address  # host:port of the multimodal service
        self.timeout_s = timeout_s
        self.channel = service_auth.aio_channel(address, options=GRPC_OPTIONS)  # the stack's service credential
        self.stub = multimodal_pb2_grpc.MultimodalStub(self.channel)

    async def encode(self, image: bytes) -> torch.Tensor:
        try:
            reply = await self.stub.Encode(
                pb.ImageRequest(image=image), timeout=self.timeout_s, metadata=tracing.grpc_metadata()
            )
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ImageInputError(err.details() or "the multimodal service refused the image") from None
            # The client hears the status alone; the transport's text (addresses, resolver errors) goes to the log.
            log.warning("multimodal service at %s: %s (%s)", self.address, err.code().name, err.details())
            raise ImageEncoderUnavailable(
                f"the multimodal service cannot encode images now ({err.code().name}); try again shortly"
            ) from None
        num_tokens, hidden = reply.plan.num_tokens, reply.hidden_size
        if len(reply.embeddings) != 4 * num_tokens * hidden:
            raise ImageEncoderUnavailable(
                f"the multimodal service sent {len(reply.embeddings)} bytes for a [{num_tokens}, {hidden}] fp32 span"
            )
        rows = np.frombuffer(reply.embeddings, dtype="<f4").reshape(num_tokens, hidden)
        return torch.from_numpy(rows.astype(np.float32))  # a copy: the reply's buffer is read-only

    async def close(self) -> None:
        await self.channel.close()


class InProcessEncoder:
    """A `MultimodalApi` on this event loop: its cache, shared in-flight encodes and batching, no gRPC."""

    def __init__(self, api: MultimodalApi) -> None:
        self.api = api

    async def encode(self, image: bytes) -> torch.Tensor:
        entry, _, _ = await self.api.encoded(image)
        return entry.span

    async def close(self) -> None:
        pass
