"""`shinkai serve` as a separate process on random loopback ports: the openai client and the gRPC client
against it, then SIGTERM drains it and it reports whole pools."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from services.client import ShinkaiClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def serve_proc():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.entrypoints.cli",
            "serve",
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--drain-timeout",
            "10",
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        pytest.fail(f"shinkai serve exited: {proc.stderr.read()[-2000:]}")
    ready = json.loads(line)
    assert ready["event"] == "ready"
    yield proc, ready
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_openai_and_grpc_clients_against_a_serve_process(serve_proc):
    proc, ready = serve_proc
    assert proc.pid != os.getpid()
    client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="unused", max_retries=0, timeout=60)
    plain = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, seed=2)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt="Hello", max_tokens=3, seed=2, stream=True)
    )
    assert streamed == plain.choices[0].text and plain.usage.completion_tokens == 3
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 2
    with ShinkaiClient(ready["grpc"], timeout=60) as c:
        assert c.generate("Hello", max_tokens=3, seed=2).text == plain.choices[0].text


def health_code(url: str) -> int | str:
    try:
        urllib.request.urlopen(url + "/health", timeout=5).close()
    except urllib.error.HTTPError as err:
        return err.code
    except urllib.error.URLError as err:
        return f"unreachable: {err.reason}"
    return 200


def health_while_draining(url: str) -> list[int | str]:
    """/health from when draining shows until half a second later: the server keeps listening while it
    drains (a framework that closed its listener on SIGTERM would be unreachable by then)."""
    deadline = time.monotonic() + 10
    first = health_code(url)
    while first == 200 and time.monotonic() < deadline:
        time.sleep(0.02)
        first = health_code(url)
    time.sleep(0.5)
    return [first, health_code(url)]


def test_sigterm_drains_live_requests_and_leaves_pools_whole(serve_proc):
    proc, ready = serve_proc
    client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="unused", max_retries=0, timeout=60)
    http_stream = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=40, stream=True, extra_body={"ignore_eos": True}
    )
    http_chunks = [next(iter(http_stream))]
    with ShinkaiClient(ready["grpc"], timeout=60) as c:
        stream = c.generate_stream("Hello", max_tokens=6, ignore_eos=True)
        first = next(stream)
        os.kill(proc.pid, signal.SIGTERM)  # drain: both live requests may finish
        assert health_while_draining(ready["http"]) == [503, 503]  # still listening, refusing new work
        rest = list(stream)
    http_chunks += list(http_stream)
    assert rest[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in [first, *rest]) == 6
    assert [c.choices[0].finish_reason for c in http_chunks if c.choices][-1] == "length"
    assert "".join(c.choices[0].text for c in http_chunks if c.choices)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events] == ["draining", "stopped"]
    pools = events[-1]["pools"]
    assert pools["free_blocks"] == pools["total_blocks"] and pools["free_state_slots"] == pools["total_state_slots"]
