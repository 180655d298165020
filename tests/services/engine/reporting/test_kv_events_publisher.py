"""The KV-event publisher: batches of a fake engine's ``take`` on the engine's own subject of a real
nats-server; a batch NATS refused is merged into the next; an oversized backlog becomes "cleared"."""

import asyncio
import json

import pytest

from services import subjects
from services.engine.prefix.kv_events import KvEvents
from services.engine.reporting.kv_events_publisher import KvEventsPublisher, merged

pytestmark = pytest.mark.timeout(60)


def apply(held: set[int], events: KvEvents) -> set[int]:
    """A subscriber's rule: cleared, then removed, then stored."""
    held = set() if events.cleared else set(held)
    return (held - set(events.removed)) | set(events.stored)


@pytest.mark.parametrize(
    "first, then",
    [
        (KvEvents([1, 2], [], False), KvEvents([3], [2], False)),  # stored, then evicted before publishing
        (KvEvents([1], [5], False), KvEvents([5], [], False)),  # evicted, then stored again
        (KvEvents([1], [], True), KvEvents([2], [1], False)),
        (KvEvents([1], [], False), KvEvents([2], [], True)),
    ],
)
def test_a_merged_batch_applies_as_the_two_in_order(first, then):
    for prior in (set(), {1, 2, 5, 9}):
        assert apply(prior, merged(first, then)) == apply(apply(prior, first), then)


class _Refusing:
    """A NATS client that is away until ``up`` is set."""

    def __init__(self):
        self.up = False
        self.sent = []

    async def publish(self, subject, data):
        if not self.up:
            raise ConnectionError("nats away")
        self.sent.append((subject, json.loads(data)))


def test_a_refused_batch_goes_out_with_the_next_and_a_large_backlog_becomes_cleared():
    async def run():
        batches = [KvEvents([1, 2], [], False), KvEvents([3], [1], False)]
        nc = _Refusing()
        publisher = KvEventsPublisher(nc, "engine-0", lambda: batches.pop(0) if batches else KvEvents([], [], False))
        assert not await publisher.publish()
        nc.up = True
        assert await publisher.publish()
        assert nc.sent == [
            (
                "shinkai.engine.kv.engine-0",
                {
                    "replica": "engine-0",
                    "stored": [2, 3],
                    "removed": [1],
                    "cleared": False,
                    "time": nc.sent[0][1]["time"],
                },
            )
        ]
        assert not await publisher.publish()  # nothing new: no message
        nc.up = False
        small = KvEventsPublisher(nc, "engine-0", lambda: KvEvents([7, 8, 9], [], False), max_pending=2)
        assert not await small.publish()
        nc.up = True
        small.take = lambda: KvEvents([10], [], False)
        assert await small.publish()
        assert nc.sent[-1][1]["stored"] == [10] and nc.sent[-1][1]["cleared"] is True

    asyncio.run(run())


def test_a_failing_take_publishes_nothing_and_the_loop_goes_on():
    async def run():
        nc = _Refusing()
        nc.up = True

        def take():
            raise RuntimeError("engine bug")

        publisher = KvEventsPublisher(nc, "engine-0", take)
        assert not await publisher.publish()
        publisher.take = lambda: KvEvents([4], [], False)
        assert await publisher.publish() and nc.sent[0][1]["stored"] == [4]

    asyncio.run(run())


def test_batches_reach_a_subscriber_of_every_replica(nats_url):
    async def run():
        import nats

        sub_nc = await nats.connect(nats_url)
        pub_nc = await nats.connect(nats_url)
        got: list[tuple[str, dict]] = []

        async def on(msg):
            got.append((msg.subject, json.loads(msg.data)))

        await sub_nc.subscribe(subjects.every_replica(subjects.KV_EVENTS), cb=on)
        await sub_nc.flush()
        pending = [KvEvents([11, 12], [], False), KvEvents([], [11], False)]
        publisher = KvEventsPublisher(
            pub_nc, "engine-1", lambda: pending.pop(0) if pending else KvEvents([], [], False), interval_s=0.02
        )
        publisher.start()
        try:
            deadline = asyncio.get_running_loop().time() + 10
            while len(got) < 2:
                assert asyncio.get_running_loop().time() < deadline, got
                await asyncio.sleep(0.02)
        finally:
            await publisher.stop()
            await pub_nc.close()
            await sub_nc.close()
        assert [s for s, _ in got] == ["shinkai.engine.kv.engine-1"] * 2
        assert [(m["stored"], m["removed"], m["cleared"]) for _, m in got] == [([11, 12], [], False), ([], [11], False)]
        assert publisher.num_published == 2

    asyncio.run(run())
