"""`shinkai serve --dp 2` as a separate process (CPU, gloo, tiny; one group for the module): greedy HTTP replies
in the batch-invariant mode equal `LLM(..., dp=1)`'s with ==, and no rank outlives a SIGKILLed server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from services.engine import LLM, SamplingParams
from services.entrypoints.stack import ROOT
from tests.ranks_harness import alive

pytestmark = pytest.mark.timeout(300)

SIZING = dict(max_num_seqs=4, max_model_len=128)
PROMPTS = ["The deep sea is", "Hello"]


@pytest.fixture(scope="module")
def serve_ranks(tmp_path_factory):
    log = open(tmp_path_factory.mktemp("serve-dp") / "serve.log", "w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.entrypoints.cli",
            "serve",
            "--dp",
            "2",
            "--batch-invariant",
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--max-num-seqs",
            str(SIZING["max_num_seqs"]),
            "--max-model-len",
            str(SIZING["max_model_len"]),
            "--drain-timeout",
            "5",
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        log.seek(0)
        pytest.fail(f"shinkai serve --dp 2 exited: {log.read()[-3000:]}")
    ready = json.loads(line)
    assert ready["event"] == "ready" and len(ready["ranks"]) == 2
    yield proc, ready
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    for pid in ready["ranks"]:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_greedy_through_http_equals_one_process(serve_ranks):
    _, ready = serve_ranks
    client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="unused", max_retries=0, timeout=120)
    replies: dict[str, object] = {}

    def ask(prompt):
        replies[prompt] = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=1, extra_body={"ignore_eos": True}
        )

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    llm = LLM("tiny", batch_invariant=True, **SIZING)
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for prompt, out in zip(PROMPTS, expected):
        choice = replies[prompt].choices[0]
        assert choice.text == out.text
        assert choice.logprobs.token_logprobs == pytest.approx(out.logprobs, abs=0)


def test_no_rank_outlives_a_killed_server(serve_ranks):
    proc, ready = serve_ranks
    assert all(alive(pid) for pid in ready["ranks"])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 30  # SIGTERM from the kernel (PDEATHSIG), then each rank's drain
    while any(alive(pid) for pid in ready["ranks"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in ready["ranks"] if alive(pid)] == []
