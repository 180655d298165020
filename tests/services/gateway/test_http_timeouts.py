"""The gateway's HTTP read deadlines (services/gateway/http_protocol.py): a request whose headers or body stop
arriving gets a 408 and its connection closed after the configured timeout, not before, with nothing queued and
nothing logged as an error; a thousand such connections held open do not keep a normal request from being
served."""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.request

import pytest

from services.gateway.http_timeouts import HttpTimeouts
from tests.services.gateway.support import gateway_argv, own_server

pytestmark = pytest.mark.timeout(120)
HEADER_S, BODY_S = 1.0, 1.5
NUM_HELD = 1000


def _server(timeouts: HttpTimeouts):
    """A server of the test's own with these read deadlines (`own_server`: stopped on leaving, pools whole)."""
    return own_server(engine_args={"max_num_seqs": 4, "max_model_len": 64}, http_timeouts=timeouts)


@pytest.fixture(scope="module")
def short():
    with _server(HttpTimeouts(header_s=HEADER_S, body_s=BODY_S)) as thread:
        yield thread


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed (time.monotonic())."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic()


def _assert_timed_out(data: bytes, waited: float, limit: float, what: str) -> None:
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    error = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
    assert what in error["message"] and error["code"] == "request_timeout", error
    assert limit <= waited < limit + 10, waited  # closed at the deadline, not before


def _complete(url: str) -> dict:
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)


def test_half_sent_headers_are_closed_after_the_header_timeout(short, caplog):
    start = time.monotonic()  # before connecting: the server's header deadline starts when it accepts
    with _connect(short.http_url) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        data, closed = _read_until_closed(sock)
    _assert_timed_out(data, closed - start, HEADER_S, "headers")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(short):
    start = time.monotonic()  # before connecting, as above
    with _connect(short.http_url) as sock:
        data, closed = _read_until_closed(sock)
    _assert_timed_out(data, closed - start, HEADER_S, "headers")


def test_a_promised_body_never_sent_is_closed_after_the_body_timeout_with_nothing_queued(short, caplog):
    before = short.server.metrics.exposition()
    with _connect(short.http_url) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"
            + b'{"model": "tiny", "prompt": "Hi", '
        )
        start = time.monotonic()
        data, closed = _read_until_closed(sock)
    _assert_timed_out(data, closed - start, BODY_S, "body")
    stats = short.server.engine.stats()
    assert stats.num_waiting == stats.num_running == 0
    assert short.server.metrics.exposition() == before  # no request reached the frontend
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert _complete(short.http_url)["choices"][0]["finish_reason"] == "length"  # and the server still serves


def test_a_request_sent_slowly_within_the_deadlines_is_served(short):
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 2}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with _connect(short.http_url) as sock:
        for part in (head[:20], head[20:], body[:10], body[10:]):
            sock.sendall(part)
            time.sleep(HEADER_S / 4)
        data, _ = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200"), data[:200]


def test_a_thousand_half_sent_requests_held_open_do_not_stop_a_normal_one():
    """Held open for the whole test (a 60 s header timeout): the normal request is answered while every one
    of the thousand is still open, so it did not wait for them to be closed."""
    held: list[socket.socket] = []
    with _server(HttpTimeouts(header_s=60.0, body_s=60.0)) as thread:
        try:
            for i in range(NUM_HELD):
                sock = _connect(thread.http_url)
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"GET /v1/mod")
                held.append(sock)
            assert _complete(thread.http_url)["choices"][0]["finish_reason"] == "length"
            for sock in held:
                sock.setblocking(False)
                with pytest.raises(BlockingIOError):  # open, nothing sent back: b"" would mean closed
                    sock.recv(1)
        finally:
            for sock in held:
                sock.close()


def test_up_gives_the_gateway_process_its_timeouts():
    """`shinkai up --http-header-timeout 3 --http-body-timeout 7` reaches the gateway's command line, and the
    gateway process's flags parse back to the same timeouts."""
    import argparse

    from services.entrypoints.stack_config import StackConfig
    from services.gateway.http_timeouts import add_http_timeout_arguments, http_timeouts

    timeouts = HttpTimeouts(header_s=3.0, body_s=7.0)
    gateway = gateway_argv(StackConfig(model="tiny", http_timeouts=timeouts))
    parser = argparse.ArgumentParser()
    add_http_timeout_arguments(parser)
    known, _ = parser.parse_known_args(gateway)
    assert http_timeouts(known) == timeouts
    assert http_timeouts(parser.parse_args([])) == HttpTimeouts()  # the defaults need no flags


def test_a_timeout_that_is_not_positive_is_refused_by_the_flag_parser(capsys):
    import argparse

    from services.gateway.http_timeouts import add_http_timeout_arguments

    parser = argparse.ArgumentParser()
    add_http_timeout_arguments(parser)
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--http-body-timeout", bad])
        assert "--http-body-timeout" in capsys.readouterr().err
    with pytest.raises(ValueError, match="header timeout must be positive"):
        HttpTimeouts(header_s=0)
