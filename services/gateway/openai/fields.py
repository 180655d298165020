"""Every request field of OpenAI's schema and vLLM's, by endpoint: served, or refused with a 400 naming it.

The field lists are OpenAI's request types of the pinned `openai` client (``CompletionCreateParamsBase`` of
``openai.types.chat.completion_create_params`` and of ``openai.types.completion_create_params``) and vLLM's
``ChatCompletionRequest`` / ``CompletionRequest`` (vllm/entrypoints/openai/protocol.py at vLLM commit
0052bed36509c7a5a2d8e48265334e40cf2f5a0e, the v0.10 series), with ``structured_outputs``, the field later vLLM
replaced guided_* with, and ``return_token_ids`` (vLLM v0.10.2 on). tests/services/gateway/openai/test_fields.py
walks both, so a field a new client adds fails until it is placed here. A refused field is refused only when
set to something other than its no-op value (``None`` always is one); fields outside both schemas are
ignored with a logged warning, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.gateway import errors

# Fields both endpoints serve (parsed in protocol.py / sampling_fields.py).
_SERVED_COMMON = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "n",
    "stop",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "seed",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "logprobs",
    "logit_bias",
    "best_of",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "structured_outputs",
    "user",
    "safety_identifier",
    "priority",
    "request_id",
    "prompt_logprobs",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "prompt_cache_key",
    "skip_special_tokens",
    "cache_salt",
}
SERVED = {
    "completions": _SERVED_COMMON | {"prompt", "echo"},
    "chat": _SERVED_COMMON
    | {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "thinking",
        "reasoning_effort",
        "chat_template_kwargs",
        "include_reasoning",
        "top_logprobs",
        "max_completion_tokens",
    },
}


def _none(value: Any) -> bool:
    return value is None


def _false(value: Any) -> bool:
    return value is None or value is False


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _one_of(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in allowed


# name -> (whether the value asks for nothing, why any other value is refused)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "store": (_false, "this server stores no completions"),
    "service_tier": (_one_of("auto", "default"), "one service tier is served: 'auto' / 'default'"),
    "modalities": (_one_of(["text"]), "this model writes text only"),
    "add_generation_prompt": (_one_of(True), "the chat format always opens the assistant's turn"),
    "continue_final_message": (_false, "continuing the final message is not served"),
    "audio": (_none, "audio output is not served; this model writes text"),
    "function_call": (_none, "the deprecated functions API is not served; use tools and tool_choice"),
    "functions": (_empty, "the deprecated functions API is not served; use tools"),
    "metadata": (_empty, "metadata is kept only with store, and this server stores nothing"),
    "moderation": (_none, "moderation is not served"),
    "prediction": (_none, "predicted outputs are not served"),
    "prompt_cache_options": (_none, "prompt caching is automatic here and takes no options"),
    "prompt_cache_retention": (_none, "prompt caching is automatic here; its retention is not set per request"),
    "verbosity": (_none, "verbosity is not served"),
    "web_search_options": (_none, "web search is not served"),
    "suffix": (_empty, "suffix (insertion) is not served"),
    "use_beam_search": (_false, "beam search is not served"),
    "length_penalty": (_one_of(1, 1.0), "length_penalty applies to beam search, which is not served"),
    "spaces_between_special_tokens": (_one_of(True), "special tokens are always detokenized without spaces"),
    "truncate_prompt_tokens": (_none, "prompt truncation is not served; a prompt over the context gets a 400"),
    "allowed_token_ids": (_none, "allowed_token_ids is not served; use logit_bias"),
    "bad_words": (_empty, "bad_words is not served; use logit_bias"),
    "documents": (_none, "documents are not served; this model's chat format has no document slot"),
    "chat_template": (_none, "the chat format is DeepSeek's own (deepseek-recipe); templates are not taken"),
    "mm_processor_kwargs": (_empty, "image preprocessing options are not taken"),
    "structural_tag": (_none, "structural tags are not served; use response_format or guided_*"),
    "guided_whitespace_pattern": (_none, "the whitespace of JSON output is xgrammar's bounded default"),
    "logits_processors": (_none, "custom logits processors are not served"),
    "kv_transfer_params": (_none, "disaggregated KV transfer is not served"),
    "vllm_xargs": (_empty, "vllm_xargs extensions are not served"),
    "prompt_embeds": (_none, "prompt embeddings are not taken; send text or token ids"),
}


# Fields refused on one endpoint only.
REFUSED_BY_ENDPOINT: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "chat": {
        "echo": (_false, "echo of the last message is not served for chat"),
        "add_special_tokens": (_false, "the chat format places its special tokens itself"),
    },
    "completions": {
        "add_special_tokens": (_one_of(True), "a completion prompt always starts with BOS"),
    },
}


def known(endpoint: str) -> set[str]:
    return SERVED[endpoint] | REFUSED.keys() | REFUSED_BY_ENDPOINT[endpoint].keys()


def refuse_unserved(body: dict[str, Any], endpoint: str) -> None:
    """A 400 naming the first refused field that asks for something."""
    for name, (is_noop, why) in (REFUSED | REFUSED_BY_ENDPOINT[endpoint]).items():
        if name in body and not is_noop(body[name]):
            raise errors.invalid(f"{name}: {why}", name)
