"""API keys: ``--api-key`` / ``SHINKAI_API_KEY``, checked on HTTP (``Authorization: Bearer``) and gRPC (the
same ``authorization`` metadata), as vLLM and OpenAI clients send them.

Invariants:
- With no key configured everything is open (the loopback default). With keys, every inference call needs
  one of them: HTTP 401, gRPC UNAUTHENTICATED otherwise. Health, readiness, metrics and the API description
  (`OPEN_PATHS`, grpc.health.v1) stay open, for probes and scrapers.
- Keys are compared in constant time, and never logged or echoed.
- A caller's requests live in its key's namespace (`Keys.owner`): Abort by request id reaches only the
  requests made with the same key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import urllib.parse
from collections.abc import Iterable

import grpc

from services.gateway import errors
from services.gateway.errors import ApiError

KEY_ENV = "SHINKAI_API_KEY"  # comma-separated keys, read when --api-key is not given
# HTTP paths any caller may read, key or not.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect"})
# gRPC services any caller may call.
OPEN_GRPC_SERVICES = frozenset({"grpc.health.v1.Health"})

UNAUTHENTICATED = errors.ErrorKind(401, grpc.StatusCode.UNAUTHENTICATED, "invalid_request_error")


class Keys:
    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = [k.encode() for k in keys if k]  # empty: no authentication

    @staticmethod
    def parse(api_keys: list[str] | None) -> tuple[str, ...]:
        """The ``--api-key`` values (each may hold comma-separated keys), else ``SHINKAI_API_KEY``'s."""
        raw = api_keys if api_keys else [os.environ.get(KEY_ENV, "")]
        return tuple(k.strip() for value in raw for k in value.split(",") if k.strip())

    @classmethod
    def from_args(cls, api_keys: list[str] | None) -> Keys:
        return cls(cls.parse(api_keys))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def match(self, presented: str | None) -> bytes | None:
        """The configured key equal to ``presented`` (constant time over every key), or None."""
        found = None
        candidate = (presented or "").encode()
        for key in self._keys:
            if hmac.compare_digest(key, candidate):
                found = key
        return found

    def check(self, authorization: str | None) -> str | None:
        """The caller's owner namespace for an ``Authorization`` value; raises 401 / UNAUTHENTICATED when keys
        are configured and it carries none of them. None when authentication is off."""
        if not self._keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        key = self.match(token.strip()) if scheme.lower() == "bearer" else None
        if key is None:
            why = "no API key was given" if not authorization else "the API key is not valid"
            raise ApiError(UNAUTHENTICATED, f"{why}: send Authorization: Bearer <key>", code="invalid_api_key")
        return owner(key)


def owner(key: bytes) -> str:
    """A key's request namespace: a short digest, so the key itself never travels to the engines."""
    return hashlib.sha256(b"shinkai-owner:" + key).hexdigest()[:16]


def grpc_authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value
    return None


def peer_host(peer: str | None) -> str | None:
    """The host of a gRPC peer ("ipv4:10.0.0.5:51234" -> "10.0.0.5", "ipv6:[::1]:5" -> "::1"): a client of an
    open API is its address, whatever connection or port it calls from. Other peers (unix sockets) as given."""
    if not peer:
        return None
    scheme, _, rest = urllib.parse.unquote(peer).partition(":")
    if scheme in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].strip("[]")
    return peer


def tls_files(certfile: str | None, keyfile: str | None) -> tuple[str, str] | None:
    """--ssl-certfile / --ssl-keyfile as a pair: both or neither (ValueError, a usage error, otherwise)."""
    if (certfile is None) != (keyfile is None):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together: give both or neither")
    return (certfile, keyfile) if certfile is not None and keyfile is not None else None
