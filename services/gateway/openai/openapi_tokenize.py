"""The OpenAPI description of vLLM's utility endpoints (/tokenize, /detokenize, /version), as tokenize.py
serves them; part of the document openapi.py builds."""

from __future__ import annotations

from typing import Any

from services.engine.model_info import ModelInfo


def tokenize_paths(info: ModelInfo, errors: dict[str, Any]) -> dict[str, Any]:
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": info.vocab_size - 1}}
    refusals = {k: errors[k] for k in ("400", "401", "404", "413", "415")}

    def post(summary: str, request: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                "responses": {
                    "200": {"description": summary, "content": {"application/json": {"schema": answer}}},
                    **refusals,
                },
            }
        }

    tokenize_request = {
        "type": "object",
        "properties": {
            "model": {"type": "string", "description": f"must be {info.model!r}"},
            "prompt": {"type": "string", "description": "encoded as a completion's prompt (BOS first)"},
            "messages": {"type": "array", "items": {"type": "object"}, "description": "rendered as a chat's"},
            "return_token_strs": {"type": ["boolean", "null"]},
        },
    }
    tokenized = {
        "type": "object",
        "required": ["count", "max_model_len", "tokens", "token_strs"],
        "properties": {
            "count": {"type": "integer"},
            "max_model_len": {"type": "integer"},
            "tokens": {"type": "array", "items": {"type": "integer"}},
            "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
        },
    }
    detokenize_request = {
        "type": "object",
        "required": ["tokens"],
        "properties": {"model": {"type": "string"}, "tokens": token_ids},
    }
    detokenized = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
    version = {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}
    return {
        "/tokenize": post("Tokenize a prompt or a chat (vLLM's shape)", tokenize_request, tokenized),
        "/detokenize": post("Token ids to text (vLLM's shape)", detokenize_request, detokenized),
        "/version": {
            "get": {
                "summary": "Shinkai's version",
                "responses": {
                    "200": {"description": "the version", "content": {"application/json": {"schema": version}}}
                },
            }
        },
    }
