"""Faults and soak against `shinkai up` with a remote worker (nats, tokenizer, eplb, multimodal, worker-0,
engine-0, gateway as separate processes), each under load and bounded in time, in this order on one stack
(after one image chat served through the remote worker):

1. soak: SOAK_CONCURRENCY streams kept in flight for SOAK_S seconds: zero failures, one terminal message
   per request sent;
2. SIGKILL the worker mid-stream: every client gets a final message promptly, engine and gateway health
   report it, a restarted worker serves again; SIGSTOP it (hung, sockets open): the heartbeat, not the
   step's deadline, ends the held step, and SIGCONT brings it back;
3. restart nats-server under load: engine and gateway reconnect (seen on the server's own /connz), their
   load reports flow again, requests keep being routed;
4. SIGTERM the gateway during 50 streams (HTTP and gRPC): each stream gets a final message ("length" for
   those that finish within the grace period, "abort" for the rest) and the gateway exits 0.

After each, the engine's pools are whole (free == total, nothing running). Measured figures are printed as
one JSON line per test (``FAULTS {...}``); docs/operations.md quotes them.
"""

import asyncio
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client import AsyncShinkaiClient, ShinkaiClient, Unavailable
from services.entrypoints.stack import ROOT, StackConfig, down, free_port, up
from tests.nats_server import wait_for
from tests.service_logs import ready_event

pytestmark = pytest.mark.timeout(240)

SOAK_S = float(os.environ.get("SHINKAI_SOAK_S", "15"))  # docs/operations.md also reports a longer run
SOAK_CONCURRENCY = int(os.environ.get("SHINKAI_SOAK_CONCURRENCY", "200"))
DRAIN_S = 4.0  # the engine's and gateway's grace period in this stack


def report(name: str, **figures) -> None:
    print(f"FAULTS {json.dumps({'test': name, **figures})}")


