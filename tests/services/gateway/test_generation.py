"""A generation whose detokenizer is lost mid-stream ends with finish reason error and aborts its engine request."""

import asyncio

from observability.metrics import RequestMetrics
from services.engine.finish_reason import FinishReason
from services.engine.service import Delta
from services.gateway.backends import DetokenizerLost
from services.gateway.generation import Generation
from services.gateway.stop_strings import StopStrings


class _Stream:
    def __init__(self, deltas):
        self.deltas = list(deltas)
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.closed:
            return Delta([], [], None, 0, FinishReason.ABORT, last=True)
        return self.deltas.pop(0)

    def close(self):
        self.closed = True


class _LosingDetokenizer:
    """Answers ``num_answers`` pushes, then its service is gone."""

    def __init__(self, num_answers):
        self.num_answers = num_answers
        self.closed = False

    async def push(self, ids):
        if self.num_answers == 0:
            raise DetokenizerLost("the tokenizer service's Detokenize stream broke")
        self.num_answers -= 1
        return "x" * len(ids)

    async def finish(self):
        return ""

    def close(self):
        self.closed = True


def _pieces(stop):
    deltas = [Delta([i], [-0.5], None, i + 1) for i in range(5)] + [Delta([5], [-0.5], None, 6, FinishReason.LENGTH)]
    stream, detokenizer = _Stream(deltas), _LosingDetokenizer(2)
    generation = Generation(RequestMetrics(), stream, detokenizer, "r", "r", 3, "completions", 0.0, stop=stop)

    async def read():
        return [piece async for piece in generation]

    return asyncio.run(read()), stream, detokenizer, generation


def test_a_lost_detokenizer_ends_the_generation_with_error():
    for stop in (None, StopStrings(["zz"], False)):  # the plain path and the stop strings' token-by-token one
        pieces, stream, detokenizer, generation = _pieces(stop)
        assert [p.text for p in pieces] == ["x", "x", ""]
        assert pieces[-1].delta.finish_reason == FinishReason.ERROR and pieces[-1].delta.stop_token_id is None
        assert all(p.delta.finish_reason is None for p in pieces[:-1])
        assert stream.closed and detokenizer.closed  # the engine's request aborted, the call cancelled
        assert generation.finish_reason == FinishReason.ERROR
