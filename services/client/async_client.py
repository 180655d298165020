"""asyncio gRPC client of shinkai.v1 (grpc.aio); the same surface as `ShinkaiClient`, awaited.

async with AsyncShinkaiClient("127.0.0.1:50051") as client:
    async for delta in client.generate_stream("Hello", max_tokens=8):
        print(delta.text, end="")
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.client.errors import from_rpc_error
from services.client.messages import Completion, TextDelta, add_to, generate_request, to_delta
from services.proto.shinkai.v1 import shinkai_pb2 as pb
from services.proto.shinkai.v1 import shinkai_pb2_grpc


class AsyncShinkaiClient:
    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        api_key: str | None = None,
        tls_root_certificates: bytes | None = None,
    ) -> None:
        # TLS when the server has --ssl-certfile: these PEM roots (b"": the system's) verify it.
        self.channel = (
            grpc.aio.insecure_channel(target)
            if tls_root_certificates is None
            else grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(tls_root_certificates or None))
        )
        self.stub = shinkai_pb2_grpc.ShinkaiStub(self.channel)
        self.timeout = timeout  # default deadline of every call, seconds; None: none
        # Sent with every call: the server's --api-key (None: none sent).
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    async def __aenter__(self) -> AsyncShinkaiClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncIterator[pb.GenerateResponse]:
        call = self.stub.Generate(
            request, timeout=timeout if timeout is not None else self.timeout, metadata=self.metadata
        )
        try:
            async for response in call:
                yield response
        except grpc.RpcError as err:
            raise from_rpc_error(err, await call.trailing_metadata()) from None
        finally:
            call.cancel()  # leaving early cancels the stream, which aborts the request on the server

    async def generate_stream(
        self, prompt: Any = None, *, timeout: float | None = None, client_request_id: str | None = None, **kwargs: Any
    ) -> AsyncIterator[TextDelta]:
        request = generate_request(prompt, client_request_id=client_request_id, **kwargs)
        async for response in self._stream(request, timeout):
            yield to_delta(response)

    async def generate(
        self, prompt: Any = None, *, timeout: float | None = None, client_request_id: str | None = None, **kwargs: Any
    ) -> Completion:
        """One whole generation (``n`` = 1; `generate_choices` takes n > 1)."""
        if (kwargs.get("n") or 1) != 1:
            raise ValueError("generate returns one choice: use generate_choices for n > 1")
        return (await self.generate_choices(prompt, timeout=timeout, client_request_id=client_request_id, **kwargs))[0]

    async def generate_choices(
        self, prompt: Any = None, *, timeout: float | None = None, client_request_id: str | None = None, **kwargs: Any
    ) -> list[Completion]:
        """Each of the request's ``n`` choices whole, in index order."""
        request = generate_request(prompt, client_request_id=client_request_id, **kwargs)
        completions: list[Completion] = []
        async for response in self._stream(request, timeout):
            add_to(completions, response, request.client_request_id)
        return completions or [Completion("", request.client_request_id, "")]

    async def abort(self, client_request_id: str, *, timeout: float | None = None) -> bool:
        try:
            response = await self.stub.Abort(
                pb.AbortRequest(client_request_id=client_request_id),
                timeout=timeout or self.timeout,
                metadata=self.metadata,
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return response.found

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        try:
            return await self.stub.GetModelInfo(
                pb.GetModelInfoRequest(), timeout=timeout or self.timeout, metadata=self.metadata
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def loads(self, *, timeout: float | None = None) -> pb.Loads:
        try:
            return await self.stub.GetLoads(
                pb.GetLoadsRequest(), timeout=timeout or self.timeout, metadata=self.metadata
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
