"""The multimodal service: ``multimodal.v1.Multimodal`` over gRPC, plus grpc.health.v1.

``python -m services.entrypoints.multimodal --model tiny --grpc-addr 127.0.0.1:0`` prints one JSON ready line with
its port. ``Encode`` preprocesses the image on a worker thread, looks its content hash up in the cache,
and otherwise queues it for the batcher, which runs the tower on everything queued at once; calls for the
same bytes in flight at the same time share one encode. Embeddings travel as gRPC bytes (fp32, little
endian): one format whether the engine is on this host or another. Bad input is INVALID_ARGUMENT naming
the problem, and the service keeps serving. SIGTERM: health NOT_SERVING, live calls finish.
"""

from __future__ import annotations

import asyncio

import grpc
import prometheus_client as prom
import torch
from google.protobuf.message import DecodeError

from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.image_grid import ImageGrid
from model.deepseek_v41.vision import ImageEncoder
from observability import metrics as names
from observability import tracing
from services.multimodal.batcher import EncodeBatcher
from services.multimodal.embedding_cache import EmbeddingCache, EncodedImage, content_hash
from services.multimodal.preprocess import ImageInputError, ImageLimits, PreparedImage, peek_grid, prepare_image
from services.proto.multimodal.v1 import multimodal_pb2 as pb

SERVICE = "multimodal.v1.Multimodal"
# A test-only fault: seconds every Encode waits before encoding (the readiness gate's tests make encodes slow
# with it). The --encode-delay-s flag's default; unset: 0.
ENCODE_DELAY_ENV = "SHINKAI_MULTIMODAL_ENCODE_DELAY_S"
MAX_MESSAGE_BYTES = 64 * 2**20  # a released span is at most 1,024 × 5,120 fp32 = 20 MiB
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def plan_message(grid: ImageGrid) -> pb.PlanResponse:
    return pb.PlanResponse(
        num_tokens=grid.num_tokens, rows=grid.rows, cols=grid.cols, width=grid.width, height=grid.height
    )


class MultimodalApi:
    def __init__(
        self,
        cfg: ModelConfig,
        encoder: ImageEncoder,
        limits: ImageLimits = ImageLimits(),
        cache_bytes: int = 256 * 2**20,
        max_batch_images: int = 8,
        encode_delay_s: float = 0.0,
    ) -> None:
        if cfg.vision is None:
            raise ValueError("the model has no vision tower")
        self.cfg, self.vcfg, self.encoder, self.limits = cfg, cfg.vision, encoder, limits
        self.registry = prom.CollectorRegistry()
        self.images_encoded = prom.Counter(
            names.MULTIMODAL_IMAGES_ENCODED, "images the vision tower ran on", registry=self.registry
        )
        self.cache_hits = prom.Counter(
            names.MULTIMODAL_CACHE_HITS, "Encode calls served from the cache", registry=self.registry
        )
        self.encode_seconds = prom.Histogram(
            names.MULTIMODAL_ENCODE_SECONDS,
            "seconds per vision-tower batch",
            buckets=names.LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_images = prom.Histogram(
            names.MULTIMODAL_BATCH_IMAGES,
            "images per vision-tower batch",
            buckets=(1, 2, 4, 8, 16, 32),
            registry=self.registry,
        )
        self.cache = EmbeddingCache(cache_bytes)
        self.batcher = EncodeBatcher(self.run_tower, max_batch_images, on_batch=self._batch_done)
        self._in_flight: dict[str, asyncio.Future] = {}  # content hash → the encode every caller awaits
        self.encode_delay_s = encode_delay_s  # a test-only fault: each encode waits this long first

    def run_tower(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """One tower call over a batch of images → their spans [num_tokens, D] fp32 (a worker thread)."""
        grids = [(image.grid.patch_rows, image.grid.patch_cols) for image in images]
        device = self.encoder.image_start.device
        with torch.no_grad():
            spans = self.encoder(torch.cat([image.patches for image in images]).to(device), grids)
        return [span.float().cpu().contiguous() for span in spans]

    def _batch_done(self, num_images: int, seconds: float) -> None:
        self.images_encoded.inc(num_images)
        self.batch_images.observe(num_images)
        self.encode_seconds.observe(seconds)

    async def encoded(self, data: bytes) -> tuple[EncodedImage, bool, str]:
        """(span and grid, whether the cache answered, content hash); ImageInputError for bad bytes."""
        if self.encode_delay_s:
            await asyncio.sleep(self.encode_delay_s)
        key = content_hash(data)
        hit = self.cache.get(key)
        if hit is not None:
            self.cache_hits.inc()
            return hit, True, key
        pending = self._in_flight.get(key)
        if pending is not None:
            return await asyncio.shield(pending), False, key
        future = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            prepared = await asyncio.to_thread(prepare_image, data, self.vcfg, self.limits)
            entry = EncodedImage(prepared.grid, await self.batcher.encode(prepared))
            self.cache.put(key, entry)
            future.set_result(entry)
            return entry, False, key
        except BaseException as err:
            future.set_exception(err)
            future.exception()  # retrieved: a failure nobody else awaited is not logged as lost
            raise
        finally:
            del self._in_flight[key]

    @staticmethod
    async def _parse(raw: bytes, context: grpc.aio.ServicerContext) -> pb.ImageRequest:
        request = pb.ImageRequest()
        try:
            request.ParseFromString(raw)
        except DecodeError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed multimodal.v1.ImageRequest: {err}")
        return request

    async def plan(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.PlanResponse:
        request = await self._parse(raw, context)
        try:
            grid = peek_grid(request.image, self.vcfg, self.limits)
        except ImageInputError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return plan_message(grid)

    async def encode(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        request = await self._parse(raw, context)
        try:
            with tracing.span(
                "multimodal.Encode", tracing.extract(context.invocation_metadata()), kind=tracing.SpanKind.SERVER
            ):
                entry, cached, key = await self.encoded(request.image)
        except ImageInputError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return pb.EncodeResponse(
            plan=plan_message(entry.grid),
            hidden_size=entry.span.shape[1],
            embeddings=entry.span.numpy().astype("<f4").tobytes(),
            cached=cached,
            content_hash=key,
        )

    def handler(self) -> grpc.GenericRpcHandler:
        def ser(message) -> bytes:
            return message.SerializeToString()

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Plan": grpc.unary_unary_rpc_method_handler(self.plan, response_serializer=ser),
                "Encode": grpc.unary_unary_rpc_method_handler(self.encode, response_serializer=ser),
            },
        )
