"""`shinkai serve`: tokenizer, engine (with its in-process worker) and gateway in one process, no NATS.

One asyncio loop runs the HTTP and gRPC endpoints (`ApiServer`); the engine's step loop runs in its own
thread. ``stop()`` drains: health turns
NOT_SERVING and /health 503, new requests get 503 / UNAVAILABLE, live ones get ``drain_timeout_s`` to
finish, then whatever is left is aborted and the pools are whole when the engine thread exits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.llm import LLM
from services.engine.served_engine import ServedEngine
from services.engine.service import DEFAULT_MAX_QUEUED
from services.gateway.admission import Admission, AdmissionLimits
from services.gateway.api_server import ApiServer
from services.gateway.auth import Keys
from services.gateway.backends import LocalEngine, LocalTokenizer
from services.gateway.frontend import Frontend
from services.gateway.http_timeouts import HttpTimeouts
from services.gateway.image_fetcher import ImageFetcher


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
    replica: str = "engine-0"  # the engine instance's name in loads and metrics
    detokenize: bool = True  # False: streams carry token ids only (the gateway's tokenizer makes text)
    api_keys: tuple[str, ...] = ()  # keys HTTP and gRPC callers must send (services/gateway/auth.py); (): open
    tls: tuple[str, str] | None = None  # (certificate, key) PEM files: HTTPS and TLS gRPC; None: plaintext
    allow_private_image_urls: bool = False  # image URLs may resolve to private / loopback addresses (the SSRF rule off)
    http_timeouts: HttpTimeouts = HttpTimeouts()  # read deadlines of an HTTP request's headers and body
    admission: AdmissionLimits = AdmissionLimits()  # per-tenant limits (services/gateway/admission.py)


class Server:
    def __init__(self, config: ServeConfig, llm: LLM | None = None) -> None:
        self.config = config
        self.llm = llm or LLM(model=config.model, **config.engine_args)
        self.served = ServedEngine(
            self.llm,
            served_model_name=config.served_model_name or config.model,
            replica=config.replica,
            max_queued=config.max_queued,
        )
        self.engine = self.served.service
        self.metrics = self.served.metrics
        self.chat = self.served.chat
        self.frontend = Frontend(
            self.served.info,
            LocalEngine(self.engine, self.served.images),
            LocalTokenizer(self.llm, self.chat, config.detokenize),
            self.metrics,
            image_fetcher=ImageFetcher(allow_private=config.allow_private_image_urls),
            admission=Admission(config.admission),
        )
        self.api = ApiServer(
            self.frontend,
            config.host,
            config.http_port,
            config.grpc_port,
            Keys(config.api_keys),
            config.tls,
            http_timeouts=config.http_timeouts,
        )

    @property
    def http_port(self) -> int | None:
        return self.api.http_port

    @property
    def grpc_port(self) -> int | None:
        return self.api.grpc_port

    async def start(self) -> None:
        await self.served.start(self.api)

    async def stop(self) -> None:
        await self.served.stop(self.api, self.config.drain_timeout_s)

    def urls(self) -> dict[str, str]:
        return self.api.urls()
