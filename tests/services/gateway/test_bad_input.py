"""The bad-input table (docs/serving.md), row by row, over HTTP and gRPC: a 4xx / specific status code, never a 500,
UNKNOWN or INTERNAL, with an OpenAI error body (HTTP) or a message that says what is wrong (gRPC)."""

import base64
import json
import math

import grpc
import pytest

from services.client import InvalidArgument, ModelNotFound, QueueFull, ShinkaiClient
from services.client.messages import generate_request
from services.proto.shinkai.v1 import shinkai_pb2 as pb
from tests.services.gateway.support import post
from tests.services.multimodal.hostile_images import HOSTILE, bilevel_png

pytestmark = pytest.mark.timeout(60)

OK = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
DIGITS_5001 = b"1" + b"0" * 5000  # past Python's int-string conversion limit (4,300 digits)
BOMB = bilevel_png(20000, 20000)  # a 20000 x 20000 1-bit PNG: 57 KB that Pillow refuses to open


def chat_with_image(data: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    parts = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": parts}]}


# (row, HTTP body as bytes, expected status, a word the message must contain)
HTTP_ROWS = [
    ("empty prompt", {**OK, "prompt": ""}, 400, "empty"),
    ("empty token list", {**OK, "prompt": []}, 400, "empty"),
    ("token id out of vocabulary", {**OK, "prompt": [0, 999999]}, 400, "vocabulary"),
    ("negative token id", {**OK, "prompt": [0, -1]}, 400, "vocabulary"),
    ("prompt + max_tokens over context", {**OK, "max_tokens": 4096}, 400, "context"),
    ("max_tokens 0", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {**OK, "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens absurd", {**OK, "max_tokens": 10**15}, 400, "max_tokens"),
    ("max_tokens not an integer", {**OK, "max_tokens": "many"}, 400, "max_tokens"),
    ("temperature negative", {**OK, "temperature": -0.5}, 400, "temperature"),
    ("temperature NaN", b'{"model": "tiny", "prompt": "Hi", "temperature": NaN}', 400, "temperature"),
    ("temperature Infinity", b'{"model": "tiny", "prompt": "Hi", "temperature": Infinity}', 400, "temperature"),
    ("temperature -Infinity", b'{"model": "tiny", "prompt": "Hi", "temperature": -Infinity}', 400, "temperature"),
    ("top_p 0", {**OK, "top_p": 0}, 400, "top_p"),
    ("top_p above 1", {**OK, "top_p": 1.5}, 400, "top_p"),
    ("n below 1", {**OK, "n": 0}, 400, "n "),
    ("invalid UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("malformed JSON", b'{"model": "tiny", "prompt": ', 400, "JSON"),
    ("not an object", b"[1, 2]", 400, "object"),
    ("unknown model", {**OK, "model": "gpt-9"}, 404, "gpt-9"),
    ("missing model", {"prompt": "Hi"}, 400, "model"),
    ("chat without messages", {"model": "tiny", "messages": []}, 400, "messages"),
    (
        "chat with an image that is not one",
        {
            "model": "tiny",
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
            ],
        },
        400,
        "supported format",
    ),
    (
        "chat with a bad role",
        {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role must be one of system, developer, user, assistant, tool; got 'robot'",
    ),
    (
        "chat with a message that is not an object",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}, "hi"]},
        400,
        "messages[1] must be an object",
    ),
    (
        "max_tokens of 5001 digits",
        b'{"model": "tiny", "prompt": "Hi", "max_tokens": ' + DIGITS_5001 + b"}",
        400,
        "max_tokens",
    ),
    (
        "seed of 4301 digits",
        b'{"model": "tiny", "prompt": "Hi", "seed": 1' + b"0" * 4300 + b"}",
        400,
        "seed is an integer",
    ),
    (
        "5001 digits deep in a body",
        b'{"model": "tiny", "prompt": "Hi", "x": {"y": [' + DIGITS_5001 + b"]}}",
        400,
        "x.y[0]",
    ),
    ("1e999 in an ignored field", b'{"model": "tiny", "prompt": "Hi", "x": 1e999}', 400, "x must be a finite number"),
    ("chat with a decompression bomb", chat_with_image(BOMB), 400, "400000000 pixels"),
    ("chat with a bomb of 10 rows", chat_with_image(bilevel_png(20000, 20000, 10)), 400, "400000000 pixels"),
    ("chat with a truncated JPEG", chat_with_image(HOSTILE["JPEG cut after 200 bytes"][0]), 400, "truncated"),
    ("chat with a truncated PNG", chat_with_image(HOSTILE["PNG cut after 100 bytes"][0]), 400, "truncated"),
]


@pytest.mark.parametrize("row,body,status,word", HTTP_ROWS, ids=[r[0] for r in HTTP_ROWS])
def test_http_bad_input(served, row, body, status, word):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    code, reply, _ = post(served.http_url, path, body)
    assert code == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert word in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_http_body_over_the_size_limit_is_413(served):
    import http.client
    from urllib.parse import urlparse

    url = urlparse(served.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(5 << 20))  # announced; the server answers before reading it
    conn.endheaders(b'{"model": "tiny", "prompt": "')
    resp = conn.getresponse()
    reply = json.loads(resp.read())
    conn.close()
    assert resp.status == 413 and "limit" in reply["error"]["message"], reply


def test_http_good_request_passes(served):
    code, reply, _ = post(served.http_url, "/v1/completions", OK)  # the rows above differ from this in one field
    assert code == 200 and reply["choices"][0]["finish_reason"] == "length"


