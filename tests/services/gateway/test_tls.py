"""--ssl-certfile / --ssl-keyfile: HTTPS and TLS gRPC with a self-signed certificate for 127.0.0.1; a
plaintext client is refused on both."""

import json
import shutil
import ssl
import subprocess
import urllib.request

import pytest

from services.client import ShinkaiClient, Unavailable
from services.gateway.auth import tls_files
from services.gateway.server import ServeConfig
from tests.services.gateway.support import ServerThread
from tests.services.gateway.test_bad_input import OK

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    thread = ServerThread(
        ServeConfig(
            model="tiny",
            http_port=0,
            grpc_port=0,
            drain_timeout_s=5,
            engine_args={"max_num_seqs": 4},
            tls=(str(cert), str(key)),
        )
    ).start()
    yield thread, cert.read_bytes()
    thread.stop()


def test_https_with_the_certificate(tls_server):
    thread, cert = tls_server
    assert thread.http_url.startswith("https://")
    context = ssl.create_default_context(cadata=cert.decode())
    req = urllib.request.Request(
        thread.http_url + "/v1/completions", data=json.dumps(OK).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30, context=context) as r:
        assert r.status == 200 and json.load(r)["choices"][0]["finish_reason"] == "length"
    with pytest.raises(OSError):  # plaintext HTTP to the TLS port: the connection is dropped
        urllib.request.urlopen(thread.http_url.replace("https://", "http://") + "/health", timeout=10)


def test_tls_grpc_with_the_certificate(tls_server):
    thread, cert = tls_server
    with ShinkaiClient(thread.grpc_target, timeout=30, tls_root_certificates=cert) as c:
        assert c.generate("Hi", max_tokens=1).finish_reason == "length"
    with ShinkaiClient(thread.grpc_target, timeout=5) as plain:
        with pytest.raises(Unavailable):
            plain.generate("Hi", max_tokens=1)


def test_certificate_and_key_go_together():
    assert tls_files(None, None) is None and tls_files("c", "k") == ("c", "k")
    with pytest.raises(ValueError, match="both or neither"):
        tls_files("c", None)
