"""Fairness across tenants, measured: a light key's small requests' TTFT alone, beside one key and beside two keys
sending long prompts back to back, then a key over its live-request limit (docs/operations.md, "Fairness
across clients").

    python scripts/diagnostics/fairness.py [--seconds 20] [--prompt-tokens 3900] [--json out.json]
    python scripts/diagnostics/fairness.py --url http://127.0.0.1:8000 --keys heavy-1,heavy-2,light,flood

Without ``--url`` it starts an in-process `shinkai serve` of the tiny model at ``--max-num-batched-tokens``
(default 256) and ``--max-model-len`` (default 8,192: the engine's start, its warm-up included, scales with it) with
four API keys and ``--max-requests-per-tenant`` (default 8); with ``--url`` it drives a
running server (`shinkai up ... --api-key heavy-1,heavy-2,light,flood`), whose limit is given by the same flag.
Long prompts and small ones are token ids (no tokenizer cost); every request streams over HTTP, and a TTFT is
the time to the first streamed token. Prints one line per phase and the ratio of each p99 to the baseline's.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def stream_ttft(url: str, key: str, prompt: list[int], max_tokens: int) -> tuple[int, float | None]:
    """(HTTP status, seconds to the first token, None when there was none) of one streamed completion."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(body),
            {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        response = conn.getresponse()
        if response.status != 200:
            response.read()
            return response.status, None
        ttft = None
        for line in response:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.monotonic() - start
        return 200, ttft
    except OSError:
        return 0, None
    finally:
        conn.close()


class Phase:
    def __init__(self, url: str, keys: list[str], num_heavy: int, args: argparse.Namespace) -> None:
        self.url, self.keys, self.num_heavy, self.args = url, keys, num_heavy, args
        self.stop = threading.Event()
        self.ttfts: list[float] = []
        self.num_failed = 0
        self.num_heavy_done = 0
        self.num_heavy_failed = 0

    def heavy(self, key: str, offset: int) -> None:
        k = 0
        while not self.stop.is_set():
            prompt = [3 + (offset + k + i) % 90 for i in range(self.args.prompt_tokens)]
            status, ttft = stream_ttft(self.url, key, prompt, 1)
            if status == 200 and ttft is not None:
                self.num_heavy_done += 1
            else:
                self.num_heavy_failed += 1
            k += 1

    def light(self) -> None:
        k = 0
        while not self.stop.is_set():
            status, ttft = stream_ttft(self.url, self.keys[2], [3 + (k + i) % 90 for i in range(16)], 1)
            if status == 200 and ttft is not None:
                self.ttfts.append(ttft)
            else:
                self.num_failed += 1
            k += 1
            time.sleep(self.args.gap)

    def run(self) -> dict:
        threads = [threading.Thread(target=self.heavy, args=(self.keys[i], 1000 * i)) for i in range(self.num_heavy)]
        for t in threads:
            t.start()
        time.sleep(self.args.warmup if self.num_heavy else 0)
        light = threading.Thread(target=self.light)
        light.start()
        time.sleep(self.args.seconds)
        self.stop.set()
        light.join()
        for t in threads:
            t.join()
        ordered = sorted(self.ttfts)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None
        return {
            "num_heavy_keys": self.num_heavy,
            "num_small": len(ordered),
            "num_small_failed": self.num_failed,
            "small_ttft_p50_s": statistics.median(ordered) if ordered else None,
            "small_ttft_p99_s": p99,
            "num_long_prompts_done": self.num_heavy_done,
            "num_long_prompts_failed": self.num_heavy_failed,
        }


def over_limit(url: str, key: str, limit: int, prompt_tokens: int) -> dict:
    """``limit`` + 1 concurrent long requests of one key: the requests past the limit get 429."""
    statuses: list[int] = []
    lock = threading.Lock()

    def one(k: int) -> None:
        status, _ = stream_ttft(url, key, [3 + (k + i) % 90 for i in range(prompt_tokens)], 64)
        with lock:
            statuses.append(status)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(limit + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"num_sent": limit + 1, "num_429": statuses.count(429), "num_200": statuses.count(200)}


def in_process_server(args: argparse.Namespace, keys: list[str]):
    from services.gateway.admission import AdmissionLimits
    from services.gateway.server import ServeConfig, Server

    config = ServeConfig(
        model="tiny",
        http_port=0,
        grpc_port=0,
        drain_timeout_s=10,
        api_keys=tuple(keys),
        engine_args={"max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len},
        admission=AdmissionLimits(max_requests=args.max_requests_per_tenant),
    )
    server = Server(config)
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    assert ready.wait(120), "the server did not start"

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)

    return server.urls()["http"], stop


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server's HTTP URL; default: an in-process tiny server")
    p.add_argument("--keys", default="heavy-1,heavy-2,light,flood", help="four API keys: two heavy, light, flood")
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=8192, help="the in-process server's (above the prompts)")
    p.add_argument("--max-requests-per-tenant", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=3900, help="the heavy keys' prompt length")
    p.add_argument("--seconds", type=float, default=20.0, help="each phase's measured time")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds the heavy keys run before measuring")
    p.add_argument("--gap", type=float, default=0.1, help="seconds between the light key's requests")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    keys = args.keys.split(",")
    stop = None
    url = args.url
    if url is None:
        started = time.monotonic()
        url, stop = in_process_server(args, keys)
        print(f"in-process server ready in {time.monotonic() - started:.1f} s", flush=True)
    try:
        stream_ttft(url, keys[2], [3, 4, 5], 2)  # warm-up
        phases = []
        for n in (0, 1, 2):
            phases.append(Phase(url, keys, n, args).run())
            print(f"phase with {n} heavy keys measured: {phases[-1]['num_small']} small requests", flush=True)
        limit = over_limit(url, keys[3], args.max_requests_per_tenant, 512)
    finally:
        if stop is not None:
            stop()
    base = phases[0]["small_ttft_p99_s"]
    for phase in phases:
        phase["p99_over_baseline"] = phase["small_ttft_p99_s"] / base if base and phase["small_ttft_p99_s"] else None
    if args.json:  # before the lines: a phase without one small request's TTFT still leaves its figures
        args.json.write_text(json.dumps({"phases": phases, "over_limit": limit, "args": vars(args) | {"json": None}}))
    for phase in phases:
        print(
            f"{phase['num_heavy_keys']} heavy keys: {phase['num_small']} small requests, "
            f"{phase['num_small_failed']} failed, TTFT p50 {_figure(phase['small_ttft_p50_s'], '.3f')} s "
            f"p99 {_figure(phase['small_ttft_p99_s'], '.3f')} s "
            f"({_figure(phase['p99_over_baseline'], '.2f')}x the baseline's p99); "
            f"{phase['num_long_prompts_done']} long prompts done, {phase['num_long_prompts_failed']} failed"
        )
    print(f"over the limit: {limit['num_sent']} concurrent requests of one key, {limit['num_429']} got 429")
    return 0


def _figure(value: float | None, spec: str) -> str:
    """``value`` formatted, or "none" where the phase had no TTFT to measure."""
    return "none" if value is None else format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
