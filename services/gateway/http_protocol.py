"""The gateway's HTTP/1.1 connection (uvicorn's h11 protocol) with read deadlines on a request's headers and body.

uvicorn closes an idle kept-alive connection, but it never times out a request that is arriving: a client that
sends half its headers, or headers that promise a body it never sends (a slowloris), holds its connection and
its task for as long as it likes. Here a request's headers must arrive in full within ``header_s`` of the
connection opening or of the request's first byte on a kept-alive connection, and its body within ``body_s``
of the headers' end. Past either deadline the client gets a 408 (an OpenAI error body, ``Connection: close``)
and the connection is closed. Nothing was queued: the body is parsed, and the request started, only once all
of it has arrived. An idle kept-alive connection is uvicorn's (``timeout_keep_alive``).

The phase follows h11's view of the client (``their_state``): IDLE while headers arrive, SEND_BODY while the
body does, DONE once the request is whole (no deadline while the response is made).
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.gateway.http_timeouts import HttpTimeouts


def _timeout_response(what: str, seconds: float) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"the request's {what} did not arrive within {seconds:g} s",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _DeadlinedH11(H11Protocol):
    timeouts: HttpTimeouts = HttpTimeouts()  # set on the subclass ``protocol_with`` makes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._phase: str | None = None  # "headers", "body" or None: what the armed deadline waits for
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._phase is None:  # a kept-alive connection's next request has begun
                self._arm("headers")
        elif state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body")
        else:
            self._arm(None)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:
            self._arm(None)  # idle until the next request's first byte: uvicorn's keep-alive timeout

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def _arm(self, phase: str | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            seconds = self.timeouts.header_s if phase == "headers" else self.timeouts.body_s
            self._deadline = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _expired(self, phase: str, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if phase == "body" else None
        if cycle is None or not cycle.response_started:
            self.transport.write(_timeout_response(phase, seconds))
        if cycle is not None:
            cycle.disconnected = True  # the handler reading the body sees the client gone, and sends nothing
            cycle.message_event.set()
        self.transport.close()


def protocol_with(timeouts: HttpTimeouts) -> type[H11Protocol]:
    """uvicorn's ``Config(http=...)``: the h11 protocol with these deadlines."""
    return type("DeadlinedH11", (_DeadlinedH11,), {"timeouts": timeouts})
