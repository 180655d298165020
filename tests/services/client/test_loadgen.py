"""The load generator: token-id prompts fixed per request index, of the asked length, in the vocabulary,
and distinct from the first token on (no shared prefixes for the prefix cache to exploit); seeded Poisson arrivals;
the client's first-request imports done before the clock starts."""

import subprocess
import sys

import pytest

from services.client.loadgen import arrival_times, prompt_ids


def test_prompt_ids_are_fixed_sized_in_range_and_distinct():
    prompts = [prompt_ids(i, 512) for i in range(64)]
    assert prompts[5] == prompt_ids(5, 512) and all(len(p) == 512 for p in prompts)
    assert all(1000 <= t < 100_000 for p in prompts for t in p)
    assert len({p[0] for p in prompts}) == 64
    assert prompt_ids(3, 8, vocab_size=2000) != prompt_ids(3, 8)


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    times = arrival_times(2000, 10.0, seed=3)
    assert times == arrival_times(2000, 10.0, seed=3) and times != arrival_times(2000, 10.0, seed=4)
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:]))
    # 1,999 exponential gaps of mean 0.1 s: 199.9 s, standard deviation 4.5 s; five of them either side.
    assert 177 < times[-1] < 222
    assert arrival_times(3, None) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request-rate"):
        arrival_times(3, 0.0)


_LOAD = """
import asyncio, sys
import openai
from services.client.loadgen import load_client

lazy = ("openai.resources.completions", "anyio._backends._asyncio")
assert not any(m in sys.modules for m in lazy)
asyncio.run(load_client(openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused", max_retries=0)))
print(all(m in sys.modules for m in lazy))
"""


def test_the_client_loads_what_its_first_request_would_before_any_is_timed():
    """In a fresh interpreter (this one may hold them already); nothing is sent (nothing listens at port 9)."""
    from services.entrypoints.stack import ROOT

    done = subprocess.run([sys.executable, "-c", _LOAD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_a_run_numbers_its_requests_from_first_request(monkeypatch):
    """A second run from another number sends prompts the first did not (none resumes from the prefix cache)."""
    import asyncio

    from services.client import loadgen

    sent: list = []

    async def one(client, model, prompt, max_tokens):
        sent.append(prompt)
        return loadgen.Sample(ok=True, ttft_s=0.01, num_tokens=max_tokens)

    async def loaded(client):
        return None

    monkeypatch.setattr(loadgen, "one", one)
    monkeypatch.setattr(loadgen, "load_client", loaded)
    out = asyncio.run(loadgen.run("http://127.0.0.1:9/v1", "m", 3, 3, 4, prompt_tokens=16, first_request=1000))
    assert out["ok"] == 3 and sorted(sent) == sorted(prompt_ids(i, 16) for i in (1000, 1001, 1002))
    sent.clear()
    asyncio.run(loadgen.run("http://127.0.0.1:9/v1", "m", 2, 1, 4))
    assert sent == ["Request 0: tell me about the deep sea.", "Request 1: tell me about the deep sea."]
