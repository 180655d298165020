"""Concurrent encodes batched into one vision-tower call.

A call queues its preprocessed image and waits. Whenever the tower is idle, everything queued (up to
``max_images``) goes into one call, run on a worker thread so the event loop keeps answering health and
other RPCs; calls arriving meanwhile form the next batch. A batch that fails fails each of its calls with
that error, and the batcher keeps serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from services.multimodal.preprocess import PreparedImage


class EncodeBatcher:
    def __init__(
        self,
        run: Callable[[list[PreparedImage]], list[torch.Tensor]],
        max_images: int = 8,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        """``run`` maps a batch of images to their spans (same order); ``on_batch(num_images, seconds)``
        is told about each batch that succeeded."""
        if max_images < 1:
            raise ValueError(f"max_images must be at least 1, got {max_images}")
        self.run = run
        self.max_images = max_images
        self.on_batch = on_batch
        self._queue: list[tuple[PreparedImage, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None

    async def encode(self, image: PreparedImage) -> torch.Tensor:
        """The span of ``image`` [num_tokens, D]."""
        future = asyncio.get_running_loop().create_future()
        self._queue.append((image, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            batch, self._queue = self._queue[: self.max_images], self._queue[self.max_images :]
            start = loop.time()
            try:
                spans = await asyncio.to_thread(self.run, [image for image, _ in batch])
            except Exception as err:  # noqa: BLE001 - handed to every caller of the batch
                for _, future in batch:
                    if not future.done():
                        future.set_exception(err)
                continue
            if self.on_batch is not None:
                self.on_batch(len(batch), loop.time() - start)
            for (_, future), span in zip(batch, spans):
                if not future.done():
                    future.set_result(span)
