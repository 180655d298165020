"""The OpenAPI 3.1 description served at ``/openapi.json`` (and rendered at ``/docs``): exactly what the
gateway accepts and answers, written out by hand because bodies are parsed by `openai_protocol`, not by the
framework.

Invariants (tests/services/gateway/openai/test_openapi_fuzz.py runs schemathesis against the served document):
- a body the request schemas accept is never answered 5xx; every status the gateway can answer is listed for
  its operation; every JSON answer matches its response schema;
- the limits come from the served model (`ModelInfo`): token ids below the vocabulary, max_tokens within the
  context; fields refused by name (services/gateway/openai/fields.py) are described with only their no-op value.
"""

from __future__ import annotations

from typing import Any

from services.engine.model_info import ModelInfo
from services.gateway.openai.chat_options import REASONING_EFFORTS
from services.gateway.openai.openapi_protocols import protocol_paths
from services.gateway.openai.openapi_tokenize import tokenize_paths
from services.gateway.openai.prompt_batch import MAX_PROMPTS
from services.gateway.openai.protocol import MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MAX_N
from services.gateway.stop_strings import MAX_STOP_CHARS, MAX_STOP_STRINGS

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_JSON_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_ERRORS = {
    "400": {"description": "invalid input; `param` names the field", **_JSON_ERROR},
    "401": {"description": "no valid API key (only with --api-key)", **_JSON_ERROR},
    "404": {"description": "unknown model", **_JSON_ERROR},
    "413": {"description": "body over the size limit (4 MiB)", **_JSON_ERROR},
    "415": {"description": "Content-Type is not application/json", **_JSON_ERROR},
    "429": {"description": "queue full; see Retry-After", **_JSON_ERROR},
    "503": {"description": "draining, or no engine or tokenizer can serve", **_JSON_ERROR},
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        **{k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        "completion_tokens_details": {
            "type": "object",
            "properties": {"reasoning_tokens": {"type": "integer", "minimum": 0}},
            "description": "chat: the output tokens before </think>",
        },
        "prompt_tokens_details": {
            "type": "object",
            "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
            "description": "prompt tokens taken from the prefix cache instead of computed",
        },
    },
}
_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "abort", "preempted", "error", "tool_calls", None]}
_TOOL_CALL = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON"}},
        },
    },
}


def _sampling(info: ModelInfo) -> dict[str, Any]:
    """Fields both endpoints share, with what each accepts."""
    vocab = info.vocab_size
    return {
        "model": {"type": "string", "description": f"must be {info.model!r}"},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": info.max_model_len},
        "temperature": {"type": ["number", "null"], "minimum": 0},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": ["integer", "null"], "minimum": -1, "maximum": 2**63 - 1, "description": "-1 or 0: off"},
        "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1},
        "n": {
            "type": ["integer", "null"],
            "minimum": 1,
            "maximum": MAX_N,
            "description": "choices; > 1 where the engine serves n",
        },
        "best_of": {"type": ["integer", "null"], "minimum": 1, "description": "must equal n"},
        "stop": {
            "anyOf": [
                {"type": "null"},
                {"type": "string", "maxLength": MAX_STOP_CHARS},
                {
                    "type": "array",
                    "maxItems": MAX_STOP_STRINGS,
                    "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                },
            ],
            "description": "stop strings, matched on the text across tokens",
        },
        "include_stop_str_in_output": {"type": ["boolean", "null"]},
        "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}},
        "ignore_eos": {"type": ["boolean", "null"]},
        "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
        "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
        "prompt_logprobs": {
            "type": ["integer", "null"],
            "minimum": 0,
            "maximum": MAX_LOGPROBS,
            "description": "vLLM's: per prompt token its logprob and the top-n; not with stream",
        },
        "skip_special_tokens": {"type": ["boolean", "null"]},
        "logit_bias": {
            "type": ["object", "null"],
            "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
            "propertyNames": {"pattern": "^[0-9]{1,6}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "description": f"token id (< {vocab}) -> -100 (a ban) or a number added to its logit",
        },
        "response_format": {"type": ["object", "null"], "properties": {"type": {"const": "text"}}},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {
            "type": ["object", "null"],
            "description": "only with stream: true",
            "properties": {
                "include_usage": {"type": ["boolean", "null"]},
                "continuous_usage_stats": {
                    "type": ["boolean", "null"],
                    "description": "vLLM's: with include_usage, every chunk carries the usage so far",
                },
                "include_obfuscation": {"type": ["boolean", "null"], "description": "accepted; no padding is sent"},
            },
        },
        "user": {"type": ["string", "null"]},
    }


def _completion_request(info: ModelInfo) -> dict[str, Any]:
    token_ids = {
        "type": "array",
        "minItems": 1,
        "maxItems": info.max_model_len,
        "items": {"type": "integer", "minimum": 0, "maximum": info.vocab_size - 1},
    }
    prompt = {
        "anyOf": [
            {"type": "string"},
            token_ids,
            {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_PROMPTS,
                "items": {"anyOf": [{"type": "string"}, token_ids]},
                "description": "a batch: each prompt's choices in turn",
            },
        ]
    }
    return {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            **_sampling(info),
            "prompt": prompt,
            "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
            "echo": {
                "type": ["boolean", "null"],
                "description": (
                    "true: the text starts with the prompt (with logprobs: its tokens' logprobs too); with "
                    "max_tokens 0 (vLLM's), the answer is the prompt alone"
                ),
            },
            "suffix": {"type": ["string", "null"], "maxLength": 0, "description": "not served"},
        },
    }


def _chat_request(info: ModelInfo) -> dict[str, Any]:
    part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]},
        },
    }
    return {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            **_sampling(info),
            "messages": {"type": "array", "minItems": 1, "items": message},
            "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": info.max_model_len},
            "logprobs": {"type": ["boolean", "null"]},
            "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
            "thinking": {"type": ["object", "null"], "properties": {"type": {"enum": ["enabled", "disabled"]}}},
            "reasoning_effort": {"type": ["string", "null"], "enum": [*REASONING_EFFORTS, None]},
            "chat_template_kwargs": {
                "type": ["object", "null"],
                "properties": {"thinking": {"type": ["boolean", "null"]}},
                "additionalProperties": False,
            },
            # Rendered by deepseek-recipe (services/tokenizer/chat.py); what it refuses is a 400.
            "tools": {"type": ["array", "null"], "items": {"type": "object"}},
            "tool_choice": {"anyOf": [{"type": "null"}, {"type": "string"}, {"type": "object"}]},
            "parallel_tool_calls": {"type": ["boolean", "null"]},
            "include_reasoning": {"type": ["boolean", "null"]},
        },
    }


