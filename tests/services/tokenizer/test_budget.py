"""The tokenizer service under a client that keeps it busy: health and short encodes
are answered while near-limit prompts encode; over-budget prompts are INVALID_ARGUMENT, early when their bytes
prove it. The byte bound itself is checked against the vocabulary."""

import json
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from model.deepseek_v41.tokenizer import load_v41_tokenizer
from services.bench.isolation import attack_text
from services.entrypoints.stack import ROOT
from services.proto.tokenizer.v1 import tokenizer_pb2 as pb
from services.tokenizer.budget import check_bytes, max_token_bytes

pytestmark = pytest.mark.timeout(120)
ENCODE = "/tokenizer.v1.Tokenizer/Encode"


def test_the_byte_bound_holds_for_every_token():
    tokenizer = load_v41_tokenizer()
    bound = max_token_bytes(tokenizer)
    assert bound == 128  # V4.1's longest token (a run of 128 dots; the 256-character run of "Ġ" is 128 spaces)
    longest = max(
        len(tokenizer.decode([i], skip_special_tokens=False).encode("utf-8", "surrogatepass"))
        for i in range(0, tokenizer.get_vocab_size(), 97)
    )
    assert longest <= bound
    with pytest.raises(ValueError, match="at least 5 tokens"):
        check_bytes(4 * bound + 1, 4, bound)
    check_bytes(4 * bound, 4, bound)  # 4 tokens can hold it: not provably over


@pytest.fixture(scope="module")
def tokenizer_service():
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.entrypoints.tokenizer", "--model", "tiny", "--grpc-addr", "127.0.0.1:0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready = json.loads(proc.stdout.readline())
        yield f"127.0.0.1:{ready['grpc_port']}"
    finally:
        proc.terminate()
        proc.wait(30)


def encode(channel, text: str, max_tokens: int | None = None, timeout: float = 60) -> pb.EncodeResponse:
    call = channel.unary_unary(
        ENCODE,
        request_serializer=pb.EncodeRequest.SerializeToString,
        response_deserializer=pb.EncodeResponse.FromString,
    )
    return call(pb.EncodeRequest(text=text, add_bos=True, max_tokens=max_tokens), timeout=timeout)


def test_over_budget_prompts_are_invalid_argument(tokenizer_service):
    huge = attack_text(3 << 20)
    with grpc.insecure_channel(tokenizer_service) as ch:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            encode(ch, huge, max_tokens=4095)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at least" in info.value.details()
        assert time.monotonic() - start < 1.0  # refused from its bytes, not encoded
        with pytest.raises(grpc.RpcError) as info:
            encode(ch, attack_text(200_000), max_tokens=4095)  # passes the byte bound, too many tokens encoded
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens, over the 4095" in info.value.details()
        assert len(encode(ch, "Hello", max_tokens=4095).token_ids) >= 2


def test_health_and_short_encodes_are_answered_while_two_clients_keep_it_busy(tokenizer_service):
    stop = threading.Event()
    num_attacks = [0]
    text = attack_text(500_000)

    def attack():
        with grpc.insecure_channel(tokenizer_service) as ch:
            while not stop.is_set():
                with pytest.raises(grpc.RpcError):
                    encode(ch, text, max_tokens=4095)
                num_attacks[0] += 1

    attackers = [threading.Thread(target=attack) for _ in range(2)]
    for t in attackers:
        t.start()
    try:
        time.sleep(0.5)
        health_s, encode_s = [], []
        with grpc.insecure_channel(tokenizer_service) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                start = time.monotonic()
                assert (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                    == health_pb2.HealthCheckResponse.SERVING
                )
                health_s.append(time.monotonic() - start)
                start = time.monotonic()
                assert len(encode(ch, "The capital of France is", max_tokens=4095).token_ids) > 1
                encode_s.append(time.monotonic() - start)
    finally:
        stop.set()
        for t in attackers:
            t.join(60)
    assert num_attacks[0] >= 1
    # Encoding a 500 KB prompt takes over a second here; before the pool both of these waited it out.
    assert max(health_s) < 0.5 and max(encode_s) < 0.5, (max(health_s), max(encode_s))
