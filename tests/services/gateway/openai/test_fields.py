"""Every request field of OpenAI's schema (the pinned `openai` client's request types) and vLLM's is served or
refused with a 400 naming it; none is ignored.

vLLM's fields are those of ``ChatCompletionRequest`` and ``CompletionRequest`` in
vllm/entrypoints/openai/protocol.py at vLLM commit 0052bed36509c7a5a2d8e48265334e40cf2f5a0e (the v0.10 series),
with ``structured_outputs``, which later vLLM (v0.11 on) serves in place of guided_*, and ``return_token_ids``.
"""

import json
import typing

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from services.gateway.openai import fields
from tests.services.gateway.support import raw_request

pytestmark = pytest.mark.timeout(120)

VLLM_CHAT = """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n
presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice
reasoning_effort include_reasoning parallel_tool_calls user best_of use_beam_search top_k min_p repetition_penalty
length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens prompt_logprobs allowed_token_ids bad_words echo
add_generation_prompt continue_final_message add_special_tokens documents chat_template chat_template_kwargs
mm_processor_kwargs guided_json guided_regex guided_choice guided_grammar structural_tag guided_decoding_backend
guided_whitespace_pattern priority request_id logits_processors return_tokens_as_token_ids cache_salt
kv_transfer_params vllm_xargs structured_outputs return_token_ids""".split()
VLLM_COMPLETION = """model prompt prompt_embeds best_of echo frequency_penalty logit_bias logprobs max_tokens n
presence_penalty seed stop stream stream_options suffix temperature top_p user use_beam_search top_k min_p
repetition_penalty length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens allowed_token_ids prompt_logprobs add_special_tokens
response_format guided_json guided_regex guided_choice guided_grammar guided_decoding_backend
guided_whitespace_pattern priority request_id logits_processors return_tokens_as_token_ids cache_salt
kv_transfer_params vllm_xargs structured_outputs return_token_ids""".split()


def openai_fields(module) -> set[str]:
    names = set(typing.get_type_hints(module.CompletionCreateParamsBase, include_extras=True))
    return names | set(typing.get_type_hints(module.CompletionCreateParamsStreaming))


SCHEMAS = {
    "chat": openai_fields(chat_params) | set(VLLM_CHAT),
    "completions": openai_fields(completion_params) | set(VLLM_COMPLETION),
}
BASE = {
    "chat": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "completions": {"model": "tiny", "prompt": "Hi", "max_tokens": 2},
}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
# A value that asks for something (never the field's no-op), per field; per endpoint where they differ.
SAMPLES = {
    "messages": [{"role": "user", "content": "Hello"}],
    "model": "tiny",
    "prompt": "Hello",
    "max_tokens": 3,
    "max_completion_tokens": 3,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "seed": 3,
    "n": 2,
    "best_of": 2,
    "stop": ["zz"],
    "stop_token_ids": [5],
    "include_stop_str_in_output": True,
    "ignore_eos": True,
    "logit_bias": {"5": 1},
    "logprobs": {"chat": True, "completions": 1},
    "top_logprobs": 2,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "repetition_penalty": 1.1,
    "min_p": 0.1,
    "min_tokens": 1,
    "prompt_logprobs": 1,
    "priority": 1,
    "request_id": "field-walk",
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "user": "u",
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "echo": True,
    "tools": [TOOL],
    "tool_choice": "none",
    "parallel_tool_calls": False,
    "reasoning_effort": "low",
    "include_reasoning": False,
    "chat_template_kwargs": {"thinking": False},
    "response_format": {"type": "json_object"},
    "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto",
    "functions": [{"name": "f"}],
    "metadata": {"k": "v"},
    "modalities": ["text", "audio"],
    "moderation": {"model": "x"},
    "prediction": {"type": "content", "content": "x"},
    "prompt_cache_options": {},
    "prompt_cache_retention": "24h",
    "service_tier": "flex",
    "store": True,
    "verbosity": "low",
    "web_search_options": {},
    "suffix": "tail",
    "use_beam_search": True,
    "length_penalty": 0.5,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 5,
    "allowed_token_ids": [1],
    "bad_words": ["x"],
    "add_generation_prompt": False,
    "continue_final_message": True,
    "add_special_tokens": {"chat": True, "completions": False},
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}",
    "mm_processor_kwargs": {"a": 1},
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a"],
    "guided_grammar": "root ::= 'a'",
    "structural_tag": "{}",
    "guided_decoding_backend": "xgrammar",
    "structured_outputs": {"choice": ["a", "b"]},
    "guided_whitespace_pattern": " ",
    "logits_processors": ["x.y"],
    "cache_salt": "salt",
    "kv_transfer_params": {},
    "vllm_xargs": {"a": 1},
    "prompt_embeds": "AAAA",
}
CASES = [(endpoint, name) for endpoint in SCHEMAS for name in sorted(SCHEMAS[endpoint])]


def test_every_schema_field_is_placed():
    for endpoint, names in SCHEMAS.items():
        assert not names - fields.known(endpoint), f"{endpoint}: place these fields in fields.py"
        assert not names - SAMPLES.keys(), "give these fields a sample value here"


@pytest.mark.parametrize("endpoint,name", CASES, ids=[f"{e}-{n}" for e, n in CASES])
def test_each_field_is_served_or_refused_by_name(served, endpoint, name):
    value = SAMPLES[name]
    if isinstance(value, dict) and set(value) == {"chat", "completions"}:
        value = value[endpoint]
    body = {**BASE[endpoint], name: value}
    status, data, _ = raw_request(
        served.http_url, "POST", PATHS[endpoint], json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    refused = name in fields.REFUSED or name in fields.REFUSED_BY_ENDPOINT[endpoint]
    if status == 400:
        assert json.loads(data)["error"]["param"] == name, data
        assert name not in ("model", "messages", "prompt", "max_tokens", "stream", "temperature", "seed")
    else:
        assert status == 200 and not refused, (status, data[:300])
        assert name in fields.SERVED[endpoint]
    if refused:
        assert status == 400
