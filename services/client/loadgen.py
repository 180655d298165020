"""A bounded load run against a Shinkai HTTP endpoint with the openai client (SSE streaming).

    python -m services.client.loadgen --url http://127.0.0.1:8000/v1 --num-requests 200 --concurrency 32

Sends ``--num-requests`` completions, at most ``--concurrency`` in flight, each streaming ``--max-tokens``
tokens (ignore_eos, so every request has the same length); with ``--request-rate`` they arrive as a Poisson
process of that many requests per second (seeded exponential gaps; an arrival past the concurrency cap waits
for a slot, and its TTFT counts from when it is sent), else all at once. Prints one JSON line: requests ok and failed,
duration, output tokens per second, and TTFT and ITL percentiles in milliseconds. TTFT is measured from
sending the request to the first chunk with text or tokens; ITL is the gap between consecutive chunks
divided by the tokens they carried. Only loopback URLs are meant here; the run stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class Sample:
    ok: bool  # finished with the requested token count
    ttft_s: float | None = None  # to the first token
    itl_s: list[float] = field(default_factory=list)  # per token after the first
    num_tokens: int = 0
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def one(client, model: str, prompt: str | list[int], max_tokens: int) -> Sample:
    start = time.perf_counter()
    sample = Sample(ok=False)
    last = None
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                sample.num_tokens = chunk.usage.completion_tokens
            if not chunk.choices or not chunk.choices[0].text:
                continue
            if last is None:
                sample.ttft_s = now - start
            else:
                sample.itl_s.append(now - last)
            last = now
        sample.ok = sample.num_tokens == max_tokens
        if not sample.ok:
            sample.error = f"{sample.num_tokens} tokens of {max_tokens}"
    except Exception as err:  # a failed request is counted, never fatal to the run
        sample.error = f"{type(err).__name__}: {err}"
    return sample


def prompt_ids(i: int, num_tokens: int, vocab_size: int = 100_000) -> list[int]:
    """Request ``i``'s prompt of ``num_tokens`` token ids, the same on every call (offline runs reuse it):
    ids in [1000, vocab_size), distinct across requests so no two prompts share a prefix."""
    return [1000 + (7919 * i + 104_729 * j + j * j) % (vocab_size - 1000) for j in range(num_tokens)]


def arrival_times(num_requests: int, request_rate: float | None, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request arrives: a Poisson process of ``request_rate`` per second
    (exponential gaps from ``seed``; the first at 0), or all at 0 when the rate is None."""
    if request_rate is None:
        return [0.0] * num_requests
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}")
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(request_rate)
    return times


async def load_client(client) -> None:
    """What the client loads on its first request, loaded before the clock starts, so a run's first TTFT is the
    server's and not this process's imports: its completions resource (a lazy attribute) and the asyncio backend of
    anyio, which its HTTP transport runs on (~20 ms of imports on a CPU core). Sends nothing."""
    import anyio

    client.completions  # noqa: B018 - the access imports it
    await anyio.sleep(0)


async def run(
    url: str,
    model: str,
    num_requests: int,
    concurrency: int,
    max_tokens: int,
    prompt_tokens: int | None = None,
    request_rate: float | None = None,
    seed: int = 0,
    first_request: int = 0,
) -> dict:
    """``prompt_tokens`` None: a short text prompt per request; else ``prompt_ids(i, prompt_tokens)``, with the
    requests numbered from ``first_request`` (a later run from another number sends prompts the server has not seen,
    so none resumes from its prefix cache). ``request_rate``: Poisson arrivals at that many requests per second
    (``arrival_times``); None: all at once."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    await load_client(client)
    gate = asyncio.Semaphore(concurrency)
    arrivals = arrival_times(num_requests, request_rate, seed)

    async def gated(i: int) -> Sample:
        await asyncio.sleep(arrivals[i] - (time.perf_counter() - start))
        async with gate:
            n = first_request + i
            prompt = (
                f"Request {n}: tell me about the deep sea." if prompt_tokens is None else prompt_ids(n, prompt_tokens)
            )
            return await one(client, model, prompt, max_tokens)

    start = time.perf_counter()
    samples = await asyncio.gather(*(gated(i) for i in range(num_requests)))
    duration = time.perf_counter() - start
    await client.close()
    ttft = [s.ttft_s for s in samples if s.ttft_s is not None]
    itl = [x for s in samples for x in s.itl_s]
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    return {
        "url": url,
        "model": model,
        "num_requests": num_requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "prompt_tokens": prompt_tokens,
        "request_rate": request_rate,
        "ok": sum(s.ok for s in samples),
        "failed": sum(not s.ok for s in samples),
        "duration_s": round(duration, 2),
        "output_tokens_per_s": round(sum(s.num_tokens for s in samples) / duration, 1),
        "ttft_ms_p50": ms(percentile(ttft, 50)),
        "ttft_ms_p99": ms(percentile(ttft, 99)),
        "itl_ms_p50": ms(percentile(itl, 50)),
        "itl_ms_p99": ms(percentile(itl, 99)),
        "ttft_ms_mean": ms(statistics.fmean(ttft)) if ttft else None,
        "errors": sorted({s.error for s in samples if s.error})[:5],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.client.loadgen", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the OpenAI base URL (loopback)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="prompts of this many token ids (prompt_ids) instead of a short text",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals at this many requests per second (default: all at once)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    p.add_argument(
        "--first-request",
        type=int,
        default=0,
        help="number the requests (and so their prompts) from this one: another run's prompts, unseen by the server",
    )
    args = p.parse_args(argv)
    if args.first_request < 0:
        p.error(f"--first-request is at least 0; got {args.first_request}")
    result = run(
        args.url,
        args.model,
        args.num_requests,
        args.concurrency,
        args.max_tokens,
        args.prompt_tokens,
        args.request_rate,
        args.seed,
        args.first_request,
    )
    print(json.dumps(asyncio.run(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
