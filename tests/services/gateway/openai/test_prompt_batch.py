"""A completions batch (``prompt`` a list of prompts), as OpenAI's and vLLM's completions take it: every prompt's
choices in one answer, prompt i's choice j at index i * n + j, each equal to the prompt sent alone; one usage;
plain and streamed alike; a refused prompt queues none of the others."""

import json

import openai
import pytest

from services.gateway.openai.prompt_batch import MAX_PROMPTS, split_prompts
from tests.services.gateway.support import raw_request, wait_whole

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["The deep sea", [0, 19923, 2058], "Hello"]


def test_split_prompts():
    assert split_prompts({"prompt": "a"}) == [{"prompt": "a"}]
    assert split_prompts({"prompt": [1, 2]}) == [{"prompt": [1, 2]}]  # token ids: one prompt
    assert split_prompts({"prompt": ["a"], "n": 2}) == [{"prompt": ["a"], "n": 2}]  # a batch of one
    assert split_prompts({"prompt": ["a", [1]], "n": 2}) == [{"prompt": "a", "n": 2}, {"prompt": [1], "n": 2}]


def test_a_batch_answers_every_prompt_in_order(openai_client, served):
    common = dict(model="tiny", max_tokens=3, seed=5, n=2, logprobs=1)
    batch = openai_client.completions.create(prompt=PROMPTS, **common)
    alone = [openai_client.completions.create(prompt=p, **common) for p in PROMPTS]
    assert [c.index for c in batch.choices] == list(range(len(PROMPTS) * 2))
    assert [c.text for c in batch.choices] == [c.text for a in alone for c in a.choices]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone) == 3 * 6
    chunks = list(
        openai_client.completions.create(prompt=PROMPTS, stream=True, stream_options={"include_usage": True}, **common)
    )
    texts = {}
    for chunk in chunks[:-1]:
        assert chunk.id == chunks[0].id  # one response
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(len(batch.choices))] == [c.text for c in batch.choices]
    streamed_usage = chunks[-1].usage  # its cached_tokens differ: the plain requests filled the prefix cache
    assert (streamed_usage.prompt_tokens, streamed_usage.completion_tokens, streamed_usage.total_tokens) == (
        batch.usage.prompt_tokens,
        batch.usage.completion_tokens,
        batch.usage.total_tokens,
    )
    wait_whole(served)


def test_a_refused_prompt_refuses_the_batch_and_queues_nothing(openai_client, served):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.completions.create(model="tiny", prompt=["Hi", [0, 999999]], max_tokens=2)
    assert err.value.body["param"] == "prompt" and "outside the vocabulary" in err.value.body["message"]
    body = {"model": "tiny", "prompt": ["x"] * (MAX_PROMPTS + 1), "max_tokens": 1}
    status, data, _ = raw_request(
        served.http_url, "POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    assert status == 400 and json.loads(data)["error"]["param"] == "prompt"
    wait_whole(served)
