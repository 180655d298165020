"""One client looping near-limit prompts keeps the tokenizer busy, yet health and a normal request are
answered; a prompt whose bytes prove it over the context is refused before encoding."""

import json
import time

import pytest

from services.bench.isolation import attack_text, measure
from tests.services.gateway.test_bad_input import post

pytestmark = pytest.mark.timeout(120)


def test_health_and_normal_requests_are_answered_while_the_tokenizer_is_busy(served):
    figures = measure(served.http_url, seconds=3.0, num_attackers=1)
    print(f"ISOLATION {json.dumps(figures)}")
    loaded = figures["loaded"]
    assert set(figures["attack_codes"]) == {400}  # encoded in full, then refused as over the context: never 503
    assert sum(figures["attack_codes"].values()) >= 1
    assert set(loaded["codes"]) == {200, "health 200"}
    # Before the pool, a normal request waited out each 1-3 s encoding; the benchmark in docs/serving.md has
    # the measured ratio. This bound only catches a normal request queued behind an attack prompt again.
    assert loaded["max_s"] < 1.0 and loaded["health_max_s"] < 0.5, figures


def test_a_prompt_over_the_context_by_its_bytes_is_refused_before_encoding(served):
    body = json.dumps({"model": "tiny", "prompt": attack_text(3 << 20), "max_tokens": 1}).encode()
    start = time.monotonic()  # 3 MiB: at least 24,576 tokens at 128 bytes a token, over the 4,096 context
    code, reply, _ = post(served.http_url, "/v1/completions", body)
    elapsed = time.monotonic() - start
    assert code == 400 and reply["error"]["param"] == "prompt", reply
    assert "at least 24576 tokens" in reply["error"]["message"]
    assert elapsed < 1.0  # encoding 3 MiB takes several seconds on this machine


def test_a_chat_over_the_context_by_its_bytes_is_refused_before_rendering(served):
    body = {"model": "tiny", "messages": [{"role": "user", "content": attack_text(1 << 20)}], "max_tokens": 1}
    code, reply, _ = post(served.http_url, "/v1/chat/completions", body)
    assert code == 400 and reply["error"]["param"] == "messages" and "at least" in reply["error"]["message"], reply
