"""The tokenizer process: ``python -m services.entrypoints.tokenizer --model tiny --grpc-addr 127.0.0.1:0``.

Serves ``tokenizer.v1.Tokenizer`` (services/tokenizer/service.py) and grpc.health.v1, and prints one JSON
ready line with its ports.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from observability import tracing
from services import service_auth
from services.grpc_errors import AioNoInternalText
from services.grpc_host import serve_until_signalled
from services.tokenizer.service import SERVICE, TokenizerApi, load_vocabulary

DESCRIPTION = "The tokenizer service: tokenizer.v1.Tokenizer over gRPC, plus grpc.health.v1."


async def serve(model: str, grpc_addr: str, metrics_port: int | None = None) -> int:
    tracing.setup("shinkai-tokenizer")
    tokenizer, bos = load_vocabulary(model)
    server = grpc.aio.server(interceptors=[*service_auth.server_interceptors(), AioNoInternalText()])
    api = TokenizerApi(tokenizer, bos)
    await api.warm()  # before serving: the first call finds it done
    server.add_generic_rpc_handlers((api.handler(),))
    return await serve_until_signalled(
        server,
        service="tokenizer",
        health_name=SERVICE,
        grpc_addr=grpc_addr,
        metrics_port=metrics_port,
        registry=api.registry,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.entrypoints.tokenizer", description=DESCRIPTION)
    p.add_argument("--model", default="tiny", help="checkpoint directory or preset name")
    p.add_argument("--grpc-addr", default="127.0.0.1:0", help="bind address (port 0: any)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (0: any; default: none)")
    args = p.parse_args(argv)
    return asyncio.run(serve(args.model, args.grpc_addr, args.metrics_port))


if __name__ == "__main__":
    sys.exit(main())
