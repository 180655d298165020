"""The OpenAPI description of ``/v1/responses`` (OpenAI Responses), ``/v1/messages`` (Anthropic Messages) and
``/v1/models/{model}``, as protocol_routes.py and http.py serve them; part of the document openapi.py builds.

The request schemas name the fields deepseek-recipe's converters read (services/gateway/openai/protocol_stream.py);
what they refuse beyond these is a 400. Answers: the protocol's body, or its SSE events when ``stream`` is true.
"""

from __future__ import annotations

from typing import Any

from services.engine.model_info import ModelInfo

_TEXT_OR_PARTS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}


def _post(summary: str, request: dict[str, Any], answer: dict[str, Any], errors: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {
                "200": {
                    "description": "the answer, or an SSE stream of the protocol's events when stream is true",
                    "content": {
                        "application/json": {"schema": answer},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **errors,
                "500": {"description": "Messages: the engine failed the request mid-answer", **errors["400"]},
            },
        }
    }


def protocol_paths(info: ModelInfo, errors: dict[str, Any], model_card: dict[str, Any]) -> dict[str, Any]:
    common = {
        "model": {"type": "string", "description": f"must be {info.model!r}"},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "stream": {"type": ["boolean", "null"]},
    }
    responses_request = {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            **common,
            "input": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["role", "content"],
                            "properties": {
                                "type": {"const": "message"},
                                "role": {"enum": ["user", "system", "developer", "assistant"]},
                                "content": {"type": "string", "minLength": 1},
                            },
                        },
                    },
                ]
            },
            "instructions": {"type": ["string", "null"]},
            "max_output_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": info.max_model_len},
        },
    }
    responses_answer = {
        "type": "object",
        "required": ["id", "object", "status", "output", "model"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "status": {"enum": ["completed", "incomplete", "failed"]},
            "output": {"type": "array", "items": {"type": "object"}},
            "model": {"type": "string"},
            "error": {"type": ["object", "null"]},
            "incomplete_details": {"type": ["object", "null"]},
            "usage": {"type": ["object", "null"]},
        },
    }
    messages_request = {
        "type": "object",
        "required": ["model", "max_tokens", "messages"],
        "properties": {
            **common,
            "max_tokens": {"type": "integer", "minimum": 1, "maximum": info.max_model_len},
            "messages": {
                "type": "array",
                "minItems": 1,
                "maxItems": 1,
                "items": {
                    "type": "object",
                    "required": ["role", "content"],
                    "properties": {"role": {"const": "user"}, "content": {"type": "string", "minLength": 1}},
                },
                "description": "a conversation of user and assistant turns (described here: one user turn)",
            },
            "system": {"anyOf": [{"type": "null"}, _TEXT_OR_PARTS]},
            "stop_sequences": {"type": ["array", "null"], "maxItems": 4, "items": {"type": "string", "minLength": 1}},
        },
    }
    messages_answer = {
        "type": "object",
        "required": ["id", "type", "role", "content", "model", "stop_reason", "usage"],
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "message"},
            "role": {"const": "assistant"},
            "content": {"type": "array", "items": {"type": "object"}},
            "model": {"type": "string"},
            "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use", None]},
            "stop_sequence": {"type": ["string", "null"]},
            "usage": {"type": "object"},
        },
    }
    return {
        "/v1/responses": _post("OpenAI Responses", responses_request, responses_answer, errors),
        "/v1/messages": _post("Anthropic Messages", messages_request, messages_answer, errors),
        "/v1/models/{model}": {
            "get": {
                "summary": "The served model by its name",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {
                    "200": {"description": "the model", "content": {"application/json": {"schema": model_card}}},
                    "401": errors["401"],
                    "404": errors["404"],
                },
            }
        },
    }
