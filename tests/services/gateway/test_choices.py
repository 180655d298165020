"""One engine stream of n interleaved choices as n streams (services/gateway/choices.py)."""

import asyncio

from services.engine.finish_reason import FinishReason
from services.engine.service import Delta
from services.gateway.choices import ChoiceStreams


class _Stream:
    def __init__(self, deltas):
        self.deltas = list(deltas)
        self.num_closes = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.deltas:
            raise StopAsyncIteration
        await asyncio.sleep(0)
        return self.deltas.pop(0)

    def close(self):
        self.num_closes += 1


def delta(index, token, count, reason=None):
    return Delta([token], [-1.0], None, count, reason, None, index=index)


async def read_all(streams, order):
    """Reads the choices concurrently; returns each choice's tokens and its final delta."""

    async def one(i):
        out = []
        async for d in streams.choice(i):
            out.append(d)
        return out

    results = await asyncio.gather(*(one(i) for i in order))
    return dict(zip(order, results))


def test_interleaved_choices_each_get_their_own_deltas_in_order():
    deltas = [delta(0, 10, 1), delta(1, 20, 1), delta(1, 21, 2), delta(0, 11, 2, FinishReason.STOP)]
    deltas.append(delta(1, 22, 3, FinishReason.LENGTH))
    stream = _Stream(deltas)
    got = asyncio.run(read_all(ChoiceStreams(stream, 2), [1, 0]))
    assert [d.token_ids[0] for d in got[0]] == [10, 11] and got[0][-1].finish_reason == FinishReason.STOP
    assert [d.token_ids[0] for d in got[1]] == [20, 21, 22] and got[1][-1].finish_reason == FinishReason.LENGTH


def test_a_request_level_end_ends_every_open_choice_with_its_reason_and_counts():
    deltas = [delta(0, 10, 1), delta(1, 20, 1), delta(1, 21, 2), Delta([], [], None, 3, FinishReason.ABORT, None)]
    got = asyncio.run(read_all(ChoiceStreams(_Stream(deltas), 3), [0, 1, 2]))
    finals = {i: got[i][-1] for i in got}
    assert all(f.finish_reason == FinishReason.ABORT for f in finals.values())
    assert finals[1].num_output_tokens == 2 and finals[2].num_output_tokens == 0 and finals[2].index == 2


def test_closing_every_choice_aborts_the_request_once_all_are_closed():
    stream = _Stream([delta(0, 10, 1), delta(1, 20, 1), delta(0, 11, 2), delta(1, 21, 2)])
    streams = ChoiceStreams(stream, 2)

    async def run():
        first = await streams.choice(0).__anext__()
        streams.choice(0).close()  # choice 0's stop string matched
        assert stream.num_closes == 0  # choice 1 still runs
        rest = [await streams.choice(1).__anext__(), await streams.choice(1).__anext__()]
        streams.choice(1).close()
        return first, rest

    first, rest = asyncio.run(run())
    assert first.token_ids == [10] and [d.token_ids[0] for d in rest] == [20, 21]  # 0's later delta dropped
    assert stream.num_closes == 1
