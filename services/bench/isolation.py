"""One client must not starve the rest: a normal request's latency, idle and while attackers keep the
tokenizer busy with near-limit prompts.

    python -m services.bench.isolation --url http://127.0.0.1:8000 [--seconds 20] [--attackers 1]

Each attacker loops POSTing a text prompt of ``--attack-bytes`` (default: just under what the byte bound lets
through to the encoder for the tiny model's context, so each one is encoded in full and then refused). Meanwhile
one client sends normal 1-token completions back to back and polls /health. Prints one JSON line: latencies
(seconds) idle and under load, their ratio, and every status code each side got.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from typing import Any

NORMAL = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
# 4,095 tokens of the tiny model's context at 128 bytes per token (V4.1's longest), less a margin.
DEFAULT_ATTACK_BYTES = 500_000


def post(url: str, body: dict[str, Any] | bytes, api_key: str | None = None, timeout: float = 60) -> int:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/completions", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as err:
        err.read()
        return err.code


def get(url: str, timeout: float = 60) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def attack_text(num_bytes: int, seed: int = 0) -> str:
    """Plain words: the encoder's full cost (no long runs that merge into few tokens)."""
    rng = random.Random(seed)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo"]
    out: list[str] = []
    size = 0
    while size < num_bytes:
        word = rng.choice(words) + rng.choice(" ,.;")
        out.append(word)
        size += len(word)
    return "".join(out)[:num_bytes]


def _normal_phase(url: str, model: str, seconds: float, api_key: str | None) -> dict[str, Any]:
    latencies, health, codes = [], [], Counter()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.monotonic()
        codes[post(url, {**NORMAL, "model": model}, api_key)] += 1
        latencies.append(time.monotonic() - start)
        start = time.monotonic()
        codes[f"health {get(url + '/health')}"] += 1
        health.append(time.monotonic() - start)
    return {
        "num": len(latencies),
        "mean_s": round(statistics.fmean(latencies), 4),
        "p50_s": round(statistics.median(latencies), 4),
        "max_s": round(max(latencies), 4),
        "health_max_s": round(max(health), 4),
        "codes": dict(codes),
    }


def measure(
    url: str,
    model: str = "tiny",
    seconds: float = 10.0,
    num_attackers: int = 1,
    attack_bytes: int = DEFAULT_ATTACK_BYTES,
    api_key: str | None = None,
) -> dict[str, Any]:
    post(url, {**NORMAL, "model": model}, api_key)  # warm-up
    idle = _normal_phase(url, model, seconds, api_key)
    stop = threading.Event()
    attack_codes: Counter = Counter()
    # Encoded once: the attackers share this process (and its GIL) with the measured client.
    body = json.dumps({"model": model, "prompt": attack_text(attack_bytes), "max_tokens": 1}).encode()

    def attack() -> None:
        while not stop.is_set():
            attack_codes[post(url, body, api_key)] += 1

    attackers = [threading.Thread(target=attack, daemon=True) for _ in range(num_attackers)]
    for t in attackers:
        t.start()
    time.sleep(0.5)  # the attackers' first prompts are in the encoder
    try:
        loaded = _normal_phase(url, model, seconds, api_key)
    finally:
        stop.set()
        for t in attackers:
            t.join(120)
    return {
        "idle": idle,
        "loaded": loaded,
        "ratio_mean": round(loaded["mean_s"] / idle["mean_s"], 2),
        "num_attackers": num_attackers,
        "attack_bytes": attack_bytes,
        "attack_codes": dict(attack_codes),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.bench.isolation", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's HTTP base URL")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each phase, idle and loaded")
    p.add_argument("--attackers", type=int, default=1, help="clients looping near-limit prompts")
    p.add_argument("--attack-bytes", type=int, default=DEFAULT_ATTACK_BYTES)
    p.add_argument("--api-key", default=None)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.url, args.model, args.seconds, args.attackers, args.attack_bytes, args.api_key)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
