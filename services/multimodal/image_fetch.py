"""An ``image_url`` → the image's bytes: data URLs decoded, http(s) URLs fetched with a byte limit and a
timeout, every other scheme (``file:`` above all) refused. Each refusal is an ``ImageInputError``
naming the URL's problem (a 400)."""

from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.parse
import urllib.request

from services.multimodal.preprocess import ImageInputError

SCHEMES = ("data", "http", "https")


def fetch_image(url: str, max_bytes: int, timeout_s: float = 10.0) -> bytes:
    """The encoded image ``url`` names, at most ``max_bytes`` long."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in SCHEMES:
        raise ImageInputError(f"image_url scheme {scheme or '(none)'!r} is not supported; use data, http or https")
    if scheme == "data":
        return _data_url(url, max_bytes)
    try:
        with _OPENER.open(urllib.request.Request(url, headers={"User-Agent": "shinkai"}), timeout=timeout_s) as reply:
            data = reply.read(max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise ImageInputError(f"image_url {_short(url)} could not be fetched: {reason}") from None
    if len(data) > max_bytes:
        raise ImageInputError(f"image_url {_short(url)} is over the limit of {max_bytes} bytes")
    return data


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects to http(s) only (urllib's default would follow ftp too)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise urllib.error.URLError(f"redirect to a non-http(s) URL {newurl[:80]!r}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HttpOnlyRedirects())


def _data_url(url: str, max_bytes: int) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ImageInputError("the image data URL has no ',' before its data")
    if len(payload) * 3 // 4 > max_bytes + 3:  # before decoding: base64 holds 3 bytes per 4 characters
        raise ImageInputError(f"the image data URL is over the limit of {max_bytes} bytes")
    if header.endswith(";base64"):
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageInputError("the image data URL is not valid base64") from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise ImageInputError(f"the image data URL is {len(data)} bytes, over the limit of {max_bytes}")
    return data


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."
