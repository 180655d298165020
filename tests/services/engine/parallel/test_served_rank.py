"""`shinkai up --dp 2`: two rank processes, each an engine endpoint, behind one gateway (one group for the
module, CPU, gloo, tiny). An idle group does not spin; a lone request on it starts at its first step, so
`/ready`'s one-token probe answers 200; plans published on the planner's subject switch both ranks at one
boundary (a plan for 4 ranks refused on both, by name); a rank killed mid-generation ends every in-flight
stream with "error", takes the whole group to NOT_SERVING, and `down` leaves no process behind. Greedy
replies through HTTP equal one process's in tests/services/gateway/test_rank_server.py (`serve --dp 2`)."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from observability.metrics import ENGINE_STEPS
from services.entrypoints.probe import healthy
from services.entrypoints.stack import down, up
from services.entrypoints.stack_config import StackConfig
from services.eplb.layout import Layout, startup_layout
from services.eplb.messages import PlanMessage
from services.subjects import EXPERT_PLAN
from tests.ranks_harness import alive
from tests.service_logs import ready_event

pytestmark = pytest.mark.timeout(300)

SIZING = dict(max_num_seqs=4, max_model_len=256)
# The killed-rank test's stream length. Two streams sent at once usually reach the idle group in the same
# idle wait and prefill together; when the second comes a step late it waits for the next vote point that
# passes for a lone rank, the ANY point, at most 100 decode steps away (prefill_any_attempt_interval).
# The first stream must still be running then, with 100 steps to spare.
NUM_STREAM_TOKENS = 200
# A rank's CPU seconds over this much idle wall time (seconds).
IDLE_S = 3.0


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds of ``pid`` (/proc/PID/stat fields 14 and 15)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dp-stack")
    config = StackConfig(
        data_parallel_size=2,
        http_port=0,
        grpc_port=0,
        run_dir=run_dir,
        batch_invariant=True,
        drain_timeout_s=5.0,
        **SIZING,
    )
    state = up(config, timeout_s=180, log=lambda *_: None)
    by_name = {s["name"]: s for s in state["services"]}
    ready = ready_event(by_name["gateway"]["log"])
    client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield state, by_name, ready, client
    finally:
        down(run_dir, timeout_s=30, log=lambda *_: None)


def test_an_idle_group_does_not_spin(group):
    _, by_name, _, _ = group
    pids = [by_name[f"engine-{r}"]["pid"] for r in range(2)]
    before = [_cpu_s(p) for p in pids]
    time.sleep(IDLE_S)
    used = [_cpu_s(p) - b for p, b in zip(pids, before)]
    # Idle ranks vote once per idle_wait_s (0.05 s): far below a tenth of a core; a spinning loop uses ~1.
    assert all(u < 0.1 * IDLE_S for u in used), used


def _steps(by_name) -> dict[str, float]:
    """Steps run so far by kind ("prefill", "decode", "placeholder"), summed over both ranks' /metrics."""
    counts: dict[str, float] = {}
    for r in range(2):
        url = by_name[f"engine-{r}"]["url"].split()[-1]  # "metrics http://host:port/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == f"{ENGINE_STEPS}_total":
                    counts[sample.labels["kind"]] = counts.get(sample.labels["kind"], 0) + sample.value
    return counts


def _steps_since(by_name, before: dict[str, float], expected: dict[str, float]) -> dict[str, float]:
    """The steps run since ``before``, by kind (kinds that ran none left out). A rank counts a step after
    it delivered its tokens, so this reads again until the count is ``expected`` or 10 s have passed."""
    deadline = time.monotonic() + 10
    while True:
        after = _steps(by_name)
        changed = {k: after.get(k, 0) - before.get(k, 0) for k in after.keys() | before.keys()}
        changed = {k: n for k, n in changed.items() if n}
        if changed == expected or time.monotonic() > deadline:
            return changed
        time.sleep(0.1)


