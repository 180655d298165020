"""The multimodal process: ``python -m services.entrypoints.multimodal --model tiny --grpc-addr 127.0.0.1:0``.

Serves ``multimodal.v1.Multimodal`` (services/multimodal/service.py) and grpc.health.v1, and prints one JSON
ready line with its ports.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import grpc

from observability import tracing
from services import service_auth
from services.grpc_errors import AioNoInternalText
from services.grpc_host import serve_until_signalled
from services.multimodal.preprocess import ImageLimits
from services.multimodal.service import ENCODE_DELAY_ENV, GRPC_OPTIONS, SERVICE, MultimodalApi

DESCRIPTION = "The multimodal service: multimodal.v1.Multimodal over gRPC, plus grpc.health.v1."


async def serve(api: MultimodalApi, grpc_addr: str, metrics_port: int | None = None) -> int:
    server = grpc.aio.server(
        options=GRPC_OPTIONS, interceptors=[*service_auth.server_interceptors(), AioNoInternalText()]
    )
    server.add_generic_rpc_handlers((api.handler(),))
    return await serve_until_signalled(
        server,
        service="multimodal",
        health_name=SERVICE,
        grpc_addr=grpc_addr,
        metrics_port=metrics_port,
        registry=api.registry,
    )


def main(argv: list[str] | None = None) -> int:
    from services.multimodal.encoder_source import load_encoder

    p = argparse.ArgumentParser(prog="python -m services.entrypoints.multimodal", description=DESCRIPTION)
    p.add_argument("--model", default="tiny", help="checkpoint directory or preset name")
    p.add_argument("--model-seed", type=int, default=0, help="a preset's weight seed (the engines' --model-seed)")
    p.add_argument("--device", default="cpu", help="where the tower runs (cpu, cuda, cuda:1, ...)")
    p.add_argument("--grpc-addr", default="127.0.0.1:0", help="bind address (port 0: any)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (0: any; default: none)")
    p.add_argument("--max-batch-images", type=int, default=8, help="images per tower call, at most")
    p.add_argument("--cache-mb", type=int, default=256, help="embedding cache size in MiB (by content hash)")
    p.add_argument("--max-image-bytes", type=int, default=ImageLimits.max_bytes, help="encoded bytes per image")
    p.add_argument("--max-image-pixels", type=int, default=ImageLimits.max_pixels, help="decoded pixels per image")
    p.add_argument(
        "--encode-delay-s",
        type=float,
        default=float(os.environ.get(ENCODE_DELAY_ENV, "0")),
        help=f"test-only fault: seconds each Encode waits first (default: ${ENCODE_DELAY_ENV} or 0)",
    )
    args = p.parse_args(argv)
    tracing.setup("shinkai-multimodal")
    cfg, encoder = load_encoder(args.model, args.model_seed)
    api = MultimodalApi(
        cfg,
        encoder.to(args.device),
        ImageLimits(args.max_image_bytes, args.max_image_pixels),
        args.cache_mb * 2**20,
        args.max_batch_images,
        args.encode_delay_s,
    )
    return asyncio.run(serve(api, args.grpc_addr, args.metrics_port))


if __name__ == "__main__":
    sys.exit(main())
