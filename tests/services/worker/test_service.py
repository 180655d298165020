"""The worker in its own process (worker.v1) gives the same tokens and logprobs as the in-process worker,
image chats included (their rows cross by ``SetImages``), and an engine refuses a worker that serves
different weights."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.remote.remote_worker import ModelMismatch, RemoteWorker

ROOT = pathlib.Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(180)


def start_worker(*extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.entrypoints.worker", "--grpc-addr", "127.0.0.1:0", *extra],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
    params = [
        SamplingParams(max_tokens=5, seed=3, logprobs=2),
        SamplingParams(max_tokens=4, temperature=0),
        SamplingParams(max_tokens=3, seed=9, top_p=0.9, top_k=50),
        SamplingParams(max_tokens=3, seed=4, logprobs=1, forced_token_ids=(7, 8), logit_bias={9: 40.0, 10: -2.0}),
    ]
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


def _drain(llm) -> dict[str, object]:
    finished = {}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_an_image_chat_on_a_remote_worker_equals_the_in_process_one(remote_llm):
    """The image rows cross worker.v1 (``SetImages``): an image chat's tokens and logprobs are the in-process
    worker's exactly (batch-invariant mode in both), alone and beside a text request."""
    from services.engine.images.prompt import expand_images
    from services.tokenizer.chat import IMAGE_PLACEHOLDER
    from tests.services.engine.test_llm_chat import ask, data_url

    local = LLM("tiny", batch_invariant=True)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    messages = ask(data_url(90, 70, seed=3))
    want = local.chat(messages, params)[0]
    rendered = local._chat.render({"messages": messages})  # the renderer local.chat just built
    ids, rows = expand_images(
        rendered.token_ids, rendered.image_urls, local.tokenizer.token_to_id(IMAGE_PLACEHOLDER), local.source.model
    )
    assert rows is not None and rows.dtype == torch.float32 and len(ids) == len(want.prompt_token_ids)
    engine = remote_llm.engine
    for with_text in (False, True):
        engine.add_request(f"img{with_text}", ids, params, ready=False)
        if with_text:
            engine.add_request("text", ids[:20], SamplingParams(max_tokens=3, seed=1))
        engine.provide_images(f"img{with_text}", rows)
        got = _drain(remote_llm)[f"img{with_text}"]
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs, with_text
        assert got.top_logprobs == want.top_logprobs
    stats = remote_llm.stats()
    assert stats.free_blocks == stats.total_blocks and stats.free_state_slots == stats.total_state_slots


def test_image_rows_that_do_not_fit_are_refused_by_the_remote_worker(remote_llm):
    """INVALID_ARGUMENT from the worker is a ValueError naming the mismatch; the worker keeps serving."""
    worker, cfg = remote_llm.engine.worker, remote_llm.source.config
    with pytest.raises(ValueError, match="refused the image rows: .*3 image placeholder positions but"):
        worker.set_images("bad", [5] + [cfg.vision.image_token_id] * 3, torch.zeros(2, cfg.hidden_size))
    assert remote_llm.generate(["Hello"], SamplingParams(max_tokens=2))[0].token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_image_rows_cross_the_codec_bit_for_bit(dtype):
    from services.worker.service import array_to_tensor, tensor_to_array

    rows = (torch.randn(7, 5, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    back = array_to_tensor(tensor_to_array(rows))
    assert back.dtype == dtype and torch.equal(
        back.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        rows.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )
    msg = tensor_to_array(rows)
    msg.shape[0] = 8
    with pytest.raises(ValueError, match="do not hold"):
        array_to_tensor(msg)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        tensor_to_array(rows.to(torch.float16))
