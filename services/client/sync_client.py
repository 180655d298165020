"""Blocking gRPC client of shinkai.v1.

    with ShinkaiClient("127.0.0.1:50051") as client:
        for delta in client.generate_stream("Hello", max_tokens=8):
            print(delta.text, end="", flush=True)

Every failure raises a `ShinkaiError` subclass (services.client.errors). ``timeout`` (seconds) is a
deadline for the whole call; when it passes the server aborts the request and `Timeout` is raised.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from services.client.errors import from_rpc_error
from services.client.messages import Completion, TextDelta, add_to, generate_request, to_delta
from services.proto.shinkai.v1 import shinkai_pb2 as pb
from services.proto.shinkai.v1 import shinkai_pb2_grpc


class ShinkaiClient:
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
            grpc.insecure_channel(target)
            if tls_root_certificates is None
            else grpc.secure_channel(target, grpc.ssl_channel_credentials(tls_root_certificates or None))
        )
        self.stub = shinkai_pb2_grpc.ShinkaiStub(self.channel)
        self.timeout = timeout  # default deadline of every call, seconds; None: none
        # Sent with every call: the server's --api-key (None: none sent).
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def __enter__(self) -> ShinkaiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> Iterator[pb.GenerateResponse]:
        call = self.stub.Generate(
            request, timeout=timeout if timeout is not None else self.timeout, metadata=self.metadata
        )
        try:
            yield from call
        except grpc.RpcError as err:
            raise from_rpc_error(err, call.trailing_metadata()) from None
        finally:
            call.cancel()  # leaving early cancels the stream, which aborts the request on the server

    def generate_stream(
        self, prompt: Any = None, *, timeout: float | None = None, client_request_id: str | None = None, **kwargs: Any
    ) -> Iterator[TextDelta]:
        """Yields text deltas; the last has ``finish_reason``. Closing the iterator aborts the request."""
        request = generate_request(prompt, client_request_id=client_request_id, **kwargs)
        for response in self._stream(request, timeout):
            yield to_delta(response)

    def generate(
        self, prompt: Any = None, *, timeout: float | None = None, client_request_id: str | None = None, **kwargs: Any
    ) -> Completion:
        """One whole generation (``n`` = 1; `generate_choices` takes n > 1)."""
        if (kwargs.get("n") or 1) != 1:
            raise ValueError("generate returns one choice: use generate_choices for n > 1")
        return (self.generate_choices(prompt, timeout=timeout, client_request_id=client_request_id, **kwargs))[0]

    def generate_choices(
        self, prompt: Any = None, *, timeout: float | None = None, client_request_id: str | None = None, **kwargs: Any
    ) -> list[Completion]:
        """Each of the request's ``n`` choices whole, in index order."""
        request = generate_request(prompt, client_request_id=client_request_id, **kwargs)
        completions: list[Completion] = []
        for response in self._stream(request, timeout):
            add_to(completions, response, request.client_request_id)
        return completions or [Completion("", request.client_request_id, "")]

    def abort(self, client_request_id: str, *, timeout: float | None = None) -> bool:
        """True if a live request with this client_request_id was aborted; False if there was none (idempotent)."""
        try:
            return self.stub.Abort(
                pb.AbortRequest(client_request_id=client_request_id),
                timeout=timeout or self.timeout,
                metadata=self.metadata,
            ).found
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        try:
            return self.stub.GetModelInfo(
                pb.GetModelInfoRequest(), timeout=timeout or self.timeout, metadata=self.metadata
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def loads(self, *, timeout: float | None = None) -> pb.Loads:
        try:
            return self.stub.GetLoads(pb.GetLoadsRequest(), timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
