"""Constrained requests in the engine: the readiness gate holds a request while its grammar compiles and lets
others run; choices of n > 1 each walk their own matcher; preemption stops a constrained request even in
recompute mode; a dead end, a failed or too-slow compile end the request with an error; what cannot be combined
with structured output is refused before anything is queued."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import pytest

from services.engine import LLM
from services.engine.finish_reason import FinishReason
from services.engine.sampling_params import SamplingParams
from services.engine.structured.constraint import Constraint

pytestmark = pytest.mark.timeout(300)

REGEX = r"[a-c]{2,5}-\d{1,3}"


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", max_num_seqs=16)


def _whole(llm: LLM) -> bool:
    s = llm.stats()
    return s.free_blocks == s.total_blocks and s.free_state_slots == s.total_state_slots and not s.num_waiting


def _slow_schema(tag: str) -> str:
    """A schema whose compile takes seconds (long bounded string patterns over a 129k vocabulary)."""
    props = {f"{tag}{i}": {"type": "string", "pattern": f"^[a-z]{{{i},{i + 40}}}$"} for i in range(12)}
    return json.dumps({"type": "object", "properties": props})


def test_a_compiling_grammar_does_not_delay_a_plain_request(llm):
    engine = llm.engine
    prompt = llm.encode("Hello there")
    engine.add_request(
        "slow", prompt, SamplingParams(max_tokens=3, constraint=Constraint("json_schema", _slow_schema("g")))
    )
    engine.add_request("plain", prompt, SamplingParams(max_tokens=3))
    first: dict[str, bool] = {}  # request -> whether "slow" was still behind the gate at its first token
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = "slow" in engine.structured.gate
    assert first["plain"] is True  # the plain request got its first token while the grammar still compiled
    assert "slow" in first and _whole(llm)


def test_choices_each_walk_their_own_matcher(llm):
    outs = llm.generate(["Hi"], SamplingParams(n=4, seed=3, max_tokens=32, constraint=Constraint("regex", REGEX)))
    assert len(outs) == 4 and len({o.text for o in outs}) > 1
    for o in outs:
        assert o.finish_reason == FinishReason.STOP and re.fullmatch(REGEX, o.text), o.text
    assert _whole(llm)


def test_a_dead_end_ends_the_request_with_an_error(llm):
    x = llm.tokenizer.token_to_id("x")
    (out,) = llm.generate(
        ["Hi"], SamplingParams(max_tokens=8, banned_token_ids=(x,), constraint=Constraint("choice", '["x"]'))
    )
    assert out.finish_reason == FinishReason.ERROR and out.token_ids == []
    assert _whole(llm)


def test_a_compile_over_the_limit_ends_the_request_with_an_error(llm, monkeypatch):
    """A compile still running at the limit (one that never finishes: the limit's check, not the machine's speed)."""
    monkeypatch.setattr(llm.engine.structured.gate, "timeout_s", 0.05)
    monkeypatch.setattr(llm.engine.structured.grammars, "compile", lambda constraint: Future())
    constraint = Constraint("json_schema", _slow_schema("t"))
    (out,) = llm.generate(["Hi"], SamplingParams(max_tokens=4, constraint=constraint))
    assert out.finish_reason == FinishReason.ERROR and "to compile" in out.error
    assert _whole(llm)


def test_aborting_a_request_behind_the_gate_frees_it(llm):
    engine = llm.engine
    engine.add_request(
        "gone", llm.encode("Hi"), SamplingParams(max_tokens=4, constraint=Constraint("json_schema", _slow_schema("a")))
    )
    out = engine.abort("gone")
    assert out is not None and out.finish_reason == FinishReason.ABORT
    assert "gone" not in engine.structured.gate and not engine.has_unfinished() and _whole(llm)


def test_async_scheduling_gives_the_synchronous_outputs(llm):
    """With async scheduling each constrained step is read back before the next is planned (its mask needs the
    token): the outputs are the synchronous engine's, and valid."""
    both = LLM("tiny", max_num_seqs=16, async_scheduling=True)
    prompts = ["Hi", "Hello", "Say it"]
    params = [
        SamplingParams(seed=i, max_tokens=32, constraint=Constraint("regex", REGEX) if i != 1 else None)
        for i in range(3)
    ]
    sync, asynchronous = llm.generate(prompts, params), both.generate(prompts, params)
    assert [o.token_ids for o in asynchronous] == [o.token_ids for o in sync]
    for i in (0, 2):
        assert asynchronous[i].finish_reason == FinishReason.STOP and re.fullmatch(REGEX, asynchronous[i].text)
    assert _whole(both)


def test_batch_invariant_mode_gives_a_constrained_request_its_bits_alone_or_batched():
    bi = LLM("tiny", max_num_seqs=8, batch_invariant=True)
    constraint = Constraint("regex", REGEX)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=7, max_tokens=32, logprobs=2, constraint=constraint)
        (alone,) = bi.generate(["Hi"], params)
        batch = bi.generate(["Hello", "Hi", "Say"], [SamplingParams(seed=1, max_tokens=8), params, params])
        assert batch[1].token_ids == alone.token_ids and batch[1].logprobs == alone.logprobs
        assert alone.finish_reason == FinishReason.STOP and re.fullmatch(REGEX, alone.text)


def test_preemption_stops_a_constrained_request_even_in_recompute_mode():
    small = LLM(
        "tiny", block_size=4, num_blocks=9, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="recompute"
    )
    params = SamplingParams(temperature=0, max_tokens=8, constraint=Constraint("regex", "[ab]{30,40}"))
    outs = small.generate([[0, 5 + i, 6, 7, 8, 9] for i in range(3)], params)
    reasons = sorted(o.finish_reason for o in outs)
    assert "preempted" in reasons and set(reasons) <= {"preempted", "length"}
    for o in outs:
        assert re.fullmatch("[ab]*", o.text), o.text
    assert _whole(small)


def test_structured_output_with_forced_tokens_is_refused(llm):
    with pytest.raises(ValueError, match="forced_token_ids"):
        llm.engine.validate([0, 5], SamplingParams(constraint=Constraint("regex", "a"), forced_token_ids=(5,)))
    llm.engine.validate([0, 5], SamplingParams(forced_token_ids=(5,)))  # unconstrained requests are not affected


def test_forced_tokens_and_bad_constraints_are_refused_before_queueing(llm):
    with pytest.raises(ValueError, match="forced_token_ids"):
        llm.generate(["Hi"], SamplingParams(forced_token_ids=(5,), constraint=Constraint("regex", "a")))
    with pytest.raises(ValueError, match="regex"):
        llm.generate(["Hi", "Hi"], [SamplingParams(), SamplingParams(constraint=Constraint("regex", "[a-"))])
    assert not llm.engine.has_unfinished()