class Stack:
    def __init__(self, run_dir, state):
        self.run_dir = run_dir
        self.state = state
        self.by_name = {s["name"]: s for s in state["services"]}
        ready = ready_event(self.by_name["gateway"]["log"], timeout_s=10)
        self.http, self.grpc = ready["http"], ready["grpc"]
        self.engine = f"127.0.0.1:{self.by_name['engine-0']['health'].split(':')[1]}"
        self.credential = state["service_env"]["engine-0"]["SHINKAI_SERVICE_TOKEN"]  # to call the engine itself
        with ShinkaiClient(self.grpc, timeout=30) as c:
            self.long = c.model_info().max_model_len - 16  # max_tokens of a stream that outlasts any test

    def restart(self, name: str, extra: list[str] = ()) -> subprocess.Popen:
        """Starts ``name`` again with its recorded command (plus ``extra``), and records the new PID so
        `down` stops it."""
        s = self.by_name[name]
        env = dict(os.environ, PYTHONPATH=str(ROOT), **self.state["service_env"][name])  # its own secrets
        with open(s["log"], "ab") as log:
            proc = subprocess.Popen(
                [*s["argv"], *extra],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        s["pid"], s["argv"] = proc.pid, [*s["argv"], *extra]
        path = self.run_dir / "stack.json"
        state = json.loads(path.read_text())
        for entry in state["services"]:
            if entry["name"] == name:
                entry["pid"], entry["argv"] = proc.pid, s["argv"]
        path.write_text(json.dumps(state, indent=1))
        return proc


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    for attempt in range(2):  # a free port can be taken by another job between `up` choosing and binding it
        run_dir = tmp_path_factory.mktemp("faults")
        config = StackConfig(
            num_engines=1,
            remote_workers=True,
            http_port=0,
            grpc_port=0,
            run_dir=run_dir,
            max_num_seqs=16,
            drain_timeout_s=DRAIN_S,
            supervise=False,  # these tests restart what they kill themselves
        )
        try:
            state = up(config, timeout_s=120, log=lambda *_: None)
            break
        except RuntimeError:
            if attempt == 1:
                raise
    try:
        yield Stack(run_dir, state)
    finally:
        down(run_dir, timeout_s=30, log=lambda *_: None)


def grpc_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_status(url: str, timeout: float = 15) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def routed(stack: Stack) -> float:
    """Requests the gateway has routed to an engine, ever (its Prometheus counter)."""
    with urllib.request.urlopen(stack.http + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(r"^shinkai_gateway_routed_total\{[^}]*\} (\S+)", text, re.M))


def log_sizes(stack: Stack) -> dict[str, int]:
    """Each service's log size now: `problems_since` reads only what was written after."""
    return {s["name"]: os.path.getsize(s["log"]) for s in stack.state["services"] if os.path.exists(s["log"])}


def problems_since(stack: Stack, sizes: dict[str, int], limit: int = 40) -> str:
    """The warnings, errors and tracebacks the services logged after ``sizes``: shown when a test fails."""
    lines = []
    for s in stack.state["services"]:
        if s["name"] not in sizes:
            continue
        with open(s["log"], errors="replace") as f:
            f.seek(sizes[s["name"]])
            found = (line.rstrip() for line in f if re.search(r"WARNING|ERROR|Error|Traceback", line))
            lines += [f"{s['name']}: {line}" for line in found]
    return "\n".join(lines[-limit:])


def assert_pools_whole(stack: Stack, timeout: float = 20) -> dict:
    """The engine has nothing running or waiting and every block and state slot is free."""

    def whole():
        with ShinkaiClient(stack.engine, timeout=5, api_key=stack.credential) as c:
            (e,) = c.loads().engines
        return (
            e
            if (
                e.num_running == e.num_waiting == e.num_queued == 0
                and e.num_free_blocks == e.num_total_blocks
                and e.num_free_state_slots == e.num_total_state_slots
            )
            else None
        )

    e = wait_for(whole, timeout, "the engine's pools to be whole")
    return {
        "free_blocks": e.num_free_blocks,
        "total_blocks": e.num_total_blocks,
        "free_state_slots": e.num_free_state_slots,
        "total_state_slots": e.num_total_state_slots,
    }


async def stream_final(
    client: AsyncShinkaiClient, prompt: str, max_tokens: int, first: asyncio.Event | None = None, **kwargs
) -> str:
    """Streams one request; its final finish reason, or "status:<code>" when it ended with an error status."""
    try:
        async for delta in client.generate_stream(prompt, max_tokens=max_tokens, ignore_eos=True, **kwargs):
            if first is not None:
                first.set()
            if delta.finish_reason is not None:
                return delta.finish_reason
        return "no final"
    except Exception as err:  # a typed client error carries the gRPC status
        return f"status:{type(err).__name__}"
    finally:
        if first is not None:
            first.set()  # never leave a waiter hanging on a stream that failed before its first delta


def test_an_image_chat_is_served_through_the_remote_worker(stack):
    """The engine has --multimodal (stack.py, remote workers too): the image is encoded by the multimodal
    service and its rows reach worker-0 by worker.v1 SetImages. Exact equality with the in-process worker is
    tests/services/worker/test_service.py's (batch-invariant mode; this stack is not)."""
    from services.engine import LLM, SamplingParams
    from tests.services.gateway.test_images import ask, data_url, encoded

    assert "--multimodal" in stack.by_name["engine-0"]["argv"] and "--worker" in stack.by_name["engine-0"]["argv"]
    messages = ask(data_url(encoded(100, 80, seed=1)))
    client = openai.OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    expected = LLM("tiny").chat(messages, SamplingParams(temperature=0, max_tokens=1))[0]
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)  # the expanded image span
    assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason in ("length", "stop")
    with urllib.request.urlopen(stack.by_name["multimodal"]["url"].removeprefix("metrics "), timeout=10) as r:
        assert re.search(r"^shinkai_multimodal_images_encoded_total [1-9]", r.read().decode(), re.M)
    report("image_through_remote_worker", prompt_tokens=reply.usage.prompt_tokens, **assert_pools_whole(stack))


def test_soak_streams_lose_nothing(stack):
    async def run():
        sent, finals, failed, tokens = 0, 0, [], 0
        deadline = time.monotonic() + SOAK_S

        async with AsyncShinkaiClient(stack.grpc, timeout=120) as client:

            async def loop(i: int) -> None:
                nonlocal sent, finals, tokens
                n = 0
                while time.monotonic() < deadline:
                    sent += 1
                    max_tokens = 1 + (i + n) % 4
                    got = 0
                    try:
                        async for delta in client.generate_stream(
                            f"soak {i} {n}", max_tokens=max_tokens, ignore_eos=True
                        ):
                            got += len(delta.token_ids)
                            if delta.finish_reason is not None:
                                finals += 1
                                if delta.finish_reason != "length" or got != max_tokens:
                                    failed.append(f"{delta.finish_reason} after {got} of {max_tokens} tokens")
                    except Exception as err:
                        failed.append(f"{type(err).__name__}: {err}")
                    tokens += got
                    n += 1

            start = time.monotonic()
            await asyncio.gather(*(loop(i) for i in range(SOAK_CONCURRENCY)))
            return sent, finals, failed, tokens, time.monotonic() - start

    sent, finals, failed, tokens, wall = asyncio.run(run())
    pools = assert_pools_whole(stack)
    report(
        "soak",
        concurrency=SOAK_CONCURRENCY,
        load_s=SOAK_S,
        wall_s=round(wall, 1),
        requests=sent,
        finals=finals,
        failed=len(failed),
        output_tokens=tokens,
        requests_per_s=round(sent / wall, 1),
        pools=pools,
    )
    assert not failed, failed[:5]
    assert finals == sent and sent >= SOAK_CONCURRENCY


