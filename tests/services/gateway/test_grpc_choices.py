"""shinkai.v1 Generate with n > 1 choices, prompt_logprobs and skip_special_tokens, through the Python client,
in process and through an engine endpoint (the gateway's `RemoteEngine`, as in `shinkai up`)."""

import asyncio

import pytest

from services.engine import SamplingParams
from services.gateway.api_server import ApiServer
from services.gateway.frontend import Frontend, GenerateArgs
from services.gateway.remote import RemoteEngine
from tests.services.gateway.forcing import forcing_engine, token_ids
from tests.services.gateway.openai.test_prompt_logprobs import full_log_softmax
from tests.services.gateway.support import wait_whole

pytestmark = pytest.mark.timeout(120)


def test_n_choices_equal_llm_generates(grpc_client, served, reference_llm):
    """Each choice == LLM.generate's choice of the same index (its own seed stream), usage per choice."""
    choices = grpc_client.generate_choices("The sea", max_tokens=4, seed=7, n=3, ignore_eos=True)
    expected = reference_llm.generate("The sea", SamplingParams(max_tokens=4, seed=7, n=3, ignore_eos=True))
    assert [c.index for c in choices] == [0, 1, 2]
    assert [c.token_ids for c in choices] == [e.token_ids for e in expected]
    assert [c.text for c in choices] == [e.text for e in expected]
    assert len({tuple(c.token_ids) for c in choices}) > 1  # the seeds differ
    assert all(c.finish_reason == "length" and c.completion_tokens == 4 for c in choices)
    deltas = list(grpc_client.generate_stream("The sea", max_tokens=4, seed=7, n=3, ignore_eos=True))
    for c in choices:
        mine = [d for d in deltas if d.index == c.index]
        assert [t for d in mine for t in d.token_ids] == c.token_ids
        assert [d.finish_reason for d in mine][-1] == "length"
    with pytest.raises(ValueError, match="generate_choices"):
        grpc_client.generate("The sea", max_tokens=1, n=2)
    wait_whole(served)


def test_prompt_logprobs_equal_the_full_forward(grpc_client, served, reference_llm):
    prompt = reference_llm.encode("The deep sea keeps its light")
    full = full_log_softmax(reference_llm, prompt)
    choices = grpc_client.generate_choices(prompt, max_tokens=2, n=2, seed=3, prompt_logprobs=2)
    order = full.sort(dim=-1, descending=True, stable=True).indices[:, :2]
    for c in choices:
        assert c.prompt_logprobs == [float(full[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]
        assert c.prompt_ranks == [int((full[p] >= full[p, prompt[p + 1]]).sum()) for p in range(len(prompt) - 1)]
        assert c.prompt_top_logprobs == [
            [(int(t), float(full[p, t])) for t in order[p]] for p in range(len(prompt) - 1)
        ]
    assert grpc_client.generate(prompt, max_tokens=1).prompt_logprobs is None
    wait_whole(served)


def test_skip_special_tokens_false_keeps_them(grpc_client, served):
    with forcing_engine(served.server.frontend) as forced:
        forced.forced = tuple(token_ids("Hi") + [1] + token_ids("there"))
        kept, skipped = (
            grpc_client.generate("x", max_tokens=len(forced.forced), ignore_eos=True, skip_special_tokens=skip)
            for skip in (False, True)
        )
    assert kept.text == "Hi<｜end▁of▁sentence｜>there" and skipped.text == "Hithere"


def test_choices_and_prompt_logprobs_through_an_engine_endpoint(served, reference_llm):
    """A gateway in front of an engine endpoint over shinkai.v1: the n choices and each one's prompt logprobs
    arrive as in process."""
    server = served.server
    prompt = reference_llm.encode("Deep water")
    params = SamplingParams(max_tokens=3, n=2, seed=5, ignore_eos=True, prompt_logprobs=1)

    async def run(hop: bool):
        engine_side = Frontend(
            server.frontend.info,
            server.frontend.engine,
            server.frontend.tokenizer,
            server.metrics,
            takes_request_ids=True,
        )
        endpoint = remote = None
        frontend = engine_side
        if hop:
            endpoint = ApiServer(engine_side, "127.0.0.1", None, 0)
            await endpoint.start()
            remote = RemoteEngine("engine-hop", f"127.0.0.1:{endpoint.grpc_port}")
            frontend = Frontend(server.frontend.info, remote, server.frontend.tokenizer, server.metrics)
        try:
            generations = await frontend.start_choices(GenerateArgs(model=None, prompt_token_ids=prompt, params=params))
            got = []
            for g in generations:
                pieces = [p async for p in g]
                first = next(p.delta for p in pieces if p.delta.prompt_logprobs is not None)
                got.append(
                    (
                        [t for p in pieces for t in p.delta.token_ids],
                        "".join(p.text for p in pieces),
                        first.prompt_logprobs,
                        first.prompt_top_logprobs,
                        first.prompt_ranks,
                        pieces[-1].delta.finish_reason,
                    )
                )
            return got
        finally:
            if endpoint is not None:
                await remote.close()
                await endpoint.stop()

    local = asyncio.run_coroutine_threadsafe(run(False), served.loop).result(60)
    hopped = asyncio.run_coroutine_threadsafe(run(True), served.loop).result(60)
    assert hopped == local and len(local) == 2
    expected = reference_llm.generate([prompt], params)
    assert [g[0] for g in local] == [e.token_ids for e in expected]
    assert [g[2] for g in local] == [e.prompt_logprobs for e in expected]
    wait_whole(served)
