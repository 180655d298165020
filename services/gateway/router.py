"""Routes each request to an engine by the prefix its cache holds and its load, from the engines' NATS reports.

Cache-aware (once some engine has published KV events, `subjects.KV_EVENTS`): the cost of sending a prompt of
B blocks to engine r is, in blocks, as NVIDIA Dynamo's KV router weighs it,

    cost(r) = overlap_weight · (B − overlap(r)) + active_blocks(r)

- ``overlap(r)``: the prompt's leading full blocks that r's prefix cache holds (`PrefixIndex`); B − overlap(r)
  is the prefill r would compute;
- ``active_blocks(r)``: from r's latest load report, its blocks in use (total − free) less the prompt blocks of
  this gateway's requests that report counted and that have ended since (a report is up to one interval old:
  without this, the engine that served the previous request looks busier than it is), plus B for each request
  it has waiting or queued, plus the prompt blocks of the requests this gateway sent it since that report and
  still streaming; before any report (or without NATS), the prompt blocks of this gateway's live requests on r.

So r, holding ``overlap(r)`` more blocks of the prompt than engine s, wins iff active_blocks(r) −
active_blocks(s) < overlap_weight · (overlap(r) − overlap(s)): a cached prefix is worth that many blocks of load.

Load only (no engine has published KV events, or the model's block size is unknown): an engine's score is
its last reported load (running + waiting + queued) plus the requests this gateway sent it since that report;
before the first report (or without NATS) it is this gateway's count of live requests on it. Either way the
lowest wins and ties go round robin. Engines that announced "draining", "unhealthy" or "down" on the
lifecycle subject get no new requests until they announce "up"; each lifecycle event forgets the engine's
cached blocks (a process that announces "up" starts with an empty cache). Abort is broadcast: the gateway does
not need to remember where a client request id went.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from services import nats_auth, subjects
from services.engine.sampling_params import SamplingParams
from services.engine.service import Delta, ShuttingDown
from services.engine.stats import EngineStats
from services.gateway.prefix_index import PrefixIndex
from services.gateway.prompt_blocks import PromptBlocks
from services.gateway.remote import RemoteEngine, RemoteStream

log = logging.getLogger("shinkai.gateway.router")
NATS_TIMEOUT_S = 5.0  # the deadline of every round trip to NATS (there are no request/reply calls)
# Blocks of load one cached prompt block is worth (docs/serving.md, "Routing": how it was chosen).
DEFAULT_OVERLAP_WEIGHT = 4.0


@dataclass
class _EngineState:
    engine: RemoteEngine
    reported_load: int = 0  # running + waiting + queued in the engine's latest load report
    sent_since_report: int = 0  # requests routed to it after that report
    live: int = 0  # requests of this gateway still streaming from it
    accepting: bool = True  # False after a "draining", "unhealthy" or "down" lifecycle event
    healthy: bool = True  # its grpc.health.v1 answered SERVING at the latest poll (`EngineHealth`)
    num_routed: int = 0  # requests routed to it, ever
    report: EngineStats | None = None  # the counts of its latest load report; None: none yet
    live_blocks: int = 0  # prompt blocks of this gateway's requests still streaming from it
    blocks_sent_since_report: int = 0  # prompt blocks of the requests routed to it after that report, still live
    blocks_ended_since_report: int = 0  # prompt blocks of the requests that report counted, ended since

    @property
    def score(self) -> int:
        """The reported load plus what was sent since; before any report (or without NATS), the live count:
        ``sent_since_report`` only grows until a report resets it, so alone it would never fall."""
        return self.live if self.report is None else self.reported_load + self.sent_since_report

    def active_blocks(self, num_blocks: int) -> int:
        """Its load in blocks, queued requests counted as ``num_blocks`` each (the module's docstring)."""
        if self.report is None:
            return self.live_blocks
        r = self.report
        queued = r.num_waiting + r.num_queued
        in_use = max(r.total_blocks - r.free_blocks - self.blocks_ended_since_report, 0)
        return in_use + queued * num_blocks + self.blocks_sent_since_report


class _CountedStream:
    """A `RemoteStream` that gives its engine's live count back when it ends or is closed."""

    def __init__(
        self, inner: RemoteStream, state: _EngineState, registry: set | None = None, num_blocks: int = 0
    ) -> None:
        self.inner = inner
        self.state = state
        self.num_blocks = num_blocks  # its prompt's blocks, counted in the engine's live blocks
        self.report = state.report  # the engine's latest load report when it was routed (which does not count it)
        self._registry = registry if registry is not None else set()  # the router's live streams
        self._counted = True

    @property
    def num_prompt_tokens(self) -> int:
        return self.inner.num_prompt_tokens

    def __aiter__(self) -> _CountedStream:
        return self

    async def __anext__(self) -> Delta:
        delta = await self.inner.__anext__()
        if delta.finish_reason is not None:
            self._release()
        return delta

    def _release(self) -> None:
        if self._counted:
            self._counted = False
            self.state.live -= 1
            self.state.live_blocks -= self.num_blocks
            if self.state.report is self.report:  # ended before a report counted it: no longer the engine's load
                self.state.blocks_sent_since_report -= self.num_blocks
            else:  # the latest report counted it: its blocks are free by now
                self.state.blocks_ended_since_report += self.num_blocks
            self._registry.discard(self)

    def close(self) -> None:
        self._release()
        self.inner.close()

    def abort(self) -> None:
        """Cancels the engine call; the reader's next delta is then the final "abort" (the stream stays live
        for the reader until it has read it)."""
        self.inner.close()


class EngineRouter:
    def __init__(
        self,
        engines: Sequence[RemoteEngine],
        on_route: Callable[[str], None] = lambda replica: None,
        overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
        index: PrefixIndex | None = None,
    ) -> None:
        self.states = {e.replica: _EngineState(e) for e in engines}
        self.on_route = on_route  # called with the replica of every routed request (a metric)
        self.overlap_weight = overlap_weight  # blocks of load one cached prompt block is worth (the cost above)
        self.index = index or PrefixIndex()  # the engines' cached blocks, from their KV events
        # How prompts are hashed, from the engines' model info; None: unknown, routing by load only.
        self.blocks: PromptBlocks | None = None
        self.num_kv_events = 0
        self._turn = itertools.count()
        self._nc: Any = None  # nats.aio.client.Client, when subscribed
        self.num_reports = 0
        self.streams: set[_CountedStream] = set()  # routed and not yet ended or closed

    async def subscribe(self, nats_url: str) -> None:
        import nats

        async def on_error(err: Exception) -> None:
            log.warning("nats: %s", err or type(err).__name__)

        self._nc = await nats.connect(
            nats_url,
            name="shinkai-gateway",
            max_reconnect_attempts=-1,
            error_cb=on_error,
            connect_timeout=NATS_TIMEOUT_S,
            reconnect_time_wait=0.5,
            **nats_auth.connect_options(),
        )
        await self._nc.subscribe(subjects.every_replica(subjects.ENGINE_LOAD), cb=self._on_load)
        await self._nc.subscribe(subjects.every_replica(subjects.ENGINE_LIFECYCLE), cb=self._on_lifecycle)
        await self._nc.subscribe(subjects.every_replica(subjects.KV_EVENTS), cb=self._on_kv_events)
        await self._nc.flush(timeout=NATS_TIMEOUT_S)

    async def _on_load(self, msg: Any) -> None:
        try:
            message = json.loads(msg.data)
            state = self._publisher(subjects.ENGINE_LOAD, msg.subject, message["replica"])
            report = EngineStats(**{f.name: int(message[f.name]) for f in fields(EngineStats)})
            load = report.num_running + report.num_waiting + report.num_queued
        except (ValueError, KeyError, TypeError) as err:
            log.warning("dropped a malformed load report: %s", err)
            return
        if state is not None:
            state.report = report
            state.reported_load = load
            state.sent_since_report = 0
            state.blocks_sent_since_report = 0
            state.blocks_ended_since_report = 0
            self.num_reports += 1

    async def _on_lifecycle(self, msg: Any) -> None:
        try:
            event = json.loads(msg.data)
            state = self._publisher(subjects.ENGINE_LIFECYCLE, msg.subject, event["replica"])
        except (ValueError, KeyError, TypeError):
            return
        if state is not None:
            state.accepting = event.get("state") == "up"
            # "up" comes from a fresh process (an empty cache: the one before may have died unannounced) or
            # after its worker was lost; every other state ends its service: either way, what it held is gone.
            self.index.forget(state.engine.replica)

    async def _on_kv_events(self, msg: Any) -> None:
        try:
            message = json.loads(msg.data)
            state = self._publisher(subjects.KV_EVENTS, msg.subject, message["replica"])
            stored, removed, cleared = _hashes(message["stored"]), _hashes(message["removed"]), message["cleared"]
            if not isinstance(cleared, bool):
                raise TypeError(f"cleared is {cleared!r}, not a bool")
        except (ValueError, KeyError, TypeError) as err:
            log.warning("dropped a malformed kv-event message: %s", err)
            return
        if state is not None:
            self.index.apply(state.engine.replica, stored, removed, cleared)
            self.num_kv_events += 1

    def _publisher(self, family: str, subject: str, claimed: object) -> _EngineState | None:
        """The state of the engine that published on ``subject``, when the message names that same engine: NATS
        lets an engine publish on its own subjects only, so a message naming another is dropped."""
        replica = subjects.replica_of(family, subject)
        if replica is None or claimed != replica:
            log.warning("dropped a message on %s naming replica %r", subject, claimed)
            return None
        return self.states.get(replica)

    def pick(self, prompt_token_ids: Sequence[int] = (), salt: str | None = None) -> _EngineState:
        candidates = [s for s in self.states.values() if s.accepting and s.healthy]
        if not candidates:
            raise ShuttingDown("no engine is taking requests")
        turn = next(self._turn)
        order = {id(s): (i - turn) % len(candidates) for i, s in enumerate(candidates)}
        if self.blocks is None or not any(self.index.heard(s.engine.replica) for s in candidates):
            return min(candidates, key=lambda s: (s.score, s.live, order[id(s)]))
        hashes = self.blocks.hashes(prompt_token_ids, salt)
        num_blocks = self.blocks.num_blocks(len(prompt_token_ids))
        costs = {id(s): self.cost(s, hashes, num_blocks) for s in candidates}
        return min(candidates, key=lambda s: (costs[id(s)], s.live, order[id(s)]))

    def cost(self, state: _EngineState, hashes: Sequence[int], num_blocks: int) -> float:
        """The cache-aware cost of sending a prompt of ``num_blocks`` blocks, whose full blocks' chain is
        ``hashes``, to ``state``'s engine (the module's docstring)."""
        overlap = self.index.overlap(state.engine.replica, hashes)
        return self.overlap_weight * (num_blocks - overlap) + state.active_blocks(num_blocks)

    async def submit(
        self,
        request_id: str,
        client_request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        images: Sequence[bytes] = (),
        priority: int = 0,
        tenant: str = "",
    ) -> _CountedStream:
        state = self.pick(prompt_token_ids, getattr(params, "cache_salt", None))
        stream = await state.engine.submit(
            request_id, client_request_id, prompt_token_ids, params, images, priority, tenant
        )
        num_blocks = 0 if self.blocks is None else self.blocks.num_blocks(len(prompt_token_ids))
        state.sent_since_report += 1
        state.blocks_sent_since_report += num_blocks
        state.live += 1
        state.live_blocks += num_blocks
        state.num_routed += 1
        self.on_route(state.engine.replica)
        counted = _CountedStream(stream, state, self.streams, num_blocks)
        self.streams.add(counted)
        return counted

    def abort_live(self) -> int:
        """Ends every routed stream with a final "abort" (drain past its grace period); returns how many."""
        live = list(self.streams)
        for stream in live:
            stream.abort()
        return len(live)

    async def abort(self, client_request_id: str) -> bool:
        found = await asyncio.gather(
            *(s.engine.abort(client_request_id) for s in self.states.values()), return_exceptions=True
        )
        return any(f is True for f in found)

    async def loads(self) -> dict[str, EngineStats]:
        results = await asyncio.gather(*(s.engine.loads() for s in self.states.values()), return_exceptions=True)
        return {replica: stats for r in results if isinstance(r, dict) for replica, stats in r.items()}

    async def close(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()
        for s in self.states.values():
            await s.engine.close()


def _hashes(value: object) -> list[int]:
    """A KV-event message's list of block hashes (unsigned 64-bit integers); ValueError or TypeError otherwise."""
    if not isinstance(value, list) or not all(type(h) is int and 0 <= h < 1 << 64 for h in value):
        raise ValueError("stored and removed are lists of unsigned 64-bit block hashes")
    return value
