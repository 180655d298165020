"""vLLM's ``prompt_logprobs`` (completions and chat) and OpenAI's completions ``echo`` with ``logprobs``, through
the `openai` client, against the full forward's log-softmax of the prompt (batch-invariant mode: ``==``)."""

import json
import urllib.request

import openai
import pytest
import torch

from tests.services.gateway.support import wait_whole

pytestmark = pytest.mark.timeout(120)

PROMPT = "The deep sea keeps its light"


def tokenize(served, body: dict) -> list[int]:
    request = urllib.request.Request(
        served.http_url + "/tokenize", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["tokens"]


def full_log_softmax(reference_llm, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p is the log-softmax of the logits after ids[: p + 1]."""
    from model.batch_invariant import batch_invariant

    with torch.no_grad(), batch_invariant():
        return torch.log_softmax(reference_llm.source.model(torch.tensor([ids])).float(), dim=-1)[0]


def strings(reference_llm, ids) -> list[str]:
    return [reference_llm.tokenizer.decode([int(t)], skip_special_tokens=False) for t in ids]


def check_vllm_shape(got: list, ids: list[int], full: torch.Tensor, num: int, reference_llm) -> None:
    """None first, then per prompt token {id: {logprob, rank, decoded_token}}: the token and the top-num."""
    assert len(got) == len(ids) and got[0] is None
    order = torch.sort(full, dim=-1, descending=True, stable=True).indices[:, :num]
    for p in range(1, len(ids)):
        entry, target = got[p], ids[p]
        top = [int(t) for t in order[p - 1]]
        assert set(entry) == {str(t) for t in [target, *top]}
        for rank, t in enumerate(top, 1):
            assert entry[str(t)] == {
                "logprob": float(full[p - 1, t]),
                "rank": rank,
                "decoded_token": strings(reference_llm, [t])[0],
            }
        assert entry[str(target)]["logprob"] == float(full[p - 1, target])
        assert entry[str(target)]["rank"] == int((full[p - 1] >= full[p - 1, target]).sum())  # vLLM's rank


def test_completion_prompt_logprobs_equal_the_full_forward(openai_client, served, reference_llm):
    ids = tokenize(served, {"prompt": PROMPT})
    full = full_log_softmax(reference_llm, ids)
    resp = openai_client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, seed=1, n=2, extra_body={"prompt_logprobs": 3}
    )
    assert len(resp.choices) == 2
    for choice in resp.choices:  # every choice carries them
        check_vllm_shape(choice.model_extra["prompt_logprobs"], ids, full, 3, reference_llm)
    plain = openai_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, seed=1)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})
    wait_whole(served)


def test_chat_prompt_logprobs_equal_the_full_forward(openai_client, served, reference_llm):
    messages = [{"role": "user", "content": "Hello there"}]
    ids = tokenize(served, {"messages": messages, "chat_template_kwargs": {"thinking": False}})
    full = full_log_softmax(reference_llm, ids)
    resp = openai_client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=2,
        extra_body={"prompt_logprobs": 0, "chat_template_kwargs": {"thinking": False}},
    )
    assert resp.usage.prompt_tokens == len(ids)
    check_vllm_shape(resp.model_extra["prompt_logprobs"], ids, full, 0, reference_llm)  # vLLM's place: the body


def test_completion_echo_with_logprobs_leads_with_the_prompts_tokens(openai_client, served, reference_llm):
    """OpenAI's shape: text = prompt + completion; tokens, token_logprobs (None first) and top_logprobs start
    with the prompt's; streamed == plain."""
    ids = tokenize(served, {"prompt": PROMPT})
    full = full_log_softmax(reference_llm, ids)
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=3, seed=4, echo=True, logprobs=2)
    plain = openai_client.completions.create(**kwargs)
    choice = plain.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert lp.tokens[: len(ids)] == strings(reference_llm, ids) and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == [float(full[p - 1, ids[p]]) for p in range(1, len(ids))]
    order = torch.sort(full, dim=-1, descending=True, stable=True).indices[:, :2]
    for p in range(1, len(ids)):
        want = {s: float(full[p - 1, t]) for s, t in zip(strings(reference_llm, order[p - 1]), order[p - 1])}
        assert lp.top_logprobs[p] == want
    assert all(len(top) == 2 for top in lp.top_logprobs[len(ids) :])
    assert "prompt_logprobs" not in (choice.model_extra or {})  # not asked for
    chunks = [c for c in openai_client.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [x for c in chunks for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    wait_whole(served)


@pytest.mark.parametrize(
    "body, match",
    [
        ({"prompt": PROMPT, "prompt_logprobs": 2, "stream": True}, "not available when stream"),
        ({"prompt": PROMPT, "prompt_logprobs": 21}, "between 0 and 20"),
        ({"prompt": PROMPT, "prompt_logprobs": "3"}, "must be an integer"),
    ],
)
def test_bad_prompt_logprobs_are_400s_naming_the_field(openai_client, body, match):
    with pytest.raises(openai.BadRequestError, match=match) as caught:
        openai_client.completions.create(model="tiny", max_tokens=1, **{"prompt": body.pop("prompt")}, extra_body=body)
    assert caught.value.body["param"] == "prompt_logprobs"


def test_echo_of_a_token_id_prompt_gives_its_text(openai_client, served):
    """lm-eval's local-completions sends token ids with echo and logprobs: the text and the logprobs lead with the
    prompt's, as for the same prompt sent as text."""
    ids = tokenize(served, {"prompt": PROMPT})
    kwargs = dict(model="tiny", max_tokens=2, seed=4, echo=True, logprobs=1)
    by_ids = openai_client.completions.create(prompt=ids, **kwargs).choices[0]
    by_text = openai_client.completions.create(prompt=PROMPT, **kwargs).choices[0]
    assert by_ids.text == by_text.text and by_ids.text.startswith(PROMPT)
    assert by_ids.logprobs.tokens == by_text.logprobs.tokens
    assert by_ids.logprobs.token_logprobs == by_text.logprobs.token_logprobs
    assert by_ids.logprobs.text_offset == by_text.logprobs.text_offset


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(openai_client, served, reference_llm, stream):
    """vLLM's scoring request: echo, logprobs and max_tokens 0 answer the prompt's text and logprobs, nothing
    generated, usage.completion_tokens 0."""
    ids = tokenize(served, {"prompt": PROMPT})
    full = full_log_softmax(reference_llm, ids)
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    if stream:
        chunks = list(openai_client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        token_logprobs = [x for c in chunks if c.choices for x in c.choices[0].logprobs.token_logprobs]
    else:
        reply = openai_client.completions.create(**kwargs)
        usage, text, token_logprobs = reply.usage, reply.choices[0].text, reply.choices[0].logprobs.token_logprobs
    assert text == PROMPT
    assert token_logprobs == [None, *(float(full[p - 1, ids[p]]) for p in range(1, len(ids)))]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 0)
    wait_whole(served)


def test_max_tokens_0_without_echo_is_still_a_400(openai_client):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"
