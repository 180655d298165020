"""A plain (non-streamed) request's pieces, per choice, given up as soon as its client disconnects."""

from __future__ import annotations

import asyncio

from fastapi import Request

from services.gateway.generation import Generation, Piece


async def collect_while_connected(
    request: Request, generations: list[Generation], poll_s: float = 0.25
) -> list[list[Piece]] | None:
    """Every piece of each choice of a non-streamed request; None as soon as the client disconnects (then the
    caller's ``generation.close()`` aborts it, so a vanished client does not keep the engine busy)."""

    async def one(generation: Generation) -> list[Piece]:
        return [piece async for piece in generation]

    async def collect() -> list[list[Piece]]:
        return list(await asyncio.gather(*(one(g) for g in generations)))

    task = asyncio.ensure_future(collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