def test_a_lone_request_on_an_idle_group_starts_at_once_and_ready_answers(group):
    # The group is idle, so the first step after a lone request arrives is an ANY point: its rank prefills
    # at once and the other runs one empty prompt step alongside (a placeholder). Before, the lone request
    # waited for the ALL point at 70 (failed: the other rank wants nothing) and the ANY point at 100.
    _, by_name, ready, client = group
    before = _steps(by_name)
    with urllib.request.urlopen(ready["http"] + "/ready", timeout=30) as answer:  # a one-token probe
        assert answer.status == 200
    expected = {"prefill": 1, "placeholder": 1}
    assert _steps_since(by_name, before, expected) == expected
    after_probe = _steps(by_name)
    # A second lone request: the probe left decode_step at 0, an ALL point that the other rank would fail;
    # the group's idle vote makes it an ANY point. Two tokens: one prompt step and one decode step.
    reply = client.completions.create(
        model="tiny", prompt="lone", max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"
    expected = {"prefill": 1, "decode": 1, "placeholder": 2}
    assert _steps_since(by_name, after_probe, expected) == expected


def _publish(url: str, credentials: dict[str, str], messages: list[bytes]) -> None:
    import asyncio

    import nats

    async def send() -> None:
        nc = await nats.connect(url, **credentials)
        for data in messages:
            await nc.publish(EXPERT_PLAN, data)
        await nc.flush(timeout=5)
        await nc.close()

    asyncio.run(send())


def _switch_lines(by_name) -> list[list[str]]:
    """Each rank's live-EPLB log lines so far."""
    return [[line.strip() for line in open(by_name[f"engine-{r}"]["log"]) if "EPLB" in line] for r in range(2)]


def test_plans_from_nats_switch_both_ranks_at_one_boundary(group):
    # The planner's subject, as the planner would publish: v1 moves experts of layer 0 across the ranks, v2
    # is for 4 ranks (refused on both, by name). Greedy text is the same before and after the move.
    state, by_name, _, client = group
    before = (
        client.completions.create(
            model="tiny", prompt="moved", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    moved = Layout((7, 0, 3, 5, 6, 1, 2, 4), num_gpus=2, num_logical=8)
    plans = [PlanMessage(1, 0, 0, moved, 1.2, 1.1, 4, 0), PlanMessage(2, 1, 0, startup_layout(8, 4, 0), 1.2, 1.1, 4, 0)]
    planner = state["service_env"]["eplb"]  # the planner's own NATS user: the one that may publish plans
    credentials = {"user": planner["SHINKAI_NATS_USER"], "password": planner["SHINKAI_NATS_PASSWORD"]}
    _publish(by_name["nats"]["url"], credentials, [p.encode() for p in plans])
    deadline = time.monotonic() + 20  # an idle group's boundary votes come every idle_wait_s
    while time.monotonic() < deadline:
        lines = _switch_lines(by_name)
        if all(any("version 2 in force" in line for line in rank) for rank in lines):
            break
        time.sleep(0.1)
    # "version V in force from boundary B: layers [...] moved" (the switch's own time left out)
    switched = [
        [line.split("EPLB ", 1)[1].split(", switched")[0] for line in rank if "in force" in line] for rank in lines
    ]
    assert switched[0] == switched[1] and len(switched[0]) == 2, switched  # the same boundaries on both
    for rank in lines:
        assert any(
            "EPLB plan version 2 refused: layer 1's layout has 4 ranks, this group has 2" in line for line in rank
        ), rank
    after = (
        client.completions.create(
            model="tiny", prompt="moved", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    assert after == before


def test_a_killed_rank_ends_streams_with_error_and_down_leaves_nothing(group):
    state, by_name, ready, client = group
    assert kill_mid_streams(client, by_name, "engine-1") < 30  # gloo fails at once on the closed connection
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(ready["http"] + "/ready", timeout=10)
    assert err.value.code == 503
    with pytest.raises(openai.APIStatusError) as refused:  # a new request: refused, never queued
        client.completions.create(model="tiny", prompt="after", max_tokens=2)
    assert refused.value.status_code == 503
    down(Path(state["config"]["run_dir"]), timeout_s=30, log=lambda *_: None)
    # `down` counts a process stopped once its command line is gone, which happens while it exits (its
    # memory released) and before /proc shows it a zombie: give such an exit a moment to complete.
    deadline = time.monotonic() + 5
    while any(alive(s["pid"]) for s in state["services"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [s["name"] for s in state["services"] if alive(s["pid"])] == []


def test_remote_workers_give_one_process_tokens_and_a_killed_worker_ends_the_group(tmp_path):
    """`up --dp 2 --remote-workers`: each rank's worker is a process of its own; the workers exchange tokens,
    the engines vote. Greedy replies, text and images (encoded by the multimodal service, the rows sent to
    the rank's worker), equal one process's with == (batch-invariant mode); a worker killed mid-stream ends
    both ranks' streams with "error", and `down` leaves no process behind."""
    from services.engine import LLM, SamplingParams
    from tests.services.gateway.test_images import GREEDY, ask, data_url, encoded

    sizing = dict(SIZING, max_model_len=4096)  # room for a chat's image prompt
    config = StackConfig(
        data_parallel_size=2,
        remote_workers=True,
        http_port=0,
        grpc_port=0,
        run_dir=tmp_path,
        batch_invariant=True,
        drain_timeout_s=5.0,
        **sizing,
    )
    state = up(config, timeout_s=180, log=lambda *_: None)
    try:
        by_name = {s["name"]: s for s in state["services"]}
        held = []
        for r in range(2):  # the engines drive their workers: no weights, no runner of their own
            ready_line = ready_event(by_name[f"engine-{r}"]["log"])
            assert ready_line["runner"].startswith("remote worker")
            worker_line = ready_event(by_name[f"worker-{r}"]["log"])
            assert worker_line["dp_rank"] == r
            held.append(worker_line["experts"])
        # Each worker holds half of tiny's 8 routed experts (no redundancy): the others are its peer's, so
        # every token whose picks include them crosses the workers' exchange.
        assert sorted(held[0] + held[1]) == list(range(8)) and len(held[0]) == len(held[1]) == 4
        ready = ready_event(by_name["gateway"]["log"])
        client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = ["The deep sea is", "Hello"]
        replies: dict[str, object] = {}

        def complete(prompt):
            replies[prompt] = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=1, extra_body={"ignore_eos": True}
            )

        threads = [threading.Thread(target=complete, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        llm = LLM("tiny", batch_invariant=True, **sizing)
        expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        for prompt, out in zip(prompts, expected):
            choice = replies[prompt].choices[0]
            assert choice.text == out.text
            assert choice.logprobs.token_logprobs == pytest.approx(out.logprobs, abs=0)
        chats = [ask(data_url(encoded(32, 28, seed=s))) for s in (1, 2)]  # two at once: both ranks, by load
        answers: dict[int, object] = {}

        def chat(i):
            answers[i] = client.chat.completions.create(
                model="tiny",
                messages=chats[i],
                max_tokens=4,
                temperature=0,
                logprobs=True,
                extra_body={"chat_template_kwargs": {"thinking": False}},  # the answer is all content
            )

        threads = [threading.Thread(target=chat, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i, messages in enumerate(chats):
            out = llm.chat(messages, GREEDY, thinking={"type": "disabled"})[0]
            assert answers[i].usage.prompt_tokens == len(out.prompt_token_ids)  # the expanded image span
            assert answers[i].choices[0].message.content == out.text
            assert [t.logprob for t in answers[i].choices[0].logprobs.content] == pytest.approx(out.logprobs, abs=0)

        kill_mid_streams(client, by_name, "worker-1")
    finally:
        down(tmp_path, timeout_s=30, log=lambda *_: None)
    deadline = time.monotonic() + 5
    while any(alive(s["pid"]) for s in state["services"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [s["name"] for s in state["services"] if alive(s["pid"])] == []


def kill_mid_streams(client, by_name: dict, victim: str) -> float:
    """Two streams get their first tokens, then ``victim`` (a rank or a rank's worker) is SIGKILLed: both end,
    each with tokens then one final "error" (ignore_eos: nothing else ends them), and engine-0 (the surviving
    rank) turns NOT_SERVING. Returns the seconds from the kill to both streams' end."""
    results: dict[int, list] = {}
    first_token = [threading.Event() for _ in range(2)]

    def stream(i):
        reasons = []
        for chunk in client.completions.create(
            model="tiny", prompt=f"long {i}", max_tokens=NUM_STREAM_TOKENS, stream=True, extra_body={"ignore_eos": True}
        ):
            if chunk.choices:
                first_token[i].set()
                reasons.append(chunk.choices[0].finish_reason)
        results[i] = reasons

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for event in first_token:
        assert event.wait(120), "no stream produced a token"
    os.kill(by_name[victim]["pid"], signal.SIGKILL)
    lost_at = time.monotonic()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), f"a stream hung after {victim} was lost"
    seconds = time.monotonic() - lost_at
    for reasons in results.values():
        assert reasons[-1] == "error" and all(r is None for r in reasons[:-1]), reasons
    deadline = time.monotonic() + 10
    while healthy("127.0.0.1", by_name["engine-0"]["health"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not healthy("127.0.0.1", by_name["engine-0"]["health"])  # the survivor: NOT_SERVING
    return seconds
