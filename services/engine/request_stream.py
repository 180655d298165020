"""One request's deltas as its caller reads them (``async for``), ending with the final one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.engine.delta import Delta
from services.engine.reporting.observer import RequestTimes


class RequestStream:
    """One request's deltas, ending with the final one. ``close()`` before the end aborts the request."""

    def __init__(
        self,
        abort: Callable[[str], None],
        request_id: str,
        client_request_id: str,
        loop: asyncio.AbstractEventLoop,
        times: RequestTimes,
        num_prompt_tokens: int = 0,
        num_choices: int = 1,
    ) -> None:
        self.abort = abort  # aborts a request by its request id (the service's ``abort_request``)
        self.times = times  # phase boundaries, written by the step thread only
        self.request_id = request_id  # unique among the live requests; the scheduler's id for it
        self.client_request_id = client_request_id  # the client's id; may repeat across live requests
        self.num_prompt_tokens = num_prompt_tokens  # the prompt as queued (each image's span expanded)
        self.loop = loop
        self.deltas: asyncio.Queue[Delta] = asyncio.Queue()
        # Output tokens already delivered as deltas (written by the step thread under the streams' lock): in all,
        # and per choice.
        self.num_sent = 0
        self.num_sent_by_choice = [0] * num_choices
        # Whether each choice's prompt logprobs were delivered (they ride on its first delta with them).
        self.prompt_logprobs_sent = [False] * num_choices
        self.num_unfinished_choices = num_choices
        # The final delta was queued; no abort is needed any more.
        self.finished = False
        # The final delta was read.
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        delta = await self.deltas.get()
        self._done = delta.last
        return delta

    def close(self) -> None:
        """Aborts the request unless its final delta was already queued. Idempotent."""
        if not self.finished:
            self.abort(self.request_id)
