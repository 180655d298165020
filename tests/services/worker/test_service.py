"""The worker in its own process (worker.v1) gives the same tokens and logprobs as the in-process worker,
and an engine refuses a worker that serves different weights."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from services.engine import LLM, SamplingParams
from services.engine.remote_worker import ModelMismatch, RemoteWorker

ROOT = pathlib.Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(180)


def start_worker(*extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "services.worker", "--grpc-addr", "127.0.0.1:0", *extra],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        pytest.fail(f"worker exited: {proc.stderr.read()[-2000:]}")
    return proc, f"127.0.0.1:{json.loads(line)['grpc_port']}"


def stop(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == 0


@pytest.fixture(scope="module")
def remote_llm():
    # Batch-invariant mode in both processes: outside it, the same plans at the same thread count may differ in
    # the last bit across processes (at several threads the BLAS's split is not promised to repeat).
    proc, address = start_worker("--batch-invariant")
    remote_worker = RemoteWorker(address)
    llm = LLM("tiny", worker=remote_worker, batch_invariant=True)
    remote_worker.check_model(llm.source)
    yield llm
    remote_worker.close()
    stop(proc)


def test_remote_worker_gives_the_same_tokens_as_the_in_process_one(remote_llm):
    prompts = ["Hello", "The deep sea is", [0, 19923, 19923, 19923], "Forced"]
    params = [SamplingParams(max_tokens=5, seed=3, logprobs=2), SamplingParams(max_tokens=4, temperature=0),
              SamplingParams(max_tokens=3, seed=9, top_p=0.9, top_k=50),
              SamplingParams(max_tokens=3, seed=4, logprobs=1, forced_token_ids=(7, 8), logit_bias={9: 40.0, 10: -2.0})]
    local = LLM("tiny", batch_invariant=True).generate(prompts, params)
    llm = remote_llm
    remote = llm.generate(prompts, params)
    for a, b in zip(local, remote):
        assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
        assert a.logprobs == b.logprobs
        assert a.top_logprobs == b.top_logprobs
    assert remote[3].token_ids == [7, 8, 9]  # forced twice, then the +40 bias: both crossed the protocol
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks


def test_a_worker_with_other_weights_is_refused(remote_llm):
    from services.engine.model_source import load_model

    other = load_model("tiny", seed=1)  # an engine whose model has other weights than the worker's (seed 0)
    with pytest.raises(ModelMismatch, match="weights"):
        remote_llm.engine.worker.check_model(other)
    remote_llm.engine.worker.check_model(remote_llm.source)  # its own model passes


def test_an_engine_with_a_remote_worker_loads_no_weights(remote_llm):
    """The worker owns the weights: the engine holds config, tokenizer and the weights' identity only."""
    assert remote_llm.source.model is None
    assert remote_llm.source.weights_id == "random tiny seed 0"
