"""`shinkai serve --dp N`'s server: HTTP and gRPC in this process in front of a `RankGroup`.

It is the gateway process (services/entrypoints/gateway.py) with the tokenizer in-process and no NATS: the router
counts what it sent each rank, and `EngineHealth` turns the server NOT_SERVING when no rank serves (a lost rank
takes its whole group there). ``stop()`` drains as the gateway does, then stops the ranks together.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from model.deepseek_v41.tokenizer import V41_VOCAB_SIZE, v41_tokenizer_path
from observability.metrics import RequestMetrics
from services.engine.model_info import ModelInfo
from services.gateway.admission import Admission
from services.gateway.api_server import ApiServer
from services.gateway.auth import Keys
from services.gateway.backends import LocalTokenizer
from services.gateway.engine_health import EngineHealth
from services.gateway.frontend import Frontend
from services.gateway.image_fetcher import ImageFetcher
from services.gateway.rank_group import RankGroup
from services.gateway.router import EngineRouter
from services.gateway.server import ServeConfig
from services.tokenizer.chat import ChatRenderer


@dataclass
class _Tokenizing:
    """What `LocalTokenizer` reads of an LLM: the tokenizer and the model's config (no engine here)."""

    source: object  # ModelSource without weights

    @property
    def tokenizer(self):
        return self.source.tokenizer  # type: ignore[attr-defined]


class RankServer:
    def __init__(self, config: ServeConfig, group: RankGroup, start_timeout_s: float = 600.0) -> None:
        self.config = config
        self.group = group
        self.start_timeout_s = start_timeout_s
        self.metrics = RequestMetrics()
        self.router = EngineRouter(
            group.engines(), on_route=lambda replica: self.metrics.routed.labels(engine=replica).inc()
        )
        self.source = group.source()
        cfg = self.source.config
        chat = ChatRenderer(v41_tokenizer_path()) if cfg.vocab_size == V41_VOCAB_SIZE else None
        self.tokenizer = LocalTokenizer(_Tokenizing(self.source), chat, config.detokenize)  # type: ignore[arg-type]
        self.frontend: Frontend | None = None
        self.api: ApiServer | None = None
        self._health: EngineHealth | None = None
        self._watching: asyncio.Task | None = None

    async def start(self) -> None:
        """Waits for every rank, then listens; a failed start leaves no rank behind."""
        await self.group.wait_serving(self.start_timeout_s)
        try:
            remote = await self.router.states["engine-0"].engine.model_info()
            info = ModelInfo(
                model=self.config.served_model_name or remote.model,
                vocab_size=remote.vocab_size,
                max_model_len=remote.max_model_len,
                bos_token_id=remote.bos_token_id,
                eos_token_id=remote.eos_token_id,
                max_num_seqs=remote.max_num_seqs,
                block_size=remote.block_size or None,
                image_placeholder_id=remote.image_placeholder_id if remote.HasField("image_placeholder_id") else None,
            )
            self.frontend = Frontend(
                info,
                self.router,
                self.tokenizer,
                self.metrics,
                image_fetcher=ImageFetcher(allow_private=self.config.allow_private_image_urls),
                admission=Admission(self.config.admission),
            )
            self.api = ApiServer(
                self.frontend,
                self.config.host,
                self.config.http_port,
                self.config.grpc_port,
                Keys(self.config.api_keys),
                self.config.tls,
                http_timeouts=self.config.http_timeouts,
            )
            self._health = EngineHealth(self.router, self.api.set_problem)
            await self._health.poll()
            await self.api.start()
        except BaseException:
            self.group.stop(0.0)
            raise
        self._watching = asyncio.create_task(self._health.run())

    async def stop(self) -> list[int | None]:
        """Intake closed, live streams get ``drain_timeout_s``, the rest end with "abort"; then the ranks stop
        together. Returns their exit codes."""
        assert self.api is not None and self._watching is not None
        self._watching.cancel()
        await self.api.close_intake()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        while self.router.streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.router.abort_live()
        deadline = loop.time() + 5.0
        while self.router.streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self.api.stop()
        await self.router.close()
        return await asyncio.to_thread(self.group.stop, self.config.drain_timeout_s + 10.0)

    def urls(self) -> dict[str, str]:
        assert self.api is not None
        return self.api.urls()