def _responses(body_ref: str) -> dict[str, Any]:
    return {
        "200": {
            "description": "the completion, or an SSE stream of chunks when stream is true",
            "content": {
                "application/json": {"schema": {"$ref": body_ref}},
                "text/event-stream": {"schema": {"type": "string"}},
            },
        },
        **_ERRORS,
    }


def _completion_body(chat: bool) -> dict[str, Any]:
    choice = {
        "type": "object",
        "required": ["index", "finish_reason", "logprobs"],
        "properties": {
            "index": {"type": "integer"},
            "finish_reason": _FINISH,
            "logprobs": {"type": ["object", "null"]},
            **(
                {
                    "message": {
                        "type": "object",
                        "required": ["role", "content"],
                        "properties": {
                            "role": {"const": "assistant"},
                            "content": {"type": ["string", "null"]},
                            "reasoning_content": {"type": ["string", "null"], "description": "thinking mode"},
                            "tool_calls": {"type": "array", "items": _TOOL_CALL},
                        },
                    }
                }
                if chat
                else {"text": {"type": "string"}}
            ),
        },
    }
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion" if chat else "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": {"$ref": "#/components/schemas/Usage"},
        },
    }


def _plain(description: str, schema: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"200": {"description": description, "content": {"application/json": {"schema": schema}}}, **(extra or {})}


def openapi_schema(info: ModelInfo) -> dict[str, Any]:
    status = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
    unavailable = {
        "503": {"description": "not serving; status says why", "content": {"application/json": {"schema": status}}}
    }
    model_card = {
        "type": "object",
        "required": ["id", "object"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "max_model_len": {"type": "integer"},
        },
    }
    models = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": model_card}},
    }
    body = {"required": True, "content": {"application/json": {"schema": None}}}

    def post(summary: str, request: str, response: str) -> dict[str, Any]:
        req = {**body, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request}"}}}}
        return {
            "post": {
                "summary": summary,
                "requestBody": req,
                "responses": _responses(f"#/components/schemas/{response}"),
            }
        }

    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Shinkai",
            "version": "0.1.0",
            "description": "OpenAI-compatible API. Masked logprobs (outside top-k / top-p) read -9999.0.",
        },
        "paths": {
            "/v1/completions": post("Text completion", "CompletionRequest", "Completion"),
            "/v1/chat/completions": post("Chat completion", "ChatCompletionRequest", "ChatCompletion"),
            "/v1/models": {
                "get": {
                    "summary": "The served model",
                    "responses": _plain("the model list", models, {"401": _ERRORS["401"]}),
                }
            },
            **protocol_paths(info, _ERRORS, model_card),
            **tokenize_paths(info, _ERRORS),
            "/health": {"get": {"summary": "Liveness", "responses": _plain("serving", status, unavailable)}},
            "/ready": {
                "get": {"summary": "A real one-token generation", "responses": _plain("generated", status, unavailable)}
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "the text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": {
                "Error": _ERROR,
                "Usage": _USAGE,
                "CompletionRequest": _completion_request(info),
                "ChatCompletionRequest": _chat_request(info),
                "Completion": _completion_body(chat=False),
                "ChatCompletion": _completion_body(chat=True),
            }
        },
    }
