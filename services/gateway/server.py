"""`shinkai serve`: tokenizer, engine (with its in-process worker) and gateway in one process, no NATS.

One asyncio loop runs the HTTP server (uvicorn) and the gRPC server (grpc.aio, shinkai.v1 plus
grpc.health.v1); the engine's step loop runs in its own thread. ``stop()`` drains: health turns
NOT_SERVING and /health 503, new requests get 503 / UNAVAILABLE, live ones get ``drain_timeout_s`` to
finish, then whatever is left is aborted and the pools are whole when the engine thread exits.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from model.deepseek_v41.tokenizer import V41_VOCAB_SIZE, v41_tokenizer_path
from services.engine.llm import LLM
from services.engine.service import DEFAULT_MAX_QUEUED, EngineService
from services.gateway.backends import LocalEngine, LocalTokenizer
from services.gateway.frontend import Frontend, ModelInfo
from services.gateway.grpc_api import SERVICE, ShinkaiApi
from services.gateway.http import build_app
from services.gateway.metrics import GatewayMetrics
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


class Server:
    def __init__(self, config: ServeConfig, llm: LLM | None = None) -> None:
        self.config = config
        self.llm = llm or LLM(model=config.model, **config.engine_args)
        self.engine = EngineService(self.llm.engine, engine_name=config.engine_name, max_queued=config.max_queued)
        self.metrics = GatewayMetrics()
        self.metrics.watch_engine(self.engine.stats)
        cfg = self.llm.source.config
        chat = ChatRenderer(v41_tokenizer_path()) if cfg.vocab_size == V41_VOCAB_SIZE else None
        info = ModelInfo(model=config.served_model_name or config.model, vocab_size=cfg.vocab_size,
                         max_model_len=self.llm.config.max_model_len, bos_token_id=cfg.bos_token_id,
                         eos_token_id=cfg.eos_token_id, max_num_seqs=self.llm.config.max_num_seqs)
        self.chat = chat
        self.frontend = Frontend(info, LocalEngine(self.engine), LocalTokenizer(self.llm, chat, config.detokenize),
                                 self.metrics)
        self.ready = False
        self.health = health.aio.HealthServicer()
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._grpc: grpc.aio.Server | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._http_task: asyncio.Task | None = None

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def start(self) -> None:
        self.engine.start()
        self._grpc = grpc.aio.server()
        self._grpc.add_generic_rpc_handlers((ShinkaiApi(self.frontend, lambda: self.ready).handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        self.grpc_port = self._grpc.add_insecure_port(f"{self.config.host}:{self.config.grpc_port}")
        await self._set_health(False)
        await self._grpc.start()
        if self.config.http_port is not None:
            await self._start_http()
        self.ready = True
        await self._set_health(True)

    async def _start_http(self) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in self.config.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.http_port))
        self.http_port = sock.getsockname()[1]
        app = build_app(self.frontend, is_ready=lambda: self.ready)
        self._uvicorn = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                      timeout_graceful_shutdown=5))
        self._uvicorn.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # the caller owns them
        self._http_task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._http_task.done():
                self._http_task.result()  # raises what uvicorn raised
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.ready = False
        await self._set_health(False)
        drained = await self.engine.drain(self.config.drain_timeout_s)
        if not drained:
            log.warning("%d requests still live after %.0f s; aborting them", self.engine.num_unfinished(),
                        self.config.drain_timeout_s)
        self.engine.stop()  # aborts the rest; the step thread finishes every request before it exits
        if self._uvicorn is not None and self._http_task is not None:
            self._uvicorn.should_exit = True
            await self._http_task
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)

    def urls(self) -> dict[str, str]:
        urls = {"grpc": f"{self.config.host}:{self.grpc_port}"}
        if self.http_port is not None:
            urls["http"] = f"http://{self.config.host}:{self.http_port}"
        return urls
