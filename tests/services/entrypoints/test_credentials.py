"""Every port behind auth, on a real `shinkai up` stack (tiny, remote worker, an API key): the engine's,
worker's, tokenizer's and multimodal's gRPC refuse a call without the stack's service credential (health stays
open for probes), the services reach each other with it, and each process's environment holds its own
secrets only: the API key the gateway's alone, a NATS password its user's service's and nats-server's alone,
nothing in the supervisor's (services/entrypoints/credentials.py)."""

import os
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import service_auth
from services.client import ShinkaiClient, Unauthenticated
from services.entrypoints.stack import down, up
from services.entrypoints.stack_config import StackConfig
from services.proto.multimodal.v1 import multimodal_pb2, multimodal_pb2_grpc
from services.proto.shinkai.v1 import shinkai_pb2, shinkai_pb2_grpc
from services.proto.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.proto.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.services.gateway.test_images import encoded

pytestmark = pytest.mark.timeout(240)
API_KEY = "k-" + "7" * 40


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("credentials")
    config = StackConfig(http_port=0, grpc_port=0, run_dir=run_dir, remote_workers=True, max_num_seqs=4)
    state = up(config, timeout_s=120, log=lambda *_: None, api_key=API_KEY)
    try:
        yield state
    finally:
        down(run_dir, timeout_s=30, log=lambda *_: None)


def address(state: dict, name: str) -> str:
    (entry,) = [s for s in state["services"] if s["name"] == name]
    return f"127.0.0.1:{entry['health'].split(':')[1]}"


# One real method of each internal service, with a request it answers when the caller is the stack.
CALLS = {
    "engine-0": lambda ch: shinkai_pb2_grpc.ShinkaiStub(ch).GetModelInfo(shinkai_pb2.GetModelInfoRequest(), timeout=30),
    "worker-0": lambda ch: worker_pb2_grpc.WorkerStub(ch).GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=30),
    "tokenizer": lambda ch: tokenizer_pb2_grpc.TokenizerStub(ch).Encode(
        tokenizer_pb2.EncodeRequest(text="Hello"), timeout=30
    ),
    "multimodal": lambda ch: multimodal_pb2_grpc.MultimodalStub(ch).Plan(
        multimodal_pb2.ImageRequest(image=encoded(40, 30)), timeout=30
    ),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_internal_grpc_refuses_a_call_without_the_service_credential(stack, name):
    target = address(stack, name)
    token = stack["service_env"][name][service_auth.TOKEN_ENV]
    with grpc.insecure_channel(target) as plain:
        with pytest.raises(grpc.RpcError) as err:
            CALLS[name](plain)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and token not in err.value.details()
        reply = health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # probes stay open
    with service_auth.channel(target, token=service_auth.new_token()) as wrong:
        with pytest.raises(grpc.RpcError) as err:
            CALLS[name](wrong)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with service_auth.channel(target, token=token) as right:
        assert CALLS[name](right).ByteSize() > 0  # the stack's own credential is served


def test_the_stack_serves_through_its_credentials_and_the_gateway_wants_the_key(stack):
    gateway = address(stack, "gateway")
    with ShinkaiClient(gateway, timeout=60, api_key=API_KEY) as c:  # gateway → tokenizer, engine → worker
        assert c.generate("Hello", max_tokens=2, ignore_eos=True).finish_reason == "length"
    with ShinkaiClient(gateway, timeout=60) as c, pytest.raises(Unauthenticated):
        c.generate("Hello", max_tokens=2)


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def test_each_process_holds_its_own_secrets_only(stack):
    """The API key is in the gateway's environment and no other process's (nats-server's and the supervisor's
    included); each NATS password in nats-server's and its user's service's only; the service credential in
    every Shinkai service's, not nats-server's or the supervisor's."""
    processes = {s["name"]: s["pid"] for s in stack["services"]}
    processes["supervisor"] = stack["supervisor"]["pid"]
    envs = {name: environ(pid) for name, pid in processes.items()}
    token = stack["service_env"]["gateway"][service_auth.TOKEN_ENV]
    passwords = {
        user: password
        for user, password in stack["service_env"]["nats"].items()  # nats-server's: every user's
    }
    assert len(passwords) == 4  # engine-0, gateway, eplb, observer
    for name, env in envs.items():
        values = set(env.values())
        assert (API_KEY in values) == (name == "gateway"), name
        assert not any(API_KEY in v for k, v in env.items() if name != "gateway"), name
        assert (token in values) == (name not in ("nats", "supervisor")), name
        own = stack["service_env"].get(name, {}).get("SHINKAI_NATS_PASSWORD")
        held = {p for p in passwords.values() if p in values}
        if name == "nats":
            assert held == set(passwords.values())
        else:
            assert held == ({own} if own else set()), name
    assert {n for n, env in envs.items() if "SHINKAI_NATS_USER" in env} == {"engine-0", "gateway", "eplb"}
    assert os.environ.get("SHINKAI_API_KEY") != API_KEY  # `up` left this process's environment alone
    state_text = (Path(stack["supervisor"]["log"]).parents[1] / "stack.json").read_text()
    assert API_KEY not in state_text and token not in state_text
    assert not any(p in state_text for p in passwords.values())