def test_killed_worker_fails_streams_promptly_and_a_restarted_one_serves(stack):
    worker = stack.by_name["worker-0"]

    async def streams_while_killing():
        async with AsyncShinkaiClient(stack.grpc, timeout=60) as client:
            started = [asyncio.Event() for _ in range(12)]  # all running at once (max_num_seqs 16)
            tasks = [asyncio.create_task(stream_final(client, f"kill {i}", stack.long, started[i])) for i in range(12)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            os.kill(worker["pid"], signal.SIGKILL)
            killed = time.monotonic()
            done = await asyncio.wait_for(asyncio.gather(*tasks), 15)
            return done, time.monotonic() - killed

    results, ended_s = asyncio.run(streams_while_killing())
    assert all(r == "error" or r.startswith("status:") for r in results), results
    killed = time.monotonic()
    wait_for(lambda: not grpc_serving(stack.engine), 10, "the engine to report NOT_SERVING")
    engine_down_s = time.monotonic() - killed
    code, body = wait_for(lambda: (r := http_status(stack.http + "/health"))[0] == 503 and r, 10, "gateway /health 503")
    assert "engine" in body["status"], body
    with ShinkaiClient(stack.grpc, timeout=30) as c:  # refused at once, not queued behind a dead worker
        with pytest.raises(Unavailable, match="no engine is reachable"):
            c.generate("while down", max_tokens=1)
    pools = assert_pools_whole(stack)

    restarted = time.monotonic()
    stack.restart("worker-0")
    wait_for(lambda: http_status(stack.http + "/ready", timeout=30)[0] == 200, 90, "the gateway to be ready again")
    recovery_s = time.monotonic() - restarted
    with ShinkaiClient(stack.grpc, timeout=60) as c:
        assert c.generate("after restart", max_tokens=3, ignore_eos=True).finish_reason == "length"
    assert grpc_serving(stack.engine) and http_status(stack.http + "/health")[0] == 200
    assert_pools_whole(stack)
    report(
        "kill_worker",
        streams=len(results),
        finals_or_status=len(results),
        streams_ended_s=round(ended_s, 2),
        engine_not_serving_s=round(engine_down_s, 2),
        restart_to_ready_s=round(recovery_s, 2),
        pools=pools,
    )


def test_hung_worker_is_caught_by_heartbeat_not_the_step_deadline(stack):
    """SIGSTOP keeps the worker's sockets open, so only the heartbeat can tell: the held step is abandoned
    within the heartbeat timeout (3 s), not the step's 600 s deadline; SIGCONT brings it back."""
    worker = stack.by_name["worker-0"]

    async def streams_while_stopping():
        async with AsyncShinkaiClient(stack.grpc, timeout=60) as client:
            started = [asyncio.Event() for _ in range(8)]
            tasks = [asyncio.create_task(stream_final(client, f"hang {i}", stack.long, started[i])) for i in range(8)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            os.kill(worker["pid"], signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                done = await asyncio.wait_for(asyncio.gather(*tasks), 15)
            finally:
                ended = time.monotonic() - stopped
            return done, ended

    try:
        results, ended_s = asyncio.run(streams_while_stopping())
        assert all(r == "error" for r in results), results
        wait_for(lambda: not grpc_serving(stack.engine), 5, "the engine to report NOT_SERVING")
        pools = assert_pools_whole(stack)
    finally:
        os.kill(worker["pid"], signal.SIGCONT)
    resumed = time.monotonic()
    wait_for(lambda: grpc_serving(stack.engine), 30, "the engine to serve again")
    wait_for(lambda: http_status(stack.http + "/health")[0] == 200, 10, "the gateway to serve again")
    back_s = time.monotonic() - resumed
    with ShinkaiClient(stack.grpc, timeout=60) as c:
        assert c.generate("after hang", max_tokens=2, ignore_eos=True).finish_reason == "length"
    assert_pools_whole(stack)
    report(
        "hung_worker",
        streams=len(results),
        streams_ended_s=round(ended_s, 2),
        back_after_sigcont_s=round(back_s, 2),
        pools=pools,
    )
    assert ended_s < 10


def connz(monitor_port: int) -> dict[str, dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/connz?subs=1", timeout=5) as r:
        return {c.get("name", ""): c for c in json.loads(r.read())["connections"]}


def test_nats_restart_engines_and_gateway_reconnect(stack):
    nats = stack.by_name["nats"]
    monitor = free_port("127.0.0.1")

    async def load_across_restart():
        async with AsyncShinkaiClient(stack.grpc, timeout=60) as client:

            async def steady(i):
                results = []
                for n in range(6):
                    results.append(await stream_final(client, f"nats {i} {n}", 4))
                    await asyncio.sleep(0.3)
                return results

            tasks = [asyncio.create_task(steady(i)) for i in range(8)]
            await asyncio.sleep(0.5)
            os.kill(nats["pid"], signal.SIGTERM)
            await asyncio.to_thread(
                wait_for,
                lambda: (
                    not os.path.exists(f"/proc/{nats['pid']}")
                    or open(f"/proc/{nats['pid']}/stat").read().split()[2] == "Z"
                ),
                10,
                "nats to stop",
            )
            try:
                os.waitpid(nats["pid"], os.WNOHANG)
            except ChildProcessError:
                pass
            restarted = time.monotonic()
            stack.restart("nats", ["-m", str(monitor)])
            return [r for t in await asyncio.gather(*tasks) for r in t], restarted

    results, restarted = asyncio.run(load_across_restart())
    assert all(r == "length" for r in results), results  # token streams never travel on NATS

    def reconnected():
        try:
            conns = connz(monitor)
        except OSError:
            return None
        gateway, engine = conns.get("shinkai-gateway"), conns.get("shinkai-engine-0")
        if gateway is None or engine is None or not engine.get("in_msgs"):
            return None
        return gateway if "shinkai.engine.load.*" in gateway.get("subscriptions_list", []) else None

    gateway = wait_for(reconnected, 20, "engine and gateway to reconnect to the restarted nats-server")
    reconnect_s = time.monotonic() - restarted
    time.sleep(1.0)
    delivered = connz(monitor)["shinkai-gateway"]["out_msgs"]
    assert delivered > gateway["out_msgs"], "load reports do not reach the gateway after the restart"
    with ShinkaiClient(stack.grpc, timeout=60) as c:  # routing resumes
        assert all(
            c.generate(f"after nats {i}", max_tokens=2, ignore_eos=True).finish_reason == "length" for i in range(3)
        )
    pools = assert_pools_whole(stack)
    report(
        "restart_nats",
        streams_across_restart=len(results),
        failed=sum(r != "length" for r in results),
        reconnect_s=round(reconnect_s, 2),
        pools=pools,
    )


def test_sigterm_gateway_gives_every_stream_a_final_message(stack):
    gateway = stack.by_name["gateway"]

    before = routed(stack)
    logged = log_sizes(stack)

    async def fifty_streams():
        http = openai.AsyncOpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0, timeout=60)

        async def over_http(i, max_tokens):
            try:
                stream = await http.completions.create(
                    model="tiny",
                    prompt=f"term {i}",
                    max_tokens=max_tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                reason = "no final"
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].finish_reason is not None:
                        reason = chunk.choices[0].finish_reason
                return reason
            except Exception as err:
                return f"status:{type(err).__name__}"

        async with AsyncShinkaiClient(stack.grpc, timeout=60) as client:
            # 10 too long to finish within the grace period (aborted at its end), 40 short ones that
            # finish within it if they get a turn (max_num_seqs 16: some wait behind the long ones).
            tasks = []
            for i in range(50):
                max_tokens = stack.long if i < 10 else 8
                coro = over_http(i, max_tokens) if i % 2 else stream_final(client, f"term {i}", max_tokens)
                tasks.append(asyncio.create_task(coro))
            await asyncio.to_thread(wait_for, lambda: routed(stack) - before >= 50, 60, "all 50 streams routed")
            os.kill(gateway["pid"], signal.SIGTERM)
            signalled = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), DRAIN_S + 20)
            assert not any(r.startswith("status:") for r in results), results
            ended = time.monotonic() - signalled
        await http.close()
        return results, ended

    results, ended_s = asyncio.run(fifty_streams())
    _, status = os.waitpid(gateway["pid"], 0)
    assert os.waitstatus_to_exitcode(status) == 0
    long, short = results[:10], results[10:]
    # a final message each, no error status
    assert all(r in ("length", "abort") for r in results), (results, problems_since(stack, logged))
    assert long == ["abort"] * 10 and short.count("length") >= 1, results
    stopped = [json.loads(line) for line in open(gateway["log"]) if line.startswith('{"event": "stopped"')][-1]
    pools = assert_pools_whole(stack)
    report(
        "sigterm_gateway",
        streams=len(results),
        finals=sum(r in ("length", "abort") for r in results),
        finished=results.count("length"),
        aborted_at_grace=results.count("abort"),
        grace_s=DRAIN_S,
        last_final_s=round(ended_s, 2),
        aborted_by_gateway=stopped["aborted_at_drain"],
        pools=pools,
    )
    assert ended_s < DRAIN_S + 10
