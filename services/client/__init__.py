"""Python clients of Shinkai's gRPC API (shinkai.v1): `ShinkaiClient` (blocking) and `AsyncShinkaiClient`.

from services.client import ShinkaiClient

with ShinkaiClient("127.0.0.1:50051", timeout=60) as client:
    for delta in client.generate_stream("Hello", max_tokens=16, seed=1):
        print(delta.text, end="", flush=True)
    print(client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=8).text)
"""

from services.client.async_client import AsyncShinkaiClient
from services.client.errors import (
    Cancelled,
    InvalidArgument,
    MessageTooLarge,
    ModelNotFound,
    QueueFull,
    ResourceExhausted,
    ShinkaiError,
    Timeout,
    Unauthenticated,
    Unavailable,
)
from services.client.messages import Completion, TextDelta, ToolCall
from services.client.sync_client import ShinkaiClient

__all__ = [
    "AsyncShinkaiClient",
    "Cancelled",
    "Completion",
    "InvalidArgument",
    "MessageTooLarge",
    "ModelNotFound",
    "QueueFull",
    "ResourceExhausted",
    "ShinkaiClient",
    "ShinkaiError",
    "TextDelta",
    "Timeout",
    "ToolCall",
    "Unauthenticated",
    "Unavailable",
]
