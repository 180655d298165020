"""The supervisor `shinkai up` leaves behind (services/entrypoints/supervisor.py), on a real CPU stack of the
tiny model after `up` has returned: the engine killed mid-load ends the streams in flight with "error", is
restarted with backoff and serves again within 30 s through the gateway (which stopped routing to it while
it was gone); killed five times in a row it hits the restart limit and the stack says so in stack.json,
`shinkai status`, the supervisor's log and its metrics. `down` stops the supervisor first, then the rest."""

import asyncio
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from services.client import AsyncShinkaiClient, ShinkaiClient
from services.entrypoints.cli import main as cli
from services.entrypoints.probe import alive_as
from services.entrypoints.stack import down, up
from services.entrypoints.stack_config import StackConfig
from services.entrypoints.supervisor import Policy, restartable
from tests.nats_server import wait_for

pytestmark = pytest.mark.timeout(300)
BACK_WITHIN_S = 30.0
NUM_STREAMS = 4


def test_backoff_doubles_up_to_its_ceiling_and_a_groups_ranks_are_not_restarted():
    policy = Policy(restart_limit=4, backoff_s=1.0, max_backoff_s=5.0)
    assert [policy.backoff(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert restartable({"name": "engine-0", "group": None}) and restartable({"name": "gateway", "group": None})
    assert not restartable({"name": "engine-0", "group": "ranks"})  # a rank cannot rejoin its group alone
    assert not restartable({"name": "worker-1", "group": "worker-ranks"})


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("supervised")
    config = StackConfig(http_port=0, grpc_port=0, run_dir=run_dir, max_num_seqs=8, restart_backoff_s=0.5)
    state = up(config, timeout_s=120, log=lambda *_: None)
    try:
        yield run_dir, state
    finally:
        down(run_dir, timeout_s=30, log=lambda *_: None)
        assert not alive_as(state["supervisor"]["pid"], state["supervisor"]["argv"])


def recorded(run_dir: Path, name: str) -> dict:
    state = json.loads((run_dir / "stack.json").read_text())
    return next(s for s in state["services"] if s["name"] == name)


def events(run_dir: Path) -> list[dict]:
    lines = (run_dir / "logs" / "supervisor.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def samples(state: dict) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(state["supervisor"]["url"].removeprefix("metrics "), timeout=10) as r:
        families = text_string_to_metric_families(r.read().decode())
        return {(s.name, s.labels.get("service", "")): s.value for f in families for s in f.samples}


def gateway_address(state: dict) -> str:
    (gateway,) = [s for s in state["services"] if s["name"] == "gateway"]
    return f"127.0.0.1:{gateway['health'].split(':')[1]}"


async def stream_final(client: AsyncShinkaiClient, prompt: str, started: asyncio.Event) -> str:
    """One long stream's final finish reason, or "status:<error>" when it ended with an error status."""
    try:
        async for delta in client.generate_stream(prompt, max_tokens=4000, ignore_eos=True):
            started.set()
            if delta.finish_reason is not None:
                return delta.finish_reason
        return "no final"
    except Exception as err:
        return f"status:{type(err).__name__}"
    finally:
        started.set()


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def served(gateway: str) -> bool:
    try:
        with ShinkaiClient(gateway, timeout=10) as c:
            return c.generate("are you back", max_tokens=2, ignore_eos=True).finish_reason == "length"
    except Exception:
        return False


def kill_engine(run_dir: Path) -> int:
    pid = recorded(run_dir, "engine-0")["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_killed_engine_ends_its_streams_with_error_and_is_back_within_30_s(stack):
    run_dir, state = stack
    gateway = gateway_address(state)

    async def kill_mid_load() -> list[str]:
        async with AsyncShinkaiClient(gateway, timeout=120) as client:
            started = [asyncio.Event() for _ in range(NUM_STREAMS)]
            tasks = [asyncio.create_task(stream_final(client, f"load {i}", started[i])) for i in range(NUM_STREAMS)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            kill_engine(run_dir)
            return await asyncio.wait_for(asyncio.gather(*tasks), 20)

    killed_pid = recorded(run_dir, "engine-0")["pid"]
    finals = asyncio.run(kill_mid_load())
    killed = time.monotonic()
    assert finals == ["error"] * NUM_STREAMS, finals
    # The gateway stops routing to the engine while it is gone (its health poll), and says so.
    wait_for(lambda: not serving(gateway), 10, "the gateway to report NOT_SERVING")
    wait_for(lambda: served(gateway), BACK_WITHIN_S, "a request served through the restarted engine")
    back_s = time.monotonic() - killed
    # The supervisor records the engine healthy on its next round over the services, which can come after the
    # gateway's own health poll has routed a request to it.
    wait_for(lambda: recorded(run_dir, "engine-0")["state"] == "running", BACK_WITHIN_S, "the supervisor to record it")
    entry = recorded(run_dir, "engine-0")
    assert entry["pid"] != killed_pid and entry["restarts"] == 1 and entry["state"] == "running", entry
    assert all(served(gateway) for _ in range(3))
    kinds = [(e["event"], e["service"]) for e in events(run_dir)]
    assert [k for k in kinds if k[1] == "engine-0"] == [
        ("crashed", "engine-0"),
        ("restarted", "engine-0"),
        ("healthy", "engine-0"),
    ]
    got = samples(state)
    assert got[("shinkai_supervisor_restarts_total", "engine-0")] == 1
    assert got[("shinkai_supervisor_service_up", "engine-0")] == 1
    assert got[("shinkai_supervisor_gave_up", "engine-0")] == 0
    print(f"SUPERVISOR {json.dumps({'streams': finals, 'back_after_kill_s': round(back_s, 2)})}")


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def test_a_killed_gateway_and_nats_server_come_back_with_their_own_secrets(stack):
    run_dir, state = stack
    gateway = gateway_address(state)
    for name in ("nats", "gateway"):
        os.kill(recorded(run_dir, name)["pid"], signal.SIGKILL)
    for name in ("nats", "gateway"):
        wait_for(lambda name=name: recorded(run_dir, name)["state"] == "running", 60, f"{name} to be running again")
    wait_for(lambda: served(gateway), BACK_WITHIN_S, "a request served through the restarted gateway")
    gateway_env = environ(recorded(run_dir, "gateway")["pid"])
    assert gateway_env["SHINKAI_NATS_USER"] == "gateway"
    assert gateway_env["SHINKAI_NATS_PASSWORD"] == state["service_env"]["gateway"]["SHINKAI_NATS_PASSWORD"]
    nats_env = environ(recorded(run_dir, "nats")["pid"])
    assert {k: nats_env.get(k) for k in state["service_env"]["nats"]} == state["service_env"]["nats"]
    assert not any(
        k.startswith("SHINKAI_NATS") or k == "SHINKAI_SERVICE_TOKEN" for k in environ(state["supervisor"]["pid"])
    )


def test_five_kills_in_a_row_hit_the_restart_limit_and_the_stack_reports_it(stack, capsys):
    run_dir, state = stack
    gateway = gateway_address(state)
    limit = Policy.restart_limit  # the stack's (StackConfig.restart_limit's default)
    # Each engine process the supervisor starts is killed as soon as it is recorded, a crash loop (the previous
    # test's kill, if it ran just before, is the first crash in this row).
    last_killed, deadline = None, time.monotonic() + 90
    while (entry := recorded(run_dir, "engine-0"))["state"] != "failed":
        if entry["state"] in ("starting", "running") and entry["pid"] != last_killed:
            os.kill(entry["pid"], signal.SIGKILL)
            last_killed = entry["pid"]
        assert time.monotonic() < deadline, entry
        time.sleep(0.05)
    assert entry["restarts"] == limit and entry["crashes_in_row"] == limit + 1, entry
    time.sleep(1.0)  # no restart comes after giving up
    assert recorded(run_dir, "engine-0")["pid"] == entry["pid"] and not alive_as(entry["pid"], entry["argv"])
    gave_up = [e for e in events(run_dir) if e["event"] == "gave_up"]
    assert len(gave_up) == 1 and gave_up[0]["service"] == "engine-0" and gave_up[0]["why"] == "restart limit reached"
    got = samples(state)
    assert got[("shinkai_supervisor_gave_up", "engine-0")] == 1
    assert got[("shinkai_supervisor_crashes_total", "engine-0")] == limit + 1
    assert got[("shinkai_supervisor_restarts_total", "engine-0")] == limit
    assert got[("shinkai_supervisor_gave_up", "tokenizer")] == 0
    capsys.readouterr()
    assert cli(["status", "--run-dir", str(run_dir)]) == 1
    status = capsys.readouterr().out
    assert any(line.split()[0] == "engine-0" and "failed" in line for line in status.splitlines()), status
    assert not served(gateway)  # the gateway has no engine to route to, and says so rather than hanging
