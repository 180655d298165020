"""The service's table of live streams, without an engine: what it refuses when a stream is opened, and how the
engine's outputs become each stream's deltas (new tokens only, prompt logprobs once per choice, the last delta
after the last choice ends, nothing after it)."""

import asyncio

import pytest

from services.engine.finish_reason import FinishReason
from services.engine.outputs import RequestOutput
from services.engine.reporting.observer import EngineObserver
from services.engine.stream_table import QueueFull, StreamTable


def _table(aborted: list[str]) -> StreamTable:
    return StreamTable(EngineObserver(), aborted.append)


def _drain(stream) -> list:
    deltas = []
    while not stream.deltas.empty():
        deltas.append(stream.deltas.get_nowait())
    return deltas


def test_opening_refuses_a_full_table_and_a_live_request_id():
    async def run():
        table = _table([])
        table.open("a", "client", 4, 1, max_live=2)
        with pytest.raises(ValueError, match="request id 'a' is already in use"):
            table.open("a", "client", 4, 1, max_live=2)
        table.open("b", "client", 4, 1, max_live=2)
        with pytest.raises(QueueFull):
            table.open("c", "other", 4, 1, max_live=2)
        assert table.num_live() == 2 and table.request_ids("other") == []
        assert sorted(table.request_ids("client")) == ["a", "b"]

    asyncio.run(run())


def test_outputs_become_deltas_of_new_tokens_and_the_last_ends_with_the_last_choice():
    async def run():
        aborted: list[str] = []
        table = _table(aborted)
        stream = table.open("r", "client", 3, 2, max_live=8)
        first = RequestOutput("r", [7, 8, 9], index=0)
        second = RequestOutput("r", [7, 8, 9], index=1)
        first.token_ids += [1, 2]
        first.logprobs += [-0.5, -0.25]
        first.prompt_logprobs, first.prompt_top_logprobs, first.prompt_ranks = [-1.0, -2.0], [[], []], [1, 2]
        table.deliver(first)
        first.token_ids.append(3)
        first.logprobs.append(-0.125)
        first.finish_reason = FinishReason.LENGTH
        table.deliver(first)
        second.token_ids.append(4)
        second.logprobs.append(-1.5)
        second.finish_reason = FinishReason.STOP
        table.deliver(second)
        table.deliver_final("r", FinishReason.ERROR, None, "too late")  # the stream has ended: nothing is queued
        stream.close()  # its final delta was queued: no abort
        await asyncio.sleep(0)  # the deltas are posted to the loop thread-safely
        deltas = _drain(stream)
        assert [(d.index, d.token_ids, d.num_output_tokens) for d in deltas] == [
            (0, [1, 2], 2),
            (0, [3], 3),
            (1, [4], 1),
        ]
        assert deltas[0].prompt_logprobs == [-1.0, -2.0] and deltas[1].prompt_logprobs is None
        assert [d.finish_reason for d in deltas] == [None, FinishReason.LENGTH, FinishReason.STOP]
        assert [d.last for d in deltas] == [False, False, True]
        assert table.num_live() == 0 and aborted == []

    asyncio.run(run())


def test_a_stream_closed_early_asks_for_its_abort_and_a_final_delta_ends_it():
    async def run():
        aborted: list[str] = []
        table = _table(aborted)
        stream = table.open("r", "client", 3, 1, max_live=8)
        stream.close()
        assert aborted == ["r"]
        table.deliver_final("r", FinishReason.ABORT, None, None)
        await asyncio.sleep(0)
        (final,) = _drain(stream)
        assert final.last and final.finish_reason == FinishReason.ABORT and final.token_ids == []
        assert table.num_live() == 0

    asyncio.run(run())
