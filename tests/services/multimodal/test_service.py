"""The multimodal service over gRPC: spans equal the tower's own, the cache answers repeats, concurrent
images share tower calls, bad input is INVALID_ARGUMENT naming the problem while the service keeps
serving; the tower from a checkpoint directory is the preset's. (The process itself starts healthy, exports
its metrics and stops on SIGTERM in tests/e2e/test_stack.py.)"""

from __future__ import annotations

import asyncio
import io

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from observability import metrics as names
from services.multimodal.encoder_source import load_encoder
from services.multimodal.preprocess import ImageLimits, prepare_image
from services.multimodal.service import GRPC_OPTIONS, MultimodalApi
from services.proto.multimodal.v1 import multimodal_pb2 as pb

pytestmark = pytest.mark.timeout(120)
ENCODE, PLAN = "/multimodal.v1.Multimodal/Encode", "/multimodal.v1.Multimodal/Plan"


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def tiny_encoder():
    return load_encoder("tiny", 0)


def run_with_server(api: MultimodalApi, body):
    """Runs ``body(call)`` against an in-process server; ``call(method, image)`` → (response, None) or
    (None, (code, details))."""

    async def main():
        server = grpc.aio.server(options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers((api.handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:

                async def call(method: str, image: bytes):
                    reply_type = pb.EncodeResponse if method == ENCODE else pb.PlanResponse
                    rpc = channel.unary_unary(
                        method,
                        request_serializer=pb.ImageRequest.SerializeToString,
                        response_deserializer=reply_type.FromString,
                    )
                    try:
                        return await rpc(pb.ImageRequest(image=image), timeout=60), None
                    except grpc.aio.AioRpcError as err:
                        return None, (err.code(), err.details())

                return await body(call)
        finally:
            await server.stop(None)

    return asyncio.run(main())


def span_of(reply: pb.EncodeResponse) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(reply.embeddings, dtype="<f4").copy()).view(-1, reply.hidden_size)


def sample(api: MultimodalApi, name: str) -> float:
    return api.registry.get_sample_value(name) or 0.0


def test_encode_returns_the_towers_span_and_caches_it(tiny_encoder):
    cfg, encoder = tiny_encoder
    api = MultimodalApi(cfg, encoder)
    image = png(100, 80)

    async def body(call):
        return [await call(PLAN, image), await call(ENCODE, image), await call(ENCODE, image)]

    (plan, _), (first, _), (second, _) = run_with_server(api, body)
    prepared = prepare_image(image, cfg.vision, ImageLimits())
    with torch.no_grad():
        expected = encoder(prepared.patches, [(prepared.grid.patch_rows, prepared.grid.patch_cols)])[0]
    assert (
        (plan.num_tokens, plan.rows, plan.cols)
        == (prepared.grid.num_tokens, prepared.grid.rows, prepared.grid.cols)
        == (10, 2, 3)
    )
    assert first.plan == plan and first.hidden_size == cfg.hidden_size and not first.cached
    assert torch.equal(span_of(first), expected)
    assert second.cached and second.embeddings == first.embeddings and second.content_hash == first.content_hash
    assert sample(api, names.MULTIMODAL_IMAGES_ENCODED + "_total") == 1
    assert sample(api, names.MULTIMODAL_CACHE_HITS + "_total") == 1
    assert sample(api, names.MULTIMODAL_ENCODE_SECONDS + "_count") == 1


def test_concurrent_images_share_tower_calls(tiny_encoder):
    cfg, encoder = tiny_encoder
    api = MultimodalApi(cfg, encoder, max_batch_images=8)
    images = [png(60 + 13 * i, 90 - 5 * i, seed=i) for i in range(8)] + [png(60, 90, seed=0)]  # one repeat

    async def body(call):
        return await asyncio.gather(*(call(ENCODE, image) for image in images))

    replies = [reply for reply, _ in run_with_server(api, body)]
    assert sample(api, names.MULTIMODAL_IMAGES_ENCODED + "_total") == 8  # the repeat shared the first encode
    assert sample(api, names.MULTIMODAL_ENCODE_SECONDS + "_count") < 8  # fewer tower calls than images
    for image, reply in zip(images, replies):
        prepared = prepare_image(image, cfg.vision, ImageLimits())
        with torch.no_grad():
            alone = encoder(prepared.patches, [(prepared.grid.patch_rows, prepared.grid.patch_cols)])[0]
        # Batched vs alone: the GEMMs' row blocking (tests/model/deepseek_v41/test_vision.py derives 1e-6).
        assert float((span_of(reply) - alone).abs().max()) <= 1e-6 * float(alone.abs().max())


def test_bad_images_are_invalid_argument_and_the_service_keeps_serving(tiny_encoder):
    cfg, encoder = tiny_encoder
    api = MultimodalApi(cfg, encoder, limits=ImageLimits(max_bytes=30_000, max_pixels=40_000))
    tiff = io.BytesIO()
    Image.new("RGB", (20, 20)).save(tiff, "TIFF")
    flat = io.BytesIO()
    Image.new("RGB", (300, 300)).save(flat, "PNG")
    bad = [
        (b"", "empty"),
        (b"GIF89a garbage", "corrupt|supported"),
        (png(50, 50)[:400], "truncated"),
        (tiff.getvalue(), "TIFF is not supported"),
        (png(120, 120), "over the limit of 30000"),
        (flat.getvalue(), "90000 pixels, over the limit of 40000"),
    ]

    async def body(call):
        out = []
        for image, _ in bad:
            out.append(await call(ENCODE, image))
        out.append(await call(PLAN, bad[4][0][:0]))
        out.append(await call(ENCODE, png(40, 40)))
        return out

    replies = run_with_server(api, body)
    for (image, pattern), (reply, error) in zip(bad, replies):
        assert reply is None and error[0] == grpc.StatusCode.INVALID_ARGUMENT, error
        assert __import__("re").search(pattern, error[1]), error[1]
    assert replies[-2][1][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert replies[-1][0] is not None and replies[-1][0].plan.num_tokens > 0


def test_a_checkpoint_directory_gives_the_presets_tower(tmp_path, tiny_encoder):
    from model.deepseek_v41.init import write_random_checkpoint
    from model.deepseek_v41.presets import TINY

    path = write_random_checkpoint(tmp_path / "tiny", TINY, 0)
    cfg, encoder = load_encoder(str(path))
    _, preset_encoder = tiny_encoder  # the preset drawn from the same seed
    assert cfg == TINY
    theirs = dict(preset_encoder.named_parameters())
    for name, value in encoder.named_parameters():
        assert torch.equal(value, theirs[name]), name
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a preset"):
        load_encoder(str(tmp_path / "missing"))
