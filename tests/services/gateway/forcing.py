"""A test-only engine wrapper that makes the random tiny model write exact texts (the engine's forced tokens).

`ForcingEngine` wraps a `Frontend`'s engine backend; while `forcing(text)` is active every submitted request's
first output tokens are the text's token ids (then the end token), through `SamplingParams.forced_token_ids`,
which no public API exposes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from model.deepseek_v41.tokenizer import load_v41_tokenizer

EOS_TOKEN_ID = 1  # <｜end▁of▁sentence｜>


def token_ids(text: str) -> list[int]:
    """The text's ids with the full vocabulary (</think> and ｜DSML｜ are their own tokens)."""
    return load_v41_tokenizer().encode(text, add_special_tokens=False).ids


class ForcingEngine:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.forced: tuple[int, ...] = ()

    async def submit(self, request_id, client_request_id, prompt_token_ids, params, *rest, **options):
        """The backend's submit with the forced tokens in the params; the other arguments pass through."""
        if self.forced:
            params = dataclasses.replace(params, forced_token_ids=self.forced)
        return await self.inner.submit(request_id, client_request_id, prompt_token_ids, params, *rest, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @contextlib.contextmanager
    def forcing(self, text: str, end: bool = True) -> Iterator[list[int]]:
        ids = token_ids(text) + ([EOS_TOKEN_ID] if end else [])
        self.forced = tuple(ids)
        try:
            yield ids
        finally:
            self.forced = ()


@contextlib.contextmanager
def forcing_engine(frontend: Any) -> Iterator[ForcingEngine]:
    """Wraps the frontend's engine for the duration."""
    inner = frontend.engine
    frontend.engine = ForcingEngine(inner)
    try:
        yield frontend.engine
    finally:
        frontend.engine = inner
