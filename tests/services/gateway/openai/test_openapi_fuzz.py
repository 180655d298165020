"""schemathesis against the served /openapi.json: no 5xx, no undocumented status code, no response that breaks
its schema or content type, for a bounded number of generated requests per operation; then hostile bodies the
schema does not describe: numbers past any field's range (integers of thousands of digits, floats past the
double range) in every field, and chats whose images are decompression bombs, truncated or damaged files.

The server has a 64-token context so every generated generation is short; the schema's limits follow it.
``SHINKAI_FUZZ_EXAMPLES=N`` sets the examples per generator (the long run outside CI, docs/operations.md); each
test prints how many requests it sent and how many were 5xx."""

import base64
import itertools
import json
import os
import urllib.error
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from services.gateway.openai.protocol import MAX_N
from tests.services.gateway.support import own_server
from tests.services.multimodal.hostile_images import HOSTILE, damaged_images

EXAMPLES = os.environ.get("SHINKAI_FUZZ_EXAMPLES")
pytestmark = pytest.mark.timeout(300 if EXAMPLES is None else None)
MAX_EXAMPLES = int(EXAMPLES or 20)  # per operation and mode: twelve operations, the six POSTs in both modes
HOSTILE_EXAMPLES = int(EXAMPLES or 60)  # per hostile generator below
# Bodies the schema accepts, and bodies it refuses (each must be a documented 4xx, never a 5xx).
MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_server():
    with own_server(engine_args={"max_num_seqs": 8, "max_model_len": 64}) as thread:
        yield thread


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.http_url + "/openapi.json")


