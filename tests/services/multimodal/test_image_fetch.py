"""``fetch_image``: data URLs, http(s) fetched under the byte limit and a deadline, other schemes refused,
and the SSRF rule: an address is checked after DNS resolution, on every redirect hop, and the flag lifts it."""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest

from services.multimodal import image_fetch
from services.multimodal.image_fetch import RefusedAddress, fetch_image, public_address
from services.multimodal.preprocess import ImageInputError

pytestmark = pytest.mark.timeout(60)

BODY = b"\x89PNG not really, but bytes are bytes here" * 10


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/image":
            self._send(BODY)
        elif self.path.startswith("/redirect-to-"):
            self.send_response(302)
            self.send_header("Location", self.path.removeprefix("/redirect-to-"))
            self.end_headers()
        elif self.path == "/drip":  # a byte every 0.2 s: never done within a short deadline
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                pass
        else:
            self.send_error(404)

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_loopback_url_is_refused_unless_private_urls_are_allowed(server):
    with pytest.raises(ImageInputError, match="refused: '127.0.0.1' resolves to 127.0.0.1.*--allow-private-image-urls"):
        fetch_image(server + "/image", 1 << 20)
    assert fetch_image(server + "/image", 1 << 20, allow_private=True) == BODY


def test_localhost_by_name_is_refused_after_resolution(server):
    port = server.rsplit(":", 1)[1]
    with pytest.raises(ImageInputError, match="'localhost' resolves to"):
        fetch_image(f"http://localhost:{port}/image", 1 << 20)


def test_every_redirect_hop_is_checked(server, monkeypatch):
    """A "public" host (resolution faked to reach the test server) redirecting to a loopback one is refused at
    the redirect; the first hop alone goes through."""
    port = int(server.rsplit(":", 1)[1])
    real = image_fetch.public_address
    monkeypatch.setattr(
        image_fetch, "public_address", lambda host, p: "127.0.0.1" if host == "public.test" else real(host, p)
    )
    assert fetch_image(f"http://public.test:{port}/image", 1 << 20) == BODY
    with pytest.raises(ImageInputError, match="refused: '127.0.0.1' resolves"):
        fetch_image(f"http://public.test:{port}/redirect-to-http://127.0.0.1:{port}/image", 1 << 20)


@pytest.mark.parametrize(
    "address",
    [
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "127.0.0.2",
        "169.254.169.254",
        "224.0.0.1",
        "0.0.0.0",
        "100.64.0.1",
        "::1",
        "fe80::1",
        "fc00::1",
        "ff02::1",
        "::ffff:127.0.0.1",
    ],
)
def test_private_loopback_link_local_and_multicast_addresses_are_refused(address, monkeypatch):
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(family, socket.SOCK_STREAM, 6, "", (address, 80))])
    with pytest.raises(RefusedAddress, match=address):
        public_address("example.test", 80)


def test_a_host_with_one_private_address_among_public_ones_is_refused(monkeypatch):
    infos = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 80)) for a in ("93.184.216.34", "10.0.0.1")]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: infos)
    with pytest.raises(RefusedAddress, match="10.0.0.1"):
        public_address("example.test", 80)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: infos[:1])
    assert public_address("example.test", 80) == "93.184.216.34"


def test_byte_limit_deadline_and_unreachable(server):
    with pytest.raises(ImageInputError, match=f"over the limit of {len(BODY) - 1} bytes"):
        fetch_image(server + "/image", len(BODY) - 1, allow_private=True)
    # The drip would take 200 s; the deadline ends it (a regression runs into the module's pytest timeout).
    with pytest.raises(ImageInputError, match="took over 0.5 s"):
        fetch_image(server + "/drip", 1 << 20, timeout_s=0.5, allow_private=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # bound, never listening: connection refused
        with pytest.raises(ImageInputError, match="could not be fetched"):
            fetch_image(f"http://127.0.0.1:{closed}/image", 1 << 20, allow_private=True)
    with pytest.raises(ImageInputError, match="could not be fetched: Not Found"):
        fetch_image(server + "/missing", 1 << 20, allow_private=True)


@pytest.mark.parametrize(
    "url, message",
    [
        ("file:///etc/passwd", "scheme 'file' is not supported"),
        ("ftp://example.com/a.png", "scheme 'ftp' is not supported"),
        ("just-a-path.png", r"scheme '\(none\)' is not supported"),
        ("data:image/png;base64,!!!!", "not valid base64"),
        ("data:image/png;base64", "no ','"),
    ],
)
def test_other_schemes_and_bad_data_urls_are_refused(url, message):
    with pytest.raises(ImageInputError, match=message):
        fetch_image(url, 1 << 20)


def test_a_data_url_over_the_byte_limit_is_refused_before_decoding():
    with pytest.raises(ImageInputError, match="over the limit of 10 bytes"):
        fetch_image("data:image/png;base64," + "A" * 400, 10)
