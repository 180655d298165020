"""One engine made ready to serve an API: what `shinkai serve` (services/gateway/server.py) and an engine
process (services/entrypoints/engine.py) share.

Both put a `Frontend` and an `ApiServer` in front of it; this module builds the part behind them and owns the
order in which they start and stop, so the two servers cannot drift apart.
"""

from __future__ import annotations

import logging
from typing import Protocol

from model.deepseek_v41.tokenizer import V41_VOCAB_SIZE, v41_tokenizer_path
from observability.metrics import EngineMetrics, RequestMetrics
from services.engine.images.prompt import ImageEncoder, ImagePrompts
from services.engine.llm import LLM
from services.engine.model_info import ModelInfo
from services.engine.service import DEFAULT_MAX_QUEUED, EngineService
from services.tokenizer.chat import IMAGE_PLACEHOLDER, ChatRenderer

log = logging.getLogger("shinkai.engine.served")


class Api(Protocol):
    """The listeners in front of the engine (`services.gateway.api_server.ApiServer`)."""

    async def start(self) -> None: ...

    async def close_intake(self) -> None: ...

    async def stop(self) -> None: ...


class ServedEngine:
    """``llm``'s engine behind an `EngineService`, with what an API needs to describe and watch it."""

    def __init__(
        self,
        llm: LLM,
        *,
        served_model_name: str,
        replica: str,
        max_queued: int = DEFAULT_MAX_QUEUED,
        image_encoder: ImageEncoder | None = None,
    ) -> None:
        """``image_encoder``: where image requests are encoded (the multimodal service); None: the model's own
        tower in this process, when it has one and the worker is in-process."""
        self.llm = llm
        if llm.engine.hashes is not None:
            llm.engine.hashes.model = served_model_name  # the gateway's router hashes prompts under this name
        self.service = EngineService(llm.engine, replica=replica, max_queued=max_queued)
        self.metrics = RequestMetrics()  # the endpoint's registry: request metrics, then the engine's
        cfg = llm.source.config
        # The renderer encodes with the V4.1 tokenizer, so only a model with that vocabulary renders chat.
        self.chat = ChatRenderer(v41_tokenizer_path()) if cfg.vocab_size == V41_VOCAB_SIZE else None
        refusal = _image_refusal(llm, image_encoder)
        self.images = ImagePrompts(
            cfg.vision,
            llm.tokenizer.token_to_id(IMAGE_PLACEHOLDER),
            (image_encoder or _own_tower(llm)) if cfg.vision is not None and refusal is None else None,
            refusal=refusal,
        )
        self.info = ModelInfo(
            model=served_model_name,
            vocab_size=cfg.vocab_size,
            max_model_len=llm.config.max_model_len,
            bos_token_id=cfg.bos_token_id,
            eos_token_id=cfg.eos_token_id,
            max_num_seqs=llm.config.max_num_seqs,
            block_size=llm.config.block_size,
            image_placeholder_id=self.images.placeholder_id if cfg.vision is not None else None,
        )
        stats = self.service.stats()
        self.service.observer.metrics = EngineMetrics(
            self.metrics.registry,
            self.service.stats,
            self.info.model,
            {
                "engine": replica,
                "block_size": llm.config.block_size,
                "num_gpu_blocks": stats.total_blocks,
                "num_state_slots": stats.total_state_slots,
            },
        )

    async def start(self, api: Api) -> None:
        """Starts the step thread, then the listeners; a failed start leaves no thread behind."""
        self.service.start()
        try:
            await api.start()
        except BaseException:
            self.service.stop()
            raise

    async def stop(self, api: Api, drain_timeout_s: float) -> None:
        """Intake closed, live requests get ``drain_timeout_s``, the rest aborted, so the pools are whole when
        the step thread exits; then the listeners close."""
        await api.close_intake()
        if not await self.service.drain(drain_timeout_s):
            log.warning(
                "%d requests still live after %.0f s; aborting them", self.service.num_unfinished(), drain_timeout_s
            )
        self.service.stop()  # aborts the rest; the step thread finishes every request before it exits
        await api.stop()


def _image_refusal(llm: LLM, image_encoder: ImageEncoder | None) -> str | None:
    """Why this engine cannot run image requests although its model may have a tower; None: it can. Every
    backend and worker kind takes image rows (the kernel router's ``bias_vl``, worker.v1 ``SetImages``);
    what can be missing is a worker without ``set_images``, or any encoder at all: an engine whose remote
    worker holds the weights has no tower of its own, so it needs the multimodal service."""
    if getattr(llm.engine.worker, "set_images", None) is None:
        return f"this engine takes no images: its worker ({type(llm.engine.worker).__name__}) takes no image embeddings"
    if image_encoder is None and llm.source.model is None:
        return (
            "this engine takes no images: its worker is remote (the weights are there, not here) and it has no "
            "multimodal service to encode them; start it with --multimodal HOST:PORT"
        )
    return None


def _own_tower(llm: LLM) -> ImageEncoder:
    """The model's vision tower behind an in-process `MultimodalApi` (its cache and batching, no gRPC)."""
    from services.engine.images.encoder import InProcessEncoder
    from services.multimodal.service import MultimodalApi

    return InProcessEncoder(MultimodalApi(llm.source.config, llm.source.model.encoder))