@pytest.mark.rest_of_context  # a Responses body need not set max_output_tokens: the 64-token context bounds it
def test_the_served_api_keeps_its_description(api_schema):
    """Each operation's generated cases, called and checked (schemathesis' pytest plugin predates this pytest,
    so hypothesis drives its strategies directly)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) == 12
    tally = _Tally("schema-generated")
    for operation, mode in itertools.product(operations, MODES):
        if mode == schemathesis.GenerationMode.NEGATIVE and operation.method.lower() != "post":
            continue  # a GET without parameters has nothing to get wrong

        @given(case=operation.as_strategy(generation_mode=mode))
        @_settings(MAX_EXAMPLES)
        def call(case):
            tally.sent += 1  # not_a_server_error fails the test on any 5xx
            case.call_and_validate(checks=CHECKS, timeout=60)

        call()
    tally.report()


def test_the_description_is_served_with_the_models_limits(api_schema, fuzz_server):
    raw = api_schema.raw_schema
    completion = raw["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["max_tokens"]["maximum"] == 64
    assert raw["components"]["schemas"]["ChatCompletionRequest"]["properties"]["n"]["maximum"] == MAX_N
    assert set(raw["paths"]) == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/{model}",
        "/v1/responses",
        "/v1/messages",
        "/tokenize",
        "/detokenize",
        "/version",
        "/health",
        "/ready",
        "/metrics",
    }


def _settings(max_examples: int):
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=EXAMPLES is None,  # CI: the same cases every run; the long run explores
        database=None,
        suppress_health_check=list(HealthCheck),
    )


class _Tally:
    """Requests sent and 5xx seen by one test (printed: the long run's figure)."""

    def __init__(self, name: str) -> None:
        self.name, self.sent, self.server_errors = name, 0, 0

    def post(self, url: str, path: str, raw: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(url + path, data=raw, headers={"Content-Type": "application/json"})
        self.sent += 1
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                status, body = reply.status, json.load(reply)
        except urllib.error.HTTPError as err:
            status, body = err.code, json.load(err)
        self.server_errors += status >= 500
        return status, body

    def report(self) -> None:
        print(f"{self.name}: {self.sent} requests, {self.server_errors} x 5xx")


_NUMERIC_FIELDS = ("max_tokens", "max_completion_tokens", "seed", "temperature", "top_p", "top_k", "n", "logprobs")


@st.composite
def _oversized_number(draw) -> str:
    """A JSON number literal past every field's range: an integer of 20 to 6,000 digits (Python converts 4,300),
    or a float past the double range (to ±inf) or below its smallest subnormal."""
    kind = draw(st.sampled_from(("int", "float")))
    sign = draw(st.sampled_from(("", "-")))
    if kind == "int":
        digits = draw(st.integers(20, 6000))
        return sign + draw(st.sampled_from("123456789")) + "7" * (digits - 1)
    exponent = draw(st.sampled_from(("e309", "e999", "E+99999", "e-999")))
    return f"{sign}{draw(st.integers(1, 9))}.{draw(st.integers(0, 99))}{exponent}"


def _past_the_parser(number: str) -> bool:
    """A literal the body parser itself refuses, wherever it stands: an integer Python does not convert, or a
    float that overflows to ±inf."""
    if "e" not in number.lower():
        return len(number.lstrip("-")) > 4300
    return "-" not in number.lower().split("e", 1)[1]


@st.composite
def _body_with_an_oversized_number(draw) -> tuple[str, bytes, bool]:
    """(path, raw body, whether it must be refused) of a completion or chat whose one field (a sampling field,
    an unknown field, a nested value, a stop token id, a logit_bias value) holds an oversized number. Below the
    parser's limits a number may be fine where it stands (an ignored field, a temperature of 1e-999 = 0)."""
    chat = draw(st.booleans())
    base = '"model": "tiny", ' + ('"messages": [{"role": "user", "content": "Hi"}]' if chat else '"prompt": "Hi"')
    number = draw(_oversized_number())
    where = draw(st.sampled_from((*_NUMERIC_FIELDS, "unknown", "nested", "token id", "logit_bias")))
    if where == "unknown":
        field = f'"x_{draw(st.integers(0, 99))}": {number}'
    elif where == "nested":
        field = f'"stream_options": {{"include_usage": [{number}]}}'
    elif where == "token id":
        field = '"stop_token_ids": [1, ' + number + "]"
    elif where == "logit_bias":
        field = '"logit_bias": {"5": ' + number + "}"
    else:
        field = f'"{where}": {number}'
    if where not in ("max_tokens", "max_completion_tokens"):
        field += ', "max_tokens": 1'  # a served case ends at once (a chat's default is the rest of the context)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return path, ("{" + base + ", " + field + "}").encode(), _past_the_parser(number)


def test_oversized_numbers_in_any_field_are_4xx_or_harmless(fuzz_server):
    tally = _Tally("oversized numbers")

    @given(case=_body_with_an_oversized_number())
    @_settings(HOSTILE_EXAMPLES)
    def call(case):
        path, raw, refused = case
        status, body = tally.post(fuzz_server.http_url, path, raw)
        assert status < 500, (status, body, raw[:200])
        assert status == 400 if refused else status in (200, 400), (status, body, raw[:200])
        assert status == 200 or body["error"]["message"], body

    call()
    tally.report()
    assert tally.server_errors == 0


def _chat_with(data: bytes) -> bytes:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    parts = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url}}]
    return json.dumps({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": parts}]}).encode()


def test_hostile_images_are_4xx_or_served(fuzz_server):
    """Every hostile image of the table is a 400 naming its problem; randomly damaged images are a 400 (the image
    refused, or its span over the 64-token context) or, where the damage leaves a decodable image, served."""
    tally = _Tally("hostile images")
    for name, (data, phrase, _) in HOSTILE.items():
        status, body = tally.post(fuzz_server.http_url, "/v1/chat/completions", _chat_with(data))
        assert status == 400 and phrase in body["error"]["message"], (name, status, body)

    @given(data=damaged_images())
    @_settings(HOSTILE_EXAMPLES)
    def call(data):
        status, body = tally.post(fuzz_server.http_url, "/v1/chat/completions", _chat_with(data))
        assert status in (200, 400), (status, body)  # a damaged size may also make the image's span too long
        assert status == 200 or body["error"]["message"], body

    call()
    tally.report()
    assert tally.server_errors == 0