GRPC_ROWS = [
    ("empty prompt", dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ("empty token list", dict(prompt=[]), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ("token id out of vocabulary", dict(prompt=[0, 999999]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ("negative token id", dict(prompt=[0, -1]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ("prompt + max_tokens over context", dict(max_tokens=4096), grpc.StatusCode.INVALID_ARGUMENT, "context"),
    ("max_tokens 0", dict(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("max_tokens negative", dict(max_tokens=-5), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("max_tokens absurd", dict(max_tokens=10**15), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be between"),
    ("temperature negative", dict(temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("temperature NaN", dict(temperature=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("temperature Infinity", dict(temperature=math.inf), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("top_p 0", dict(top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("top_p above 1", dict(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("seed too large", dict(seed=2**63), grpc.StatusCode.INVALID_ARGUMENT, "seed"),
    ("unknown model", dict(model="gpt-9"), grpc.StatusCode.NOT_FOUND, "gpt-9"),
    ("chat without messages", dict(prompt=None, messages=[]), grpc.StatusCode.INVALID_ARGUMENT, "messages"),
    (
        "chat with a bad role",
        dict(prompt=None, messages=[{"role": "latest_reminder", "content": "x"}]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages[0].role must be one of system, developer, user, assistant, tool; got 'latest_reminder'",
    ),
    (
        "chat with a decompression bomb",
        dict(prompt=None, messages=chat_with_image(BOMB)["messages"]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "400000000 pixels",
    ),
]


@pytest.mark.parametrize("row,changes,code,word", GRPC_ROWS, ids=[r[0] for r in GRPC_ROWS])
def test_grpc_bad_input(served, row, changes, code, word):
    kwargs = {"prompt": "Hi", "max_tokens": 1, **changes}
    with grpc.insecure_channel(served.grpc_target) as ch:
        call = ch.unary_stream("/shinkai.v1.Shinkai/Generate", request_serializer=pb.GenerateRequest.SerializeToString)
        with pytest.raises(grpc.RpcError) as info:
            list(call(generate_request(**kwargs), timeout=30))
    assert info.value.code() == code, info.value.details()
    assert word in info.value.details()


def test_grpc_sends_no_internal_exception_text(served, monkeypatch):
    """A bug past the checks (here: the frontend raising) is INTERNAL "internal error" over gRPC, never UNKNOWN
    carrying the exception's text."""

    async def broken(args):
        raise RuntimeError("/srv/shinkai/secret.py: token=abc")

    monkeypatch.setattr(served.server.frontend, "start_choices", broken)
    with grpc.insecure_channel(served.grpc_target) as ch:
        call = ch.unary_stream("/shinkai.v1.Shinkai/Generate", request_serializer=pb.GenerateRequest.SerializeToString)
        with pytest.raises(grpc.RpcError) as info:
            list(call(generate_request("Hi", max_tokens=1), timeout=30))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal error"


@pytest.mark.parametrize("n", [0, 129])
def test_grpc_n_outside_its_bounds(served, n):
    request = generate_request("Hi", max_tokens=1)
    request.sampling.n = n
    with grpc.insecure_channel(served.grpc_target) as ch:
        call = ch.unary_stream("/shinkai.v1.Shinkai/Generate", request_serializer=pb.GenerateRequest.SerializeToString)
        with pytest.raises(grpc.RpcError) as info:
            list(call(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.n must be between 1 and 128, got {n}" in info.value.details()


@pytest.mark.parametrize(
    "method,raw",
    [
        ("Generate", b"\x0a\x64"),  # field 1, length 100, no bytes: truncated
        ("Generate", b"\x1a\x02\xff\xfe"),  # field 3 (text) with invalid UTF-8
        ("Generate", b"\xff" * 11),  # a tag varint that never ends
        ("Abort", b"\x0a\x02\xff\xfe"),  # field 1 (request_id) with invalid UTF-8
        ("Abort", b"\x0a\x64"),
    ],
)
def test_grpc_malformed_protobuf_is_invalid_argument(served, method, raw):
    with grpc.insecure_channel(served.grpc_target) as ch:
        if method == "Generate":
            with pytest.raises(grpc.RpcError) as info:
                list(ch.unary_stream("/shinkai.v1.Shinkai/Generate")(raw, timeout=30))
        else:
            with pytest.raises(grpc.RpcError) as info:
                ch.unary_unary("/shinkai.v1.Shinkai/Abort")(raw, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "malformed" in info.value.details()


def test_typed_client_errors(served):
    with ShinkaiClient(served.grpc_target, timeout=30) as c:
        with pytest.raises(InvalidArgument, match="empty"):
            c.generate("", max_tokens=1)
        with pytest.raises(ModelNotFound):
            c.generate("Hi", model="gpt-9", max_tokens=1)


def test_queue_full_is_429_with_retry_after_and_resource_exhausted(served):
    engine = served.server.engine
    limit, engine.max_queued = engine.max_queued, 0
    try:
        code, reply, headers = post(served.http_url, "/v1/completions", OK)
        assert code == 429 and reply["error"]["type"] == "rate_limit_error"
        assert int(headers["retry-after"]) >= 1
        with ShinkaiClient(served.grpc_target, timeout=30) as c:
            with pytest.raises(QueueFull) as info:
                c.generate("Hi", max_tokens=1)
        assert info.value.retry_after_s >= 1
    finally:
        engine.max_queued = limit
    assert limit > 256  # the default queue limit is above 256 (the fixture's is 300)
