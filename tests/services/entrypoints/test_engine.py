"""An engine process's shinkai.v1 endpoint behind a gateway: it keys a request by the gateway's request_id,
unchanged, and aborts by client_request_id; `stop()` leaves the pools whole."""

import asyncio

import grpc
import pytest

from services.engine import LLM
from services.entrypoints.engine import EngineEndpoint
from services.proto.shinkai.v1 import shinkai_pb2 as pb
from services.proto.shinkai.v1 import shinkai_pb2_grpc

pytestmark = pytest.mark.timeout(120)


def request(request_id: str, client_request_id: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        client_request_id=client_request_id,
        token_ids=pb.TokenIds(ids=[0, 5, 6]),
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def test_the_gateway_request_id_is_the_engine_key_and_abort_takes_the_client_request_id():
    llm = LLM("tiny")
    endpoint = EngineEndpoint(
        llm, replica="engine-7", host="127.0.0.1", grpc_port=0, drain_timeout_s=5, served_model_name="tiny"
    )

    async def run():
        await endpoint.start()
        try:
            async with grpc.aio.insecure_channel(endpoint.api.urls()["grpc"]) as channel:
                stub = shinkai_pb2_grpc.ShinkaiStub(channel)
                live = stub.Generate(request("gw-1", "client-1", 1000))
                first = await live.read()
                assert (first.request_id, first.client_request_id) == ("gw-1", "client-1")
                # The engine knows the request by "gw-1": a second live request with it is refused.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Generate(request("gw-1", "client-2", 1)).read()
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "request id 'gw-1' is already in use" in refused.value.details()
                assert (await stub.Abort(pb.AbortRequest(client_request_id="gw-1"))).found is False
                assert (await stub.Abort(pb.AbortRequest(client_request_id="client-1"))).found is True
                rest = []
                while (response := await live.read()) is not grpc.aio.EOF:
                    rest.append(response)
                assert rest[-1].final.finish_reason == pb.FINISH_REASON_ABORT
                assert {r.request_id for r in rest} == {"gw-1"}
                loads = await stub.GetLoads(pb.GetLoadsRequest())
                assert [e.replica for e in loads.engines] == ["engine-7"]
        finally:
            await endpoint.stop()

    asyncio.run(run())
    stats = endpoint.engine.stats()
    assert stats.free_blocks == stats.total_blocks and stats.free_state_slots == stats.total_state_slots
    assert stats.num_running == stats.num_waiting == 0


def test_the_gateway_tenant_reaches_the_engine_service():
    """The gateway's `RemoteEngine` forwards the tenant; the engine process passes it on unchanged (and admits
    nothing itself: the gateway did)."""
    from services.engine import SamplingParams
    from services.gateway.remote import RemoteEngine

    llm = LLM("tiny")
    endpoint = EngineEndpoint(
        llm, replica="engine-0", host="127.0.0.1", grpc_port=0, drain_timeout_s=5, served_model_name="tiny"
    )
    tenants = []
    submit = endpoint.engine.submit

    def recording(*args, **kwargs):
        tenants.append(kwargs.get("tenant"))
        return submit(*args, **kwargs)

    endpoint.engine.submit = recording

    async def run():
        await endpoint.start()
        remote = RemoteEngine("engine-0", endpoint.api.urls()["grpc"])
        try:
            stream = await remote.submit("gw-1", "c-1", [0, 5, 6], SamplingParams(max_tokens=1), tenant="k1")
            while (await stream.__anext__()).finish_reason is None:
                pass
        finally:
            await remote.close()
            await endpoint.stop()

    asyncio.run(run())
    assert tenants == ["k1"]


def test_a_launchers_rank_takes_its_place_from_the_environment():
    import argparse

    from services.entrypoints.engine import DEFAULT_REPLICA, apply_launcher_place

    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500"}
    args = argparse.Namespace(
        dp_rendezvous="env://",
        replica=DEFAULT_REPLICA,
        grpc_port=50100,
        metrics_port=9100,
        worker=None,
        device="cuda",
        data_parallel_size=1,
        dp_rank=0,
        rank=0,
    )
    assert apply_launcher_place(args, env)
    assert (args.data_parallel_size, args.dp_rank, args.rank, args.replica) == (4, 3, 3, "engine-3")
    assert (args.grpc_port, args.metrics_port, args.device) == (50101, 9101, "cuda:1")
    plain = argparse.Namespace(dp_rendezvous="tcp://127.0.0.1:1", grpc_port=7)
    assert not apply_launcher_place(plain, env) and plain.grpc_port == 7
    with pytest.raises(ValueError, match=r"drop --dp 8 \(the launcher's WORLD_SIZE=4\)"):
        apply_launcher_place(argparse.Namespace(**{**vars(args), "data_parallel_size": 8, "dp_rank": 0}), env)
    with pytest.raises(ValueError, match="LOCAL_RANK unset"):
        apply_launcher_place(argparse.Namespace(**{**vars(args), "dp_rendezvous": "env://"}), {**env, "LOCAL_RANK": ""})
