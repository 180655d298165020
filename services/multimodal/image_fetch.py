"""An ``image_url`` → the image's bytes: data URLs decoded, http(s) URLs fetched with a byte limit and a
deadline, every other scheme (``file:`` above all) refused. Each refusal is an ``ImageInputError``
naming the URL's problem (a 400).

The SSRF rule: unless ``allow_private``, an http(s) URL (and every redirect it takes) is fetched only from
a public address. The host is resolved here, every address it resolves to is checked (private, loopback,
link-local, multicast, reserved and unspecified ones are refused: ``ipaddress``'s ``is_global`` is the
test), and the connection goes to the checked address itself, so a second resolution cannot swap in
another one. Proxies from the environment are never used.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

from services.multimodal.preprocess import ImageInputError

SCHEMES = ("data", "http", "https")
READ_BYTES = 64 * 1024  # one read of a fetch; the deadline is checked between reads


def fetch_image(url: str, max_bytes: int, timeout_s: float = 10.0, allow_private: bool = False) -> bytes:
    """The encoded image ``url`` names, at most ``max_bytes`` long, fetched within ``timeout_s`` seconds
    in all (plus at most one socket timeout); ``allow_private`` lifts the SSRF rule."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in SCHEMES:
        raise ImageInputError(f"image_url scheme {scheme or '(none)'!r} is not supported; use data, http or https")
    if scheme == "data":
        return _data_url(url, max_bytes)
    deadline = time.monotonic() + timeout_s
    opener = _OPEN_ANY if allow_private else _OPEN_PUBLIC
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "shinkai"}), timeout=timeout_s) as reply:
            data = b""
            while len(data) <= max_bytes:
                if time.monotonic() > deadline:
                    raise ImageInputError(f"image_url {_short(url)} took over {timeout_s:g} s to fetch")
                chunk = reply.read1(min(READ_BYTES, max_bytes + 1 - len(data)))  # what has arrived: no waiting for more
                if not chunk:
                    break
                data += chunk
    except RefusedAddress as err:
        raise ImageInputError(f"image_url {_short(url)} is refused: {err}") from None
    except urllib.error.URLError as err:
        if isinstance(err.reason, RefusedAddress):
            raise ImageInputError(f"image_url {_short(url)} is refused: {err.reason}") from None
        raise ImageInputError(f"image_url {_short(url)} could not be fetched: {err.reason}") from None
    except (OSError, ValueError, http.client.HTTPException) as err:
        if isinstance(err, ImageInputError):
            raise
        raise ImageInputError(f"image_url {_short(url)} could not be fetched: {err}") from None
    if len(data) > max_bytes:
        raise ImageInputError(f"image_url {_short(url)} is over the limit of {max_bytes} bytes")
    return data


class RefusedAddress(OSError):
    """An address the SSRF rule refuses (an OSError so urllib passes it through as a URLError's reason)."""


def public_address(host: str, port: int) -> str:
    """The first address ``host`` resolves to, when every one of them is global; else RefusedAddress."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise OSError(f"cannot resolve {host!r}: {err.strerror}") from None
    addresses = [info[4][0] for info in infos]
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if not ip.is_global or ip.is_multicast:
            raise RefusedAddress(
                f"{host!r} resolves to {address}, a private, loopback, link-local, multicast or "
                "reserved address (the server refuses those unless started with "
                "--allow-private-image-urls)"
            )
    return addresses[0]


class _PublicHTTPConnection(http.client.HTTPConnection):
    def connect(self) -> None:
        self.sock = socket.create_connection((public_address(self.host, self.port), self.port), self.timeout)


class _PublicHTTPSConnection(http.client.HTTPSConnection):
    def connect(self) -> None:
        sock = socket.create_connection((public_address(self.host, self.port), self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


class _PublicHTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_PublicHTTPConnection, req)


class _PublicHTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
        return self.do_open(_PublicHTTPSConnection, req)


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects to http(s) only (urllib's default would follow ftp too)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise urllib.error.URLError(f"redirect to a non-http(s) URL {newurl[:80]!r}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_NO_PROXY = urllib.request.ProxyHandler({})
_OPEN_ANY = urllib.request.build_opener(_NO_PROXY, _HttpOnlyRedirects())
_OPEN_PUBLIC = urllib.request.build_opener(_NO_PROXY, _HttpOnlyRedirects(), _PublicHTTPHandler(), _PublicHTTPSHandler())


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
