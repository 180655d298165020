"""The gateway as its own process (a service of `shinkai up`): OpenAI HTTP and shinkai.v1 gRPC in front of
the tokenizer service and one or more engine processes, routing by their NATS load reports and, where the
engines publish them, the blocks their prefix caches hold (services/gateway/router.py).

    python -m services.entrypoints.gateway --tokenizer 127.0.0.1:P --engine engine-0=127.0.0.1:Q [--engine ...] \\
        --nats-url nats://127.0.0.1:R --http-port 8000 --grpc-port 50051

It starts beside its engines: it loads what a first request would (the structured outputs' grammar compiler), then
waits for one engine to serve and reads the model from it, binds its ports and prints one JSON ready line. Health
(grpc.health.v1, /health) is NOT_SERVING / 503 while no engine is reachable and serving
(`services/gateway/engine_health.py`); ``GET /ready`` runs a real one-token generation.
SIGTERM: NOT_SERVING and 503 for new requests, live streams get ``--drain-timeout`` seconds to finish, then
every stream still live is ended with a final "abort" message, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys


async def run(args: argparse.Namespace) -> int:
    from observability import tracing

    tracing.setup("shinkai-gateway")
    from observability.metrics import EngineLoadsCollector, RequestMetrics
    from services.engine.model_info import ModelInfo
    from services.gateway.admission import Admission, admission_limits
    from services.gateway.api_server import ApiServer
    from services.gateway.auth import Keys, tls_files
    from services.gateway.engine_health import EngineHealth
    from services.gateway.frontend import Frontend
    from services.gateway.http_timeouts import http_timeouts
    from services.gateway.image_fetcher import ImageFetcher
    from services.gateway.prompt_blocks import PromptBlocks
    from services.gateway.remote import RemoteEngine, RemoteTokenizer
    from services.gateway.router import EngineRouter

    engines = []
    for i, spec in enumerate(args.engine):
        name, _, address = spec.rpartition("=")
        engines.append(RemoteEngine(name or f"engine-{i}", address))
    metrics = RequestMetrics()
    router = EngineRouter(
        engines,
        on_route=lambda replica: metrics.routed.labels(engine=replica).inc(),
        overlap_weight=args.router_overlap_weight,
    )
    if args.nats_url:
        await router.subscribe(args.nats_url)
    from services.engine.structured.constraint import warm
    from services.gateway.engine_health import first_serving

    await asyncio.to_thread(warm)  # a first structured request's imports, paid here (beside the engines' load)
    remote_info = await (await first_serving(engines)).model_info()  # `up` starts this process beside its engines
    info = ModelInfo(
        model=remote_info.model,
        vocab_size=remote_info.vocab_size,
        max_model_len=remote_info.max_model_len,
        bos_token_id=remote_info.bos_token_id,
        eos_token_id=remote_info.eos_token_id,
        max_num_seqs=remote_info.max_num_seqs,
        block_size=remote_info.block_size or None,  # 0: an engine that does not say
        image_placeholder_id=(
            remote_info.image_placeholder_id if remote_info.HasField("image_placeholder_id") else None
        ),
    )
    if info.block_size is not None:  # cache-aware routing: prompts hashed as the engines' caches name blocks
        router.blocks = PromptBlocks(info.model, info.block_size, info.image_placeholder_id)
    # vLLM's gauge names, summed over the engines' load reports, where vLLM clients look (this /metrics).
    metrics.registry.register(
        EngineLoadsCollector(lambda: [s.report for s in router.states.values() if s.report is not None], info.model)
    )
    tokenizer = RemoteTokenizer(args.tokenizer)
    frontend = Frontend(
        info,
        router,
        tokenizer,
        metrics,
        image_fetcher=ImageFetcher(timeout_s=args.image_fetch_timeout, allow_private=args.allow_private_image_urls),
        admission=Admission(admission_limits(args)),
    )
    api = ApiServer(
        frontend,
        args.host,
        args.http_port,
        args.grpc_port,
        Keys.from_args(args.api_key),
        tls_files(args.ssl_certfile, args.ssl_keyfile),
        http_timeouts=http_timeouts(args),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine_health = EngineHealth(router, api.set_problem, tokenizer_channel=tokenizer.channel)
    await engine_health.poll()  # SERVING from the start only if an engine is
    await api.start()
    watching = asyncio.create_task(engine_health.run())
    print(
        json.dumps(
            {
                "event": "ready",
                "service": "gateway",
                **api.urls(),
                "http_port": api.http_port,
                "grpc_port": api.grpc_port,
                "model": info.model,
                "engines": len(engines),
            }
        ),
        flush=True,
    )
    await stop.wait()
    watching.cancel()
    await api.close_intake()
    deadline = loop.time() + args.drain_timeout
    while router.streams and loop.time() < deadline:
        await asyncio.sleep(0.05)
    aborted = router.abort_live()  # past the grace period: each still-live client gets a final "abort"
    deadline = loop.time() + 5.0
    while router.streams and loop.time() < deadline:  # until their readers have sent those finals
        await asyncio.sleep(0.05)
    await api.stop()
    await router.close()
    await tokenizer.close()
    routed = {name: s.num_routed for name, s in router.states.items()}
    print(
        json.dumps({"event": "stopped", "service": "gateway", "routed": routed, "aborted_at_drain": aborted}),
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    import logging

    p = argparse.ArgumentParser(prog="python -m services.entrypoints.gateway", description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="tokenizer service address host:port")
    p.add_argument("--engine", action="append", required=True, help="[name=]host:port of an engine; repeat")
    p.add_argument("--nats-url", default=None, help="route by the engines' load reports from here")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000, help="0: any free port")
    p.add_argument("--grpc-port", type=int, default=50051, help="0: any free port")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="key callers must send (repeatable; default: $SHINKAI_API_KEY; none: open)",
    )
    p.add_argument("--ssl-certfile", default=None, help="PEM certificate: serve HTTPS and TLS gRPC")
    p.add_argument("--ssl-keyfile", default=None, help="PEM private key of --ssl-certfile")
    p.add_argument(
        "--allow-private-image-urls",
        action="store_true",
        help="fetch image URLs that resolve to private, loopback or link-local addresses (default: refused)",
    )
    p.add_argument("--image-fetch-timeout", type=float, default=10.0, help="seconds to fetch one http(s) image URL")
    from services.gateway.router import DEFAULT_OVERLAP_WEIGHT

    p.add_argument(
        "--router-overlap-weight",
        type=float,
        default=DEFAULT_OVERLAP_WEIGHT,
        help=(
            "cache-aware routing: blocks of load that one block of a prompt cached on an engine is worth "
            "(NVIDIA Dynamo's overlap score weight; higher keeps conversations on their engine, 0 ignores caches; "
            "docs/serving.md)"
        ),
    )
    from services.gateway.admission import add_admission_arguments
    from services.gateway.http_timeouts import add_http_timeout_arguments

    add_http_timeout_arguments(p)
    add_admission_arguments(p)
    args = p.parse_args(argv)
    if args.router_overlap_weight < 0:
        p.error("--router-overlap-weight must be at least 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
