"""A chat's image URLs → the images' bytes, for the engine: data URLs decoded, http(s) URLs fetched
(concurrently, each on a worker thread so the event loop keeps serving) under the byte limit, a deadline
and the SSRF rule (services/multimodal/image_fetch.py). Every refusal is a 400 naming the problem."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.gateway import errors
from services.multimodal.image_fetch import fetch_image
from services.multimodal.preprocess import ImageInputError, ImageLimits

DEFAULT_FETCH_TIMEOUT_S = 10.0


class ImageFetcher:
    def __init__(
        self,
        limits: ImageLimits = ImageLimits(),
        timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
        allow_private: bool = False,
    ) -> None:
        self.limits = limits  # max_bytes per image and max_images per request are checked here
        self.timeout_s = timeout_s  # per http(s) image, the whole fetch
        self.allow_private = allow_private  # True: URLs may resolve to private / loopback / link-local addresses

    async def fetch(self, urls: Sequence[str]) -> list[bytes]:
        if len(urls) > self.limits.max_images:
            raise errors.invalid(
                f"{len(urls)} images in one request, over the limit of {self.limits.max_images}", "messages"
            )
        try:
            return list(
                await asyncio.gather(
                    *(
                        asyncio.to_thread(fetch_image, url, self.limits.max_bytes, self.timeout_s, self.allow_private)
                        for url in urls
                    )
                )
            )
        except ImageInputError as err:
            raise errors.invalid(str(err), "messages") from err
