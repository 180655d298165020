"""Cache-aware routing (services/gateway/router.py) on a real nats-server: two fake engines publish load reports
(`LoadReporter`) and KV events (`KvEventsPublisher`, whose ``take`` returns the blocks each fake engine cached:
every prompt it was sent, with its answer). The router's choices are under test; the engines are never called."""

import asyncio
import json
import random

import pytest

from services import subjects
from services.engine.prefix.block_hash import block_hashes
from services.engine.prefix.kv_events import KvEvents
from services.engine.reporting.kv_events_publisher import KvEventsPublisher
from services.engine.reporting.reporter import LoadReporter
from services.engine.stats import EngineStats
from services.gateway.prompt_blocks import PromptBlocks
from services.gateway.remote import RemoteEngine
from services.gateway.router import EngineRouter
from tests.services.gateway.test_router import _Stream, until

pytestmark = pytest.mark.timeout(120)
MODEL, BLOCK_SIZE = "tiny", 16
NUM_CONVERSATIONS, NUM_TURNS = 32, 4
SYSTEM, USER, ANSWER = 40, 20, 12  # tokens: each conversation's own opening, each user turn, each answer


class FakeEngine:
    """Caches each prompt it is sent and the answer it would give (their full blocks), as a prefix cache
    would, and hands those hashes to its publisher's ``take``."""

    def __init__(self, name: str, publish_events: bool = True, hold: bool = False) -> None:
        self.name = name
        self.held: set[int] = set()
        self.new: list[int] = []
        self.used_blocks = 0  # the blocks in use its load reports claim
        self.publish_events = publish_events
        self.hold = hold  # requests stay live (their blocks in use) until ``end_all``
        self.live: list[_Held] = []

    def end_all(self) -> None:
        for stream in self.live:
            stream.end()
        self.live = []

    async def submit(self, request_id, client_request_id, prompt_token_ids, params, *rest):
        answer = [int(client_request_id.split("/")[1])] * ANSWER  # the conversation's answer tokens
        for h in block_hashes(list(prompt_token_ids) + answer, BLOCK_SIZE, model=MODEL):
            if h not in self.held:
                self.held.add(h)
                self.new.append(h)
        if not self.hold:
            return _Stream()
        stream = _Held(self, -(-len(prompt_token_ids) // BLOCK_SIZE))
        self.used_blocks += stream.num_blocks
        self.live.append(stream)
        return stream

    def take(self) -> KvEvents:
        new, self.new = self.new, []
        return KvEvents(stored=new, removed=[], cleared=False)

    def stats(self) -> EngineStats:
        return EngineStats(
            free_blocks=1000 - self.used_blocks,
            total_blocks=1000,
            free_state_slots=4,
            total_state_slots=4,
            num_waiting=0,
            num_running=0,
            decode_step=0,
        )


async def started(nats_url, fakes: list[FakeEngine], monkeypatch):
    engines = [RemoteEngine(f.name, f"127.0.0.1:{i + 1}") for i, f in enumerate(fakes)]
    for engine, fake in zip(engines, fakes):
        monkeypatch.setattr(engine, "submit", fake.submit)
    router = EngineRouter(engines)
    router.blocks = PromptBlocks(MODEL, BLOCK_SIZE, None)
    await router.subscribe(nats_url)
    reporters, publishers = [], []
    for i, fake in enumerate(fakes):
        reporter = LoadReporter(nats_url, fake.name, f"127.0.0.1:{i + 1}", fake.stats, interval_s=0.05)
        await reporter.start()
        reporters.append(reporter)
        if fake.publish_events:
            publishers.append(KvEventsPublisher(reporter.nc, fake.name, fake.take, interval_s=0.02))
            publishers[-1].start()
    await until(lambda: router.num_reports >= 2 * len(fakes))
    return router, reporters, publishers


async def stopped(router, reporters, publishers) -> None:
    for p in publishers:
        await p.stop()
    for r in reporters:
        await r.stop()
    await router.close()


async def settled(router, fakes) -> None:
    """Until the router's index holds every block the publishing engines cached."""
    await until(
        lambda: all(router.index.num_blocks(f.name) == len(f.held) and not f.new for f in fakes if f.publish_events)
    )


async def ended(stream) -> None:
    async for _ in stream:
        pass


async def conversations(router, fakes) -> float:
    """Turn by turn over every conversation, in a shuffled order each turn (a seeded one); the fraction of
    follow-up turns routed to the engine that served the conversation's first turn (the one holding its prefix)."""
    histories = {c: [1000 + c] * SYSTEM for c in range(NUM_CONVERSATIONS)}
    first, same = {}, 0
    order = random.Random(0)
    for turn in range(NUM_TURNS):
        streams = []
        for c in order.sample(sorted(histories), len(histories)):
            prompt = histories[c] + [2000 + turn] * USER
            stream = await router.submit(f"r{c}.{turn}", f"c/{c}", prompt, None)
            streams.append(stream)
            replica = stream.state.engine.replica
            if turn == 0:
                first[c] = replica
            else:
                same += replica == first[c]
            histories[c] = prompt + [c] * ANSWER
            if not fakes[0].hold:
                await ended(streams.pop())
        for fake in fakes:
            fake.end_all()
        for stream in streams:
            await ended(stream)
        await settled(router, fakes)
    return same / (NUM_CONVERSATIONS * (NUM_TURNS - 1))


def test_follow_up_turns_land_on_the_replica_holding_their_prefix(nats_url, monkeypatch):
    """With KV events, ≥ 90% of follow-up turns go where their prefix is; load-only routing (same engines, no
    events) sends them wherever the round robin falls."""

    async def run():
        fakes = [FakeEngine("engine-0"), FakeEngine("engine-1")]
        setup = await started(nats_url, fakes, monkeypatch)
        try:
            kv = await conversations(setup[0], fakes)
            routed = {name: s.num_routed for name, s in setup[0].states.items()}
        finally:
            await stopped(*setup)
        fakes = [FakeEngine("engine-0", False), FakeEngine("engine-1", False)]
        setup = await started(nats_url, fakes, monkeypatch)
        try:
            load_only = await conversations(setup[0], fakes)
            assert setup[0].num_kv_events == 0
        finally:
            await stopped(*setup)
        return kv, routed, load_only

    kv, routed, load_only = asyncio.run(run())
    assert kv >= 0.9, (kv, routed)
    assert min(routed.values()) >= NUM_CONVERSATIONS * NUM_TURNS // 4, routed  # the first turns spread
    assert load_only < 0.75, load_only


def test_far_more_load_outweighs_a_cached_prefix(nats_url, monkeypatch):
    """The rule: the engine holding ``o`` more blocks of the prompt wins iff its active blocks exceed the
    other's by less than ``overlap_weight · o``. Engine-0 holds a 6-block prompt's first 5 blocks."""

    async def run():
        fakes = [FakeEngine("engine-0"), FakeEngine("engine-1")]
        router, reporters, publishers = setup = await started(nats_url, fakes, monkeypatch)
        try:
            prompt = list(range(5 * BLOCK_SIZE - ANSWER))
            await fakes[0].submit("r", "c/7", prompt, None)  # caches its 5 blocks, the answer's included
            await settled(router, fakes)
            follow_up = prompt + [7] * ANSWER + [500] * BLOCK_SIZE  # 6 blocks
            assert router.index.overlap("engine-0", router.blocks.hashes(follow_up)) == 5
            bound = round(router.overlap_weight * 5)  # the blocks of load engine-0's 5 cached blocks are worth
            for used, winner in (
                (bound - 1, "engine-0"),
                (bound + 1, "engine-1"),
                (10 * bound, "engine-1"),
                (0, "engine-0"),
            ):
                fakes[0].used_blocks = used
                await until(lambda: router.states["engine-0"].report.free_blocks == 1000 - used)
                picks = {router.pick(follow_up).engine.replica for _ in range(4)}
                assert picks == {winner}, (used, picks)
            # Draining forgets the engine's blocks; with no engine's events heard, routing is by load alone.
            await reporters[0].lifecycle("draining")
            await until(lambda: not router.index.heard("engine-0"))
            fakes[0].new = list(fakes[0].held)  # published again before the engine announces "up" (a restart's
            await settled(router, fakes)  # cache is empty: what was heard before it is forgotten)
            await reporters[0].lifecycle("up")
            await until(lambda: router.states["engine-0"].accepting)
            assert not router.index.heard("engine-0")
            await publishers[1].stop()
            router.index.forget("engine-1")
            fakes[1].used_blocks = 500  # in blocks, engine-1 is far busier; by requests both are idle
            await until(lambda: router.states["engine-1"].report.free_blocks == 500)
            assert {router.pick(follow_up).engine.replica for _ in range(4)} == {"engine-0", "engine-1"}
        finally:
            await stopped(*setup)

    asyncio.run(run())


def test_a_malformed_or_misattributed_event_is_dropped(nats_url, monkeypatch):
    async def run():
        import nats

        fakes = [FakeEngine("engine-0"), FakeEngine("engine-1")]
        router, _, _ = setup = await started(nats_url, fakes, monkeypatch)
        nc = await nats.connect(nats_url)
        try:
            subject = subjects.of_replica(subjects.KV_EVENTS, "engine-0")
            bad = [
                {"replica": "engine-1", "stored": [5], "removed": [], "cleared": False},  # names another engine
                {"replica": "engine-0", "stored": [-1], "removed": [], "cleared": False},
                {"replica": "engine-0", "stored": [2**64], "removed": [], "cleared": False},
                {"replica": "engine-0", "stored": ["5"], "removed": [], "cleared": False},
                {"replica": "engine-0", "stored": [5], "removed": [], "cleared": "yes"},
                {"replica": "engine-0", "stored": [5]},
            ]
            for message in bad:
                await nc.publish(subject, json.dumps(message).encode())
            await nc.publish(subject, b"not json")
            good = {"replica": "engine-0", "stored": [5], "removed": [], "cleared": False}
            await nc.publish(subject, json.dumps(good).encode())
            await until(lambda: router.index.overlap("engine-0", [5]) == 1)
            assert router.num_kv_events == 1 and router.index.holders(5) == {"engine-0"}
        finally:
            await nc.close()
            await stopped(*setup)

    asyncio.run(run())


def test_active_blocks_leave_out_this_gateways_ended_requests_before_the_next_report(nats_url, monkeypatch):
    """A load report is up to one interval old: a request it counted that has since ended no longer weighs on
    its engine, nor does one sent after it that has ended."""

    async def run():
        fakes = [FakeEngine("engine-0"), FakeEngine("engine-1")]
        engines = [RemoteEngine(f.name, f"127.0.0.1:{i + 1}") for i, f in enumerate(fakes)]
        held = []

        async def submit(*args):
            held.append(_Held())
            return held[-1]

        for engine in engines:
            monkeypatch.setattr(engine, "submit", submit)
        router = EngineRouter(engines)
        router.blocks = PromptBlocks(MODEL, BLOCK_SIZE, None)
        await router.subscribe(nats_url)
        reporter = LoadReporter(nats_url, "engine-0", "127.0.0.1:1", fakes[0].stats, interval_s=60)
        await reporter.start()  # one report now, the next in a minute
        try:
            await until(lambda: router.num_reports == 1)
            router.states["engine-1"].accepting = False  # every request to engine-0
            state = router.states["engine-0"]
            first = await router.submit("r0", "c/0", list(range(3 * BLOCK_SIZE)), None)
            assert state.active_blocks(3) == 3  # sent since the report
            fakes[0].used_blocks = 3
            await reporter.publish_load()  # counts the first request
            await until(lambda: router.num_reports == 2)
            assert state.active_blocks(3) == 3
            second = await router.submit("r1", "c/1", list(range(2 * BLOCK_SIZE)), None)
            assert state.active_blocks(3) == 5
            second.inner.end()
            async for _ in second:
                pass
            assert state.active_blocks(3) == 3
            first.inner.end()
            async for _ in first:
                pass
            assert state.active_blocks(3) == 0
        finally:
            await reporter.stop()
            await router.close()

    asyncio.run(run())


class _Held(_Stream):
    """A stream whose final delta waits for ``end()``; its engine's blocks in use fall then."""

    def __init__(self, engine: FakeEngine | None = None, num_blocks: int = 0) -> None:
        super().__init__()
        self.ended = asyncio.Event()
        self.engine = engine
        self.num_blocks = num_blocks

    def end(self) -> None:
        if self.engine is not None and not self.ended.is_set():
            self.engine.used_blocks -= self.num_blocks
        self.ended.set()

    async def __anext__(self):
        await self.ended.wait()
        return await super().__anext__()


def test_concurrent_turns_stay_with_their_prefix_at_the_default_weight(nats_url, monkeypatch):
    """Each turn's requests all live at once (their blocks in use in the reports, and in this gateway's count
    since): the engines' active blocks drift apart by a few prompts' worth as turns arrive in a random order,
    and at overlap weight 1 (Dynamo's default) that drift outweighs a cached prefix on a third of the follow-up
    turns (0.65 kept). The default weight keeps ≥ 90%; weight 0 ignores the caches."""

    async def run(weight: float | None) -> float:
        fakes = [FakeEngine("engine-0", hold=True), FakeEngine("engine-1", hold=True)]
        setup = await started(nats_url, fakes, monkeypatch)
        if weight is not None:
            setup[0].overlap_weight = weight
        try:
            return await conversations(setup[0], fakes)
        finally:
            await stopped(*setup)

    default, ignored = asyncio.run(run(None)), asyncio.run(run(0.0))
    assert default >= 0.9, default
    assert ignored < 0.75, ignored
