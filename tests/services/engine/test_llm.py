"""The offline API end to end on the built-in tiny model: greedy equals the reference forward,
determinism across batches, bad input, abort and preemption with whole pools afterwards."""

import pytest
import torch

from model.batch_invariant import batch_invariant
from services.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("pools_checked_after_every_step")  # conftest.py


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny", block_size=16, max_num_batched_tokens=64, max_num_seqs=16)


def _pools_whole(llm):
    s = llm.stats()
    assert s.free_blocks == s.total_blocks and s.free_state_slots == s.total_state_slots
    assert s.num_waiting == s.num_running == 0
    llm.engine.scheduler.check_invariants()


def _prompt(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 129_000, (n,), generator=g).tolist()


def test_greedy_follows_the_full_sequence_argmax(llm):
    # Batch-invariant mode on both sides: the cached engine's logits equal the full forward's under ==
    # (docs/batch-invariance.md), so every greedy token is the forward's argmax, with no margin exemption.
    llm = LLM(
        model="tiny", source=llm.source, block_size=16, max_num_batched_tokens=64, max_num_seqs=16, batch_invariant=True
    )
    prompt = _prompt(0, 40)
    out = llm.generate(prompt, GREEDY)[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    with torch.no_grad(), batch_invariant():
        logits = llm.source.model(torch.tensor([prompt + out.token_ids]))[0]
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(out.token_ids)]
    assert out.token_ids == rows.argmax(-1).tolist()  # the sampler's greedy ties go to the lowest id, as argmax's
    _pools_whole(llm)


def test_text_prompts_decode_to_text(llm):
    out = llm.generate("The deep sea is", SamplingParams(max_tokens=4, seed=1, ignore_eos=True))[0]
    assert out.prompt_token_ids[0] == llm.source.config.bos_token_id
    assert len(out.token_ids) == 4 and isinstance(out.text, str) and out.text
    assert len(out.logprobs) == 4 and all(lp <= 0 for lp in out.logprobs)


def test_a_request_gets_the_same_tokens_alone_and_in_any_batch(llm):
    # Batch-invariant mode: tokens and logprobs equal under ==, at any place in any batch.
    llm = LLM(
        model="tiny", source=llm.source, block_size=16, max_num_batched_tokens=64, max_num_seqs=16, batch_invariant=True
    )
    target = _prompt(1, 23)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=5, ignore_eos=True)
    alone = llm.generate(target, params)[0]
    others = [_prompt(100 + i, 5 + 3 * i) for i in range(15)]
    other_params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3 + i % 4, ignore_eos=True) for i in range(15)]
    for order in (0, 7, 15):
        prompts = others[:order] + [target] + others[order:]
        plist = other_params[:order] + [params] + other_params[order:]
        batched = llm.generate(prompts, plist)[order]
        assert (batched.token_ids, batched.logprobs) == (alone.token_ids, alone.logprobs)
    different = llm.generate(
        [target] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=5, ignore_eos=True) for s in (1, 2, 3, 4)]
    )
    assert len({tuple(o.token_ids) for o in different}) > 1
    _pools_whole(llm)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "empty"),
        ([1, 200_000], SamplingParams(), "outside the vocabulary"),
        ([1, 2], SamplingParams(max_tokens=5000), "longer than the context"),
    ],
)
def test_bad_prompts_raise_and_queue_nothing(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6, 7], prompt], [SamplingParams(), params])
    _pools_whole(llm)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n must be"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_bad_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_abort_waiting_between_chunks_and_running(llm):
    engine = llm.engine
    engine.add_request("long", _prompt(5, 150), GREEDY)  # 150 > 64-token budget: prefilled in chunks
    engine.add_request("wait", _prompt(6, 10), GREEDY)
    engine.add_request("run", _prompt(7, 10), GREEDY)
    engine.step()  # "long" is cut after 64 tokens
    assert engine.scheduler.request("long").num_computed_tokens == 64
    finals = {o.request_id: o for o in [engine.abort("long"), engine.abort("wait")]}
    while engine.scheduler.request("run") is not None and not engine.scheduler.request("run").token_ids[10:]:
        engine.step()
    finals["run"] = engine.abort("run")
    assert {request_id: o.finish_reason for request_id, o in finals.items()} == {
        "long": "abort",
        "wait": "abort",
        "run": "abort",
    }
    assert engine.abort("run") is None
    _pools_whole(llm)


@pytest.mark.parametrize("mode", ["stop", "recompute"])
def test_preemption_through_llm(mode):
    small = LLM(
        model="tiny", block_size=4, num_blocks=9, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode=mode
    )
    outs = small.generate(
        [_prompt(i, 6) for i in range(3)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    reasons = sorted(o.finish_reason for o in outs)
    if mode == "stop":
        assert "preempted" in reasons
    else:
        assert reasons == ["length"] * 3
    _pools_whole(small)


def test_logit_bias_pairs_are_checked_and_kept_sorted():
    assert SamplingParams(logit_bias={9: 1.5, 3: -2, 4: 0}).logit_bias == ((3, -2.0), (9, 1.5))  # 0 is a no-op
    for bad, match in (
        ({5: 101.0}, "-100 to 100"),
        ({5: float("nan")}, "-100 to 100"),
        (((5, 1.0), (5, 2.0)), "twice"),
    ):
        with pytest.raises(ValueError, match=match):
            SamplingParams(logit_bias=bad)


def test_logit_bias_outside_the_vocabulary_is_refused_before_queueing(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([1, 2], SamplingParams(max_tokens=1, logit_bias={200_000: 1.0}))
    _pools_whole(llm)
