"""`shinkai serve`: tokenizer, engine (with its in-process worker) and gateway in one process, no NATS.

One asyncio loop runs the HTTP and gRPC endpoints (`ApiServer`); the engine's step loop runs in its own
thread. ``stop()`` drains: health turns
NOT_SERVING and /health 503, new requests get 503 / UNAVAILABLE, live ones get ``drain_timeout_s`` to
finish, then whatever is left is aborted and the pools are whole when the engine thread exits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from model.deepseek_v41.tokenizer import V41_VOCAB_SIZE, v41_tokenizer_path
from observability.metrics import EngineMetrics, RequestMetrics
from services.engine.llm import LLM
from services.engine.service import DEFAULT_MAX_QUEUED, EngineService
from services.gateway.api_server import ApiServer
from services.gateway.auth import Keys
from services.gateway.backends import LocalEngine, LocalTokenizer
from services.gateway.frontend import Frontend, ModelInfo
from services.tokenizer.chat import ChatRenderer

log = logging.getLogger("shinkai.serve")


@dataclass(frozen=True)
class ServeConfig:
    model: str = "tiny"  # checkpoint directory or preset name
    served_model_name: str | None = None  # the name clients use; None: the model argument
    host: str = "127.0.0.1"  # HTTP and gRPC bind address
    http_port: int | None = 8000  # 0: any free port; None: no HTTP (an engine process of `shinkai up`)
    grpc_port: int = 50051  # 0: any free port
    max_queued: int = DEFAULT_MAX_QUEUED  # unfinished requests before 429 / RESOURCE_EXHAUSTED
    drain_timeout_s: float = 30.0  # on stop, how long live requests may take to finish
    engine_args: dict[str, object] = field(default_factory=dict)  # EngineConfig fields
    engine_name: str = "engine-0"  # the engine's id in loads and NATS reports
    detokenize: bool = True  # False: streams carry token ids only (the gateway's tokenizer makes text)
    api_keys: tuple[str, ...] = ()  # keys HTTP and gRPC callers must send (services/gateway/auth.py); (): open
    tls: tuple[str, str] | None = None  # (certificate, key) PEM files: HTTPS and TLS gRPC; None: plaintext


class Server:
    def __init__(self, config: ServeConfig, llm: LLM | None = None) -> None:
        self.config = config
        self.llm = llm or LLM(model=config.model, **config.engine_args)
        self.engine = EngineService(self.llm.engine, engine_name=config.engine_name, max_queued=config.max_queued)
        self.metrics = RequestMetrics()  # the endpoint's registry: request metrics, then the engine's
        cfg = self.llm.source.config
        chat = ChatRenderer(v41_tokenizer_path()) if cfg.vocab_size == V41_VOCAB_SIZE else None
        info = ModelInfo(model=config.served_model_name or config.model, vocab_size=cfg.vocab_size,
                         max_model_len=self.llm.config.max_model_len, bos_token_id=cfg.bos_token_id,
                         eos_token_id=cfg.eos_token_id, max_num_seqs=self.llm.config.max_num_seqs)
        self.chat = chat
        stats = self.engine.stats()
        self.engine.observer.metrics = EngineMetrics(self.metrics.registry, self.engine.stats, info.model, {
            "engine": config.engine_name, "block_size": self.llm.config.block_size,
            "num_gpu_blocks": stats["total_blocks"], "num_state_slots": stats["total_state_slots"]})
        self.frontend = Frontend(info, LocalEngine(self.engine), LocalTokenizer(self.llm, chat, config.detokenize),
                                 self.metrics)
        self.api = ApiServer(self.frontend, config.host, config.http_port, config.grpc_port,
                             Keys(config.api_keys), config.tls)

    @property
    def http_port(self) -> int | None:
        return self.api.http_port

    @property
    def grpc_port(self) -> int | None:
        return self.api.grpc_port

    async def start(self) -> None:
        self.engine.start()
        try:
            await self.api.start()
        except BaseException:
            self.engine.stop()
            raise

    async def stop(self) -> None:
        await self.api.close_intake()
        drained = await self.engine.drain(self.config.drain_timeout_s)
        if not drained:
            log.warning("%d requests still live after %.0f s; aborting them", self.engine.num_unfinished(),
                        self.config.drain_timeout_s)
        self.engine.stop()  # aborts the rest; the step thread finishes every request before it exits
        await self.api.stop()

    def urls(self) -> dict[str, str]:
        return self.api.urls()
