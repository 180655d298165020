"""Image bytes built to hurt a decoder: headers that promise more pixels than their data holds (decompression
bombs), truncated and corrupted files, and random damage to valid files (a hypothesis strategy), for the
preprocessing tests and the gateway's fuzz test."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from hypothesis import strategies as st
from PIL import Image


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bilevel_png(width: int, height: int, num_rows: int | None = None) -> bytes:
    """A 1-bit greyscale PNG whose header says width × height and whose data holds ``num_rows`` zero rows
    (all of them by default): 20000 × 20000 compresses to about 57 KB."""
    num_rows = height if num_rows is None else num_rows
    row = b"\0" * (1 + (width + 7) // 8)  # filter byte, then the packed bits
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    pixels = zlib.compress(row * num_rows, 9)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", pixels) + _chunk(b"IEND", b"")


def encoded(width: int, height: int, fmt: str, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


HOSTILE = {
    # name: (bytes, a phrase the refusal must hold, whether the header alone shows the problem)
    "bomb: 20000x20000 1-bit PNG, every row": (bilevel_png(20000, 20000), "400000000 pixels", True),
    "bomb: 20000x20000 1-bit PNG, 10 rows": (bilevel_png(20000, 20000, 10), "400000000 pixels", True),
    "bomb under Pillow's limit, over ours": (bilevel_png(10000, 6000, 10), "60000000 pixels", True),
    "PNG header of 2^31-1 x 1": (bilevel_png(2**31 - 1, 1, 1), "pixels, over the limit", True),
    "PNG cut after 100 bytes": (encoded(64, 64, "PNG")[:100], "corrupt or truncated", False),
    "JPEG cut after 200 bytes": (encoded(64, 64, "JPEG")[:200], "corrupt or truncated", True),
    "WEBP cut in half": (encoded(64, 64, "WEBP")[:60], "corrupt", True),
    "GIF header of 65535x65535, no data": (b"GIF89a\xff\xff\xff\xff\0\0\0;", "corrupt", True),
    "PNG signature, then garbage": (b"\x89PNG\r\n\x1a\n" + b"\xff" * 50, "not in a supported format", True),
}
"""Each refused with an ImageInputError holding the phrase by ``prepare_image``, and by ``peek_grid`` (the header
check) where the header shows the problem."""

VALID = [encoded(24, 20, fmt, seed) for seed, fmt in enumerate(("PNG", "JPEG", "WEBP", "GIF"))]


@st.composite
def damaged_images(draw) -> bytes:
    """A valid small image with random damage: bytes overwritten, a cut, a splice of another file's tail,
    or a header field (PNG width/height) set to anything."""
    data = bytearray(draw(st.sampled_from(VALID)))
    kind = draw(st.sampled_from(("overwrite", "cut", "splice", "png-size")))
    if kind == "overwrite":
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    elif kind == "cut":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif kind == "splice":
        other = draw(st.sampled_from(VALID))
        data = data[: draw(st.integers(0, len(data)))] + other[draw(st.integers(0, len(other))) :]
    else:
        png = bytearray(bilevel_png(8, 8))
        png[16:24] = struct.pack(">II", draw(st.integers(0, 2**31 - 1)), draw(st.integers(0, 2**31 - 1)))
        data = png  # the CRC no longer matches: Pillow checks it only on load
    return bytes(data)
