"""Concurrent OpenAI streaming completions, shared by the gateway and the stack tests."""

from __future__ import annotations

import asyncio

import openai


def concurrent_completion_streams(base_url: str, num_streams: int = 100) -> list[tuple[int, int, str]]:
    """Streams `num_streams` completions of 1–3 tokens at once; per stream (asked, counted, finish reason)."""

    async def run():
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

        async def one(i):
            n = 1 + i % 3
            stream = await client.completions.create(
                model="tiny",
                prompt=f"s{i}",
                max_tokens=n,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            chunks = [c async for c in stream]
            return n, chunks[-1].usage.completion_tokens, [c.choices[0].finish_reason for c in chunks if c.choices][-1]

        try:
            return await asyncio.gather(*(one(i) for i in range(num_streams)))
        finally:
            await client.close()

    return asyncio.run(run())
