"""One engine request of ``n`` choices as ``n`` delta streams, one per choice.

The engine serves ``n > 1`` as one request (the prompt prefilled once, its blocks shared through the
scheduler's fork) whose deltas name their choice (`Delta.index`); each choice's own last delta carries its
finish reason. `ChoiceStreams` reads that one stream and hands each choice's deltas to its `ChoiceStream`,
so every choice gets its own detokenizer, stop strings and answer parser (a `Generation` each).

Invariants:
- one reader of the engine's stream at a time (a lock); deltas for other choices wait in their queues;
- every choice ends with exactly one delta that has a finish reason: its own, or, when the request ends
  for all of them (abort, error, shutdown: the engine stream ends), a copy of the request's last delta;
- closing a choice (its stop string matched, or its reader left) drops its later deltas; the engine's
  request is aborted (its blocks freed) once every choice is closed or finished. A stop string therefore
  ends the choice's text at once, but the engine stops generating it only with the request.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Sequence

from services.engine.finish_reason import FinishReason
from services.engine.service import Delta
from services.gateway.backends import DeltaStream
from services.gateway.generation import Generation, Piece


class ChoiceStreams:
    def __init__(self, stream: DeltaStream, num_choices: int) -> None:
        self.stream = stream  # the engine's stream of the request, all choices interleaved
        self.num_choices = num_choices
        self._queues: list[collections.deque[Delta]] = [collections.deque() for _ in range(num_choices)]
        self._finished = [False] * num_choices  # the choice's final delta was queued
        self._closed = [False] * num_choices  # its reader is done with it
        self._last: Delta | None = None  # the engine stream's latest delta
        self._num_output_tokens = [0] * num_choices  # each choice's output tokens so far
        self._ended = False  # the engine stream has no more deltas
        self._lock = asyncio.Lock()

    def choice(self, index: int) -> ChoiceStream:
        return ChoiceStream(self, index)

    async def next(self, index: int) -> Delta:
        while not self._queues[index]:
            if self._finished[index]:
                raise StopAsyncIteration
            async with self._lock:
                if self._queues[index]:
                    break
                await self._read()
        delta = self._queues[index].popleft()
        return delta

    async def _read(self) -> None:
        """Reads one delta of the engine's stream into its choice's queue; at the stream's end, ends every
        choice still open with the request's last finish reason."""
        if not self._ended:
            try:
                delta = await self.stream.__anext__()
            except StopAsyncIteration:
                self._ended = True
            else:
                self._last = delta
                self._put(delta.index, delta)
                return
        last = self._last
        for index in range(self.num_choices):
            if not self._finished[index]:
                reason = last.finish_reason if last is not None else None
                count = self._num_output_tokens[index]
                self._put(index, Delta([], [], None, count, reason or FinishReason.ABORT, None, index=index))

    def _put(self, index: int, delta: Delta) -> None:
        if self._finished[index]:
            return
        self._num_output_tokens[index] = delta.num_output_tokens
        if delta.finish_reason is not None:
            self._finished[index] = True
        if not self._closed[index]:
            self._queues[index].append(delta)

    def close(self, index: int) -> None:
        self._closed[index] = True
        self._queues[index].clear()
        self._finished[index] = True
        if all(self._closed[i] or self._finished[i] for i in range(self.num_choices)):
            self.stream.close()  # a no-op once the request has ended; an abort before


class ChoiceStream:
    """One choice's deltas (a `DeltaStream`); ``close()`` drops the rest of this choice only."""

    def __init__(self, streams: ChoiceStreams, index: int) -> None:
        self.streams = streams
        self.index = index  # which choice, 0 to n - 1

    def __aiter__(self) -> ChoiceStream:
        return self

    async def __anext__(self) -> Delta:
        return await self.streams.next(self.index)

    def close(self) -> None:
        self.streams.close(self.index)


async def merged_pieces(generations: Sequence[Generation]) -> AsyncIterator[tuple[int, Piece]]:
    """(position in ``generations``, piece) of every choice's pieces as they come; one choice is read in order
    without tasks. A choice's error is raised to the reader; leaving early cancels the pumps."""
    if len(generations) == 1:
        async for piece in generations[0]:
            yield 0, piece
        return
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, generation: Generation) -> None:
        try:
            async for piece in generation:
                await queue.put((i, piece))
        except Exception as err:  # handed to the reader, which raises it
            await queue.put((i, err))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(generations)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
