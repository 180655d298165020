"""Prefix caching is exact (the batch-invariant mode, CPU): a multi-turn conversation resending its history and
an agent loop sharing a long system prompt give the same bits (tokens, logprobs: Python ``==``) with the cache on
as off, and the prefill tokens the engine computes are exactly what the snapshot policy says:

- turn k ≥ 2 resumes after turn k − 1's answer (the finish snapshot, after its computed positions): it computes
  its new tokens plus the answer's last token, whose KV the previous turn never wrote;
- request 2 of the agent loop finds the system prompt's blocks cached but no snapshot there: it computes all,
  cutting a chunk at the last cached block (where prompts diverged) and snapshotting there; from request 3 on
  only the suffix is computed, plus the system prompt's tokens after its last full block (less than a block).

The model: the oracle-draft tiny config (vocabulary 256, a DSpark draft), as the speculative tests use.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.model.deepseek_v41.oracle_configs import DRAFT_CASES

NEXTN = DRAFT_CASES[0].cfg.dspark_block_size
BLOCK = 16
ENGINE = dict(device="cpu", batch_invariant=True, max_model_len=2400, block_size=BLOCK, max_num_seqs=4)
ANSWER = 6  # output tokens per turn

pytestmark = pytest.mark.usefixtures("pools_checked_after_every_step")  # conftest.py


@pytest.fixture(scope="module")
def source(draft_source):
    return draft_source


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _answer(out) -> tuple:
    return out.token_ids, out.logprobs, out.top_logprobs, out.finish_reason


def _params(k: int, seeded: bool) -> SamplingParams:
    if seeded:
        return SamplingParams(max_tokens=ANSWER, temperature=1.0, top_p=0.9, logprobs=3, seed=70 + k, ignore_eos=True)
    return SamplingParams(max_tokens=ANSWER, temperature=0.0, logprobs=2, ignore_eos=True)


def conversation(source, seeded: bool, num_turns: int = 5, **engine_args) -> tuple[list[tuple], list[int], list[int]]:
    """Turns each resending the history: (answers, prefill tokens computed per turn, cached tokens per turn)."""
    llm = LLM(source=source, **{**ENGINE, **engine_args})
    history: list[int] = [0]
    answers, computed, cached = [], [], []
    for turn in range(num_turns):
        history = history + _tokens(turn, 37 + 11 * turn)  # the user's turn
        before = llm.engine.scheduler.stats().num_prefill_tokens
        out = llm.generate(history, _params(turn, seeded))[0]
        computed.append(llm.engine.scheduler.stats().num_prefill_tokens - before)
        cached.append(out.num_cached_tokens)
        answers.append(_answer(out))
        history = history + out.token_ids
    return answers, computed, cached


def agents(source, seeded: bool, system_len: int, **engine_args) -> tuple[list[tuple], list[int]]:
    """Three requests sharing a system prompt, each with its own 40-token suffix: (answers, computed tokens)."""
    llm = LLM(source=source, **{**ENGINE, **engine_args})
    system = [0, *_tokens(100, system_len - 1)]
    answers, computed = [], []
    for k in range(3):
        before = llm.engine.scheduler.stats().num_prefill_tokens
        out = llm.generate(system + _tokens(200 + k, 40), _params(k, seeded))[0]
        computed.append(llm.engine.scheduler.stats().num_prefill_tokens - before)
        answers.append(_answer(out))
    return answers, computed


def _turn_lengths() -> list[int]:
    lengths, total = [], 1
    for turn in range(5):
        total += 37 + 11 * turn
        lengths.append(total)
        total += ANSWER
    return lengths


@pytest.mark.parametrize("seeded", [False, True])
def test_a_conversation_gives_the_same_bits_and_computes_only_new_tokens(source, seeded):
    off, computed_off, _ = conversation(source, seeded, enable_prefix_caching=False)
    on, computed_on, cached = conversation(source, seeded)
    assert on == off
    prompts = _turn_lengths()
    assert computed_off == prompts
    # Turn k resumes after turn k − 1's computed positions: its prompt minus (new tokens + the answer's last token).
    new = [37 + 11 * turn for turn in range(5)]
    assert computed_on == [prompts[0]] + [n + 1 for n in new[1:]]
    assert cached == [0] + [prompts[k] - new[k] - 1 for k in range(1, 5)]


OPENING = [1, 2]  # the assistant turn's opening: in each prompt, left out when the history is re-rendered


def rerendered_chat(source, **engine_args) -> tuple[list[tuple], list[int], list[int]]:
    """A chat whose history re-renders differently: each prompt ends with the assistant's opening, which the next
    turn's history leaves out before the answer (as chat formats that drop it do): (answers, prompt lengths,
    prefill tokens computed per turn)."""
    llm = LLM(source=source, **{**ENGINE, **engine_args})
    history: list[int] = [0]
    answers, lengths, computed = [], [], []
    for turn in range(4):
        history = history + _tokens(400 + turn, 37 + 11 * turn)
        prompt = history + OPENING
        before = llm.engine.scheduler.stats().num_prefill_tokens
        out = llm.generate(prompt, _params(turn, False))[0]
        computed.append(llm.engine.scheduler.stats().num_prefill_tokens - before)
        answers.append(_answer(out))
        lengths.append(len(prompt))
        history = history + out.token_ids
    return answers, lengths, computed


def test_a_rerendered_chat_resumes_at_the_previous_prompts_last_full_block(source):
    """No turn's prompt is a prefix of the next (the opening differs), so no finish or prompt-end snapshot serves.
    Turn 1 shares nothing with earlier prompts: it is not cut at its last full block (that would cost a step), so
    turn 2 computes all of its prompt, cutting where it diverged from turn 1 and at its own last full block (it
    is resent traffic). From turn 3 on a turn resumes at the previous prompt's last full block."""
    off, lengths, computed_off = rerendered_chat(source, enable_prefix_caching=False)
    on, _, computed_on = rerendered_chat(source)
    assert on == off
    assert computed_off == lengths
    last_full_block = [(n - 1) // BLOCK * BLOCK for n in lengths]
    assert all(b <= n - len(OPENING) for b, n in zip(last_full_block, lengths))  # before each turn's opening
    assert computed_on == lengths[:2] + [lengths[k] - last_full_block[k - 1] for k in (2, 3)]


@pytest.mark.slow
def test_an_agent_loop_computes_only_the_suffix_from_the_third_request(source):
    """A 2,009-token system prompt (its last full block ends at 2,000): from the third request on, its last 9
    tokens and the 40-token suffix are computed (within one block of the suffix)."""
    off, computed_off = agents(source, True, 2009, enable_prefix_caching=False, max_num_batched_tokens=512)
    on, computed_on = agents(source, True, 2009, max_num_batched_tokens=512)
    assert on == off
    assert computed_off == [2049] * 3
    assert computed_on == [2049, 2049, 49]


@pytest.mark.parametrize("seeded", [False, True])
def test_agents_queued_together_compute_the_system_prompt_once(source, seeded):
    """Four prompts sharing a 160-token system prompt (10 full blocks), each with its own 40-token suffix, queued in
    one call: the first computes the system prompt and snapshots where the others diverge from it (160) while they
    wait; then each computes only its suffix (scheduler_rs/src/scheduler/shared_prefill.rs)."""
    system = [0, *_tokens(300, 159)]
    prompts = [system + _tokens(310 + k, 40) for k in range(4)]
    params = [_params(k, seeded) for k in range(4)]
    answers, computed = [], []
    for caching in (False, True):
        llm = LLM(source=source, **ENGINE, enable_prefix_caching=caching)
        answers.append([_answer(out) for out in llm.generate(prompts, params)])
        computed.append(llm.engine.scheduler.stats().num_prefill_tokens)
    assert answers[1] == answers[0]
    assert computed == [4 * 200, 160 + 4 * 40]


def choice_groups(source, seeded: bool, **engine_args) -> tuple[list[list[tuple]], list[int], list[int]]:
    """Three n = 3 requests sharing a 71-token system prompt, each with its own 5-token suffix, while a long
    request decodes beside them (so their prompts run in mixed steps, which async scheduling keeps in flight):
    (each group's answers by index, prefill tokens computed per group, each group's cached tokens)."""
    llm = LLM(source=source, **{**ENGINE, "max_num_seqs": 8, **engine_args})
    engine = llm.engine
    system = [0, *_tokens(300, 70)]
    engine.add_request("beside", _tokens(301, 20), SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    answers, computed, cached = [], [], []
    for k in range(3):
        params = dataclasses.replace(_params(k, seeded), n=3)
        before = engine.scheduler.stats().num_prefill_tokens
        engine.add_request(f"g{k}", system + _tokens(310 + k, 5), params)
        finals = {}
        while engine.is_live(f"g{k}"):
            for out in engine.step():
                if out.request_id == f"g{k}" and out.finish_reason is not None:
                    finals[out.index] = out
        computed.append(engine.scheduler.stats().num_prefill_tokens - before)
        answers.append([_answer(finals[i]) for i in range(3)])
        cached.append({finals[i].num_cached_tokens for i in range(3)})
    engine.abort("beside")
    return answers, computed, cached


@pytest.mark.parametrize(
    "seeded, async_scheduling, nextn", [(False, False, 0), (True, False, 0), (True, True, 0), (True, True, NEXTN)]
)
def test_n_choices_share_the_cached_prefix_with_the_same_bits(source, seeded, async_scheduling, nextn):
    """n > 1: the group's prefix (the prompt but its last token) resumes from the cache and the choices fork from
    it. Group 1 computes its 75-token prefix and each choice the prompt's last token; group 2 finds the system
    prompt's four full blocks cached but no snapshot there (group 1 shared nothing, so it was not cut at its last
    full block): it computes all, cutting where they diverged (64); group 3 resumes there and computes 11 + 3.
    Async scheduling reads back the step that samples a prefix's row at once (the fork needs no step of it in
    flight), with the long request decoding in the same mixed steps; also with drafts (seeded, deterministic)."""
    args = dict(async_scheduling=async_scheduling)
    if nextn:
        args.update(num_speculative_tokens=nextn, spec_sampling="deterministic")
    off, computed_off, _ = choice_groups(source, seeded, enable_prefix_caching=False, **args)
    on, computed_on, cached = choice_groups(source, seeded, **args)
    assert on == off
    if seeded:
        assert all(len({tuple(a[0]) for a in group}) > 1 for group in on)  # the choices draw their own streams
    assert computed_off == [75 + 3] * 3
    assert computed_on == [75 + 3, 75 + 3, 11 + 3]
    assert cached == [{0}, {0}, {64}]


SPEC_CASES = [("rejection", False, False), ("deterministic", True, False), ("deterministic", True, True)]


@pytest.mark.parametrize("spec_sampling, seeded, async_scheduling", SPEC_CASES)
def test_speculative_decoding_gives_the_same_bits(source, spec_sampling, seeded, async_scheduling):
    """Greedy in both acceptance modes and seeded in the deterministic one, synchronous and async: the draft's
    rings are in the snapshot. With drafts and async scheduling a finished request's next step is already in
    flight when it ends and has written the draft's ring past its end, so there is no finish snapshot: the next
    turn resumes at the previous prompt's end and recomputes the answer too."""
    spec = dict(num_speculative_tokens=NEXTN, spec_sampling=spec_sampling, async_scheduling=async_scheduling)
    off, _, _ = conversation(source, seeded, 3, enable_prefix_caching=False, **spec)
    on, computed, cached = conversation(source, seeded, 3, **spec)
    assert on == off
    prompts = _turn_lengths()[:3]
    assert computed == [p - c for p, c in zip(prompts, cached)]
    # Synchronous: turn k resumes after turn k − 1's computed positions: the answer but its last token, or all of
    # it where that token was a verified draft (its row computed it). Async: at turn k − 1's prompt end.
    ends = [prompts[k - 1] + ANSWER for k in range(1, 3)]
    assert cached[0] == 0
    if async_scheduling:
        assert cached[1:] == prompts[:2]
    else:
        assert all(e - 1 <= c <= e for c, e in zip(cached[1:], ends)), (cached, ends)
    off, _ = agents(source, seeded, 201, enable_prefix_caching=False, **spec)
    on, computed = agents(source, seeded, 201, **spec)
    assert on == off
    assert computed == [241, 241, 49]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nextn", [0, NEXTN], ids=["plain", "drafts"])
def test_gpu_kernel_path_with_cuda_graphs_gives_the_same_bits(source, nextn):
    """The FP8 kernel backend with the CUDA defaults (CUDA graphs for decode steps, async scheduling),
    batch-invariant: a conversation and an agent loop give the same bits with the cache on as off, seeded without
    drafts, greedy and seeded (deterministic) with them; the computed prefill tokens follow the policy."""
    from services.engine.model_source import load_model

    cuda = dict(device="cuda", kernel_backend="fp8", cuda_graphs=True, async_scheduling=True, num_blocks=512)
    if nextn:
        cuda.update(num_speculative_tokens=nextn, spec_sampling="deterministic")
    model = load_model(source.name, device="cuda")
    for seeded in [True] if not nextn else [False, True]:
        off, _, _ = conversation(model, seeded, 3, enable_prefix_caching=False, **cuda)
        on, computed, cached = conversation(model, seeded, 3, **cuda)
        assert on == off
        prompts = _turn_lengths()[:3]
        assert computed == [p - c for p, c in zip(prompts, cached)]
        # Async: turn k resumes after turn k − 1's answer but its last token (or, with drafts, at its prompt's end).
        assert cached[1:] == (prompts[:2] if nextn else [p + ANSWER - 1 for p in prompts[:2]])
        off, _ = agents(model, seeded, 501, enable_prefix_caching=False, **cuda)
        on, computed = agents(model, seeded, 501, **cuda)
        assert on == off
        assert computed == [541, 541, 45]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_n_choices_share_the_cached_prefix_with_the_same_bits(source):
    """n > 1 on the FP8 kernel backend with CUDA graphs and async scheduling, batch-invariant: the groups beside a
    decoding request give the same bits with the cache on as off, and compute what the CPU test says."""
    from services.engine.model_source import load_model

    cuda = dict(device="cuda", kernel_backend="fp8", cuda_graphs=True, async_scheduling=True, num_blocks=512)
    model = load_model(source.name, device="cuda")
    off, computed_off, _ = choice_groups(model, True, enable_prefix_caching=False, **cuda)
    on, computed_on, cached = choice_groups(model, True, **cuda)
    assert on == off
    assert computed_off == [75 + 3] * 3
    assert computed_on == [75 + 3, 75 + 3, 11 + 3]
    assert cached == [{0}, {0}, {64}]


@pytest.mark.parametrize("how", ["a failed step", "a worker that lost its pools"])
def test_nothing_resumes_from_a_worker_memory_that_may_be_gone(source, how):
    """A failed step (its planned snapshot may never have been saved) and a worker process restarted between
    steps (its pools came back empty) both drop the cache: the same prompt again computes every token."""
    llm = LLM(source=source, **ENGINE)
    prompt = [0, *_tokens(9, 60)]
    assert llm.generate(prompt, _params(0, False))[0].num_cached_tokens == 0
    if how == "a failed step":
        execute = llm.engine.worker.execute

        def failing(*args, **kwargs):
            raise RuntimeError("the worker failed the step")

        llm.engine.worker.execute = failing
        with pytest.raises(RuntimeError):
            llm.generate([1, *_tokens(10, 20)], _params(0, False))
        llm.engine.worker.execute = execute
        llm.engine.abort(next(iter(llm.engine.requests)))  # the request the failed step left behind
    else:
        llm.engine.worker.num_losses = 1  # as RemoteWorker counts a restarted worker's failed checks
    again = llm.generate(prompt, _params(0, False))[0]
    assert again.num_cached_tokens == 0
    longer = prompt + _tokens(11, 5)  # cached again from then on: it resumes at the prompt's end
    assert llm.generate(longer, _params(0, False))[0].num_cached_tokens == len(prompt)
