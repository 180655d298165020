"""The penalties, min_tokens, min_p and n through the engine (the tiny model, batch-invariant mode): each token is
checked against the model's raw logits of its step (recorded at the sampler) under the parameter's formula,
written here independently of the sampler, and some token must differ from what the logits alone give, so a
dropped parameter fails. A request alone and in a batch gives the same bits; n = 4 prefills its prompt once."""

from __future__ import annotations

import math

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.request_checks import choice_id

pytestmark = pytest.mark.usefixtures("pools_checked_after_every_step")  # conftest.py


class Recording:
    """The worker's sampler, recording each step's raw logits and rows."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.steps: list[tuple[torch.Tensor, list]] = []

    def __call__(self, logits, rows, *counts):
        self.steps.append((logits.float().clone(), list(rows)))
        return self.sampler(logits, rows, *counts)


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny", block_size=16, max_num_batched_tokens=64, max_num_seqs=8, batch_invariant=True)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 129_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(llm, prompt, params) -> tuple[list, list[torch.Tensor]]:
    """Outputs and, per output token of the first request, the raw logits it was sampled from."""
    recording = Recording(llm.engine.worker.sampler)
    llm.engine.worker.sampler = recording
    try:
        outs = llm.generate([prompt], params)
    finally:
        llm.engine.worker.sampler = recording.sampler
    return outs, [logits[0] for logits, _ in recording.steps]


def _argmax(x: torch.Tensor) -> int:
    return int(torch.argmax(x))  # ties: the first (lowest) id, the sampler's rule


def _penalized(x: torch.Tensor, prompt: list[int], out: list[int], presence=0.0, frequency=0.0, repetition=1.0):
    """vLLM's penalties, token by token in float64 (penalty values at float32, as documented)."""
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731
    presence, frequency, repetition = f32(presence), f32(frequency), f32(repetition)
    y = x.double().clone()
    counts: dict[int, int] = {}
    for t in out:
        counts[t] = counts.get(t, 0) + 1
    for t in set(prompt) | set(counts):
        v = float(y[t])
        v = v / repetition if v > 0 else v * repetition
        y[t] = v
    for t, c in counts.items():
        y[t] = float(y[t]) - frequency * c - presence
    return y.float()


@pytest.mark.parametrize(
    ("penalty", "bites"),
    [
        (dict(presence=-2.0), True),
        (dict(presence=2.0), False),  # the random model's greedy output does not repeat: nothing to push away
        (dict(frequency=-1.5), True),
        (dict(frequency=-2.0, presence=1.0), True),
        (dict(repetition=0.3), True),
        (dict(repetition=1.8, frequency=0.5), False),
    ],
)
def test_greedy_tokens_follow_the_penalized_logits(llm, penalty, bites):
    """Every token is the argmax of its step's raw logits under the formula; where the penalty bites (it pulls
    earlier tokens back), some token differs from the raw argmax, so dropping the parameter fails the test."""
    prompt = _prompt(1, 21)
    names = {"presence": "presence_penalty", "frequency": "frequency_penalty", "repetition": "repetition_penalty"}
    params = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, **{names[k]: v for k, v in penalty.items()}
    )
    (out,), logits = _run(llm, prompt, params)
    assert len(out.token_ids) == 12 == len(logits)
    changed = 0
    for k, (token, x) in enumerate(zip(out.token_ids, logits)):
        assert token == _argmax(_penalized(x, prompt, out.token_ids[:k], **penalty)), k
        changed += token != _argmax(x)
    if bites:
        assert changed, "the penalty changed no token: the test cannot tell it from no penalty"


def test_a_penalized_request_alone_and_in_a_batch_gives_the_same_bits(llm):
    params = SamplingParams(
        max_tokens=10,
        temperature=0.9,
        seed=7,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        min_p=0.05,
        logprobs=3,
        ignore_eos=True,
    )
    prompt = _prompt(2, 30)
    (alone,) = llm.generate([prompt], params)
    others = [
        SamplingParams(max_tokens=8, temperature=1.0, seed=k, frequency_penalty=1.0, ignore_eos=True) for k in range(3)
    ]
    batch = llm.generate([_prompt(10, 17), prompt, _prompt(11, 40), _prompt(12, 5)], [others[0], params, *others[1:]])
    assert (batch[1].token_ids, batch[1].logprobs, batch[1].top_logprobs) == (
        alone.token_ids,
        alone.logprobs,
        alone.top_logprobs,
    )


def test_min_tokens_bans_the_end_and_stop_tokens_until_reached(llm):
    eos = llm.engine.eos_token_id
    prompt = _prompt(3, 12)
    stop = 4242
    bias = {eos: 100.0, stop: 90.0}  # the end token first, then the stop token, win every greedy step
    (early,) = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, logit_bias=bias))
    assert early.token_ids == [eos]
    params = SamplingParams(max_tokens=20, temperature=0.0, logit_bias=bias, stop_token_ids=(stop,), min_tokens=6)
    (late,) = llm.generate([prompt], params)
    assert len(late.token_ids) == 7 and late.token_ids[-1] == eos
    assert eos not in late.token_ids[:6] and stop not in late.token_ids[:6]


def test_min_p_keeps_exactly_the_tokens_above_its_share_of_the_top(llm):
    """min_p = 0.5 keeps a few to a few dozen tokens per step here: the top-20 logprobs show exactly which."""
    prompt = _prompt(4, 19)
    min_p, temperature = 0.5, 1.0
    params = SamplingParams(max_tokens=6, temperature=temperature, min_p=min_p, seed=3, logprobs=20, ignore_eos=True)
    (out,), logits = _run(llm, prompt, params)
    threshold = torch.tensor(math.log(min_p), dtype=torch.float32)
    small = 0
    for k, x in enumerate(logits):
        s = (x - x.max()) / torch.tensor(temperature, dtype=torch.float32)
        kept = set(torch.nonzero(s >= threshold).flatten().tolist())
        top = [t for t, _ in out.top_logprobs[k]]
        finite = {t for t, lp in out.top_logprobs[k] if lp > -math.inf}
        assert finite == kept & set(top), k
        assert out.token_ids[k] in kept
        small += len(kept) < 20
    assert small, "min_p dropped no token the top-20 logprobs show"


def test_n_choices_share_the_prompts_blocks_and_each_equals_its_seed_alone(llm):
    prompt = _prompt(5, 40)  # 39 prefix tokens: 2 full blocks of 16 and a partial one
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=4, logprobs=2, ignore_eos=True)
    engine = llm.engine
    free = engine.scheduler.stats().num_free_blocks
    engine.add_request("g", prompt, params)
    while "g" in engine.groups and engine.groups["g"][0] == choice_id("g", None):
        engine.step()
    members = engine.groups["g"]
    assert members == [choice_id("g", i) for i in range(4)]
    # The two full blocks are held once by the four choices (and once by the prefix cache, where it is on); each
    # has its own copy of the partial block.
    held = free - engine.scheduler.stats().num_free_blocks
    tables = [engine.scheduler.request(m).block_table for m in members]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert all(engine.scheduler.block_ref_count(b) == 4 + engine.prefix_cache_enabled for b in tables[0][:2])
    assert len({t[2] for t in tables}) == 4
    assert held == 2 + 4
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.index] = out
    assert sorted(outputs) == [0, 1, 2, 3] and all(o.request_id == "g" for o in outputs.values())
    for i, out in outputs.items():
        seed = params.choice_seed(11, i)
        (alone,) = llm.generate(
            [prompt], SamplingParams(max_tokens=5, temperature=1.0, seed=seed, logprobs=2, ignore_eos=True)
        )
        assert (out.token_ids, out.logprobs, out.top_logprobs) == (alone.token_ids, alone.logprobs, alone.top_logprobs)
    assert len({tuple(o.token_ids) for o in outputs.values()}) > 1  # distinct seed streams


def test_generate_returns_each_prompts_choices_in_order(llm):
    outs = llm.generate(
        [_prompt(6, 9), [5]], [SamplingParams(max_tokens=3, n=3, seed=1), SamplingParams(max_tokens=2, n=2, seed=2)]
    )
    assert [o.index for o in outs] == [0, 1, 2, 0, 1]
    assert all(len(o.token_ids) <= 3 for o in outs)


def test_penalties_under_async_scheduling_give_the_synchronous_tokens(llm):
    """Async scheduling plans step N + 1 before N's tokens are read: the token counts, updated on the device by
    step N, must hold N's token when N + 1 samples."""
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, frequency_penalty=-2.0, presence_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.0, seed=4, repetition_penalty=0.5, min_p=0.1, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=2, presence_penalty=-2.0, ignore_eos=True),
    ]
    prompts = [_prompt(20, 25), _prompt(21, 7), _prompt(22, 18)]
    engine = llm.engine
    try:
        engine.config = engine.config.replace(async_scheduling=True)
        asynchronous = llm.generate(prompts, params)
    finally:
        engine.config = engine.config.replace(async_scheduling=False)
    synchronous = llm.generate(prompts, params)
    assert [(o.token_ids, o.logprobs) for o in asynchronous] == [(o.token_ids, o.logprobs) for o in synchronous]


@pytest.mark.rest_of_context
def test_max_tokens_unset_runs_to_the_end_of_the_context():
    small = LLM(model="tiny", block_size=16, max_model_len=40, max_num_seqs=2)
    prompt = _prompt(7, 35)
    (out,) = small.generate([prompt], SamplingParams(temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


@pytest.mark.parametrize("n", [1, 3])
def test_prompt_logprobs_equal_the_full_forwards_log_softmax(llm, n):
    """The logprob of every prompt token after the first and the top-3 at its position, from chunked prefill
    (24-token chunks here), equal the full forward's log-softmax exactly (batch-invariant mode); with n = 3 the
    prefix computes them once and every choice carries them."""
    from model.batch_invariant import batch_invariant

    prompt = _prompt(8, 150)
    engine = llm.engine
    budget = engine.scheduler.config.max_num_batched_tokens
    assert budget < len(prompt)  # chunked
    outs = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3, n=n, seed=1, ignore_eos=True))
    with torch.no_grad(), batch_invariant():
        full = torch.log_softmax(llm.source.model(torch.tensor([prompt])).float(), dim=-1)[0]
    expected = [float(full[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]
    order = torch.sort(full, dim=-1, descending=True, stable=True).indices[:, :3]
    expected_top = [[(int(t), float(full[p, t])) for t in order[p]] for p in range(len(prompt) - 1)]
    assert len(outs) == n
    for out in outs:
        assert out.prompt_logprobs == expected
        assert out.prompt_top_logprobs == expected_top
        assert out.prompt_ranks == [int((full[p] >= full[p, prompt[p + 1]]).sum()) for p in range(len(prompt) - 1)]


def test_the_interpreted_kernel_sampler_gives_the_engine_the_cpu_samplers_tokens(llm):
    """The engine on the fused sampler kernel (interpreted on the CPU) with every parameter on: the CPU sampler's
    tokens, and logprobs within the kernel's fp32-softmax tolerance (tests/kernels/test_sampler.py's _check)."""
    from kernels.interpret import interpreter, load_interpreted
    from services.worker.sampling.kernel_sampler import KernelSampler

    kernel = KernelSampler(load_interpreted("sampler"))

    def interpreted(logits, rows, *counts):
        with interpreter():
            return kernel(logits, rows, *counts)

    eos = llm.engine.eos_token_id
    prompts = [_prompt(30, 20), _prompt(31, 9)]
    params = [
        SamplingParams(max_tokens=3, temperature=0.0, frequency_penalty=-2.0, presence_penalty=1.0, ignore_eos=True),
        SamplingParams(
            max_tokens=3, temperature=1.0, seed=9, n=2, min_p=0.3, repetition_penalty=1.5, min_tokens=2,
            logit_bias={eos: 30.0},
        ),
    ]  # fmt: skip
    expected = llm.generate(prompts, params)
    cpu = llm.engine.worker.sampler
    llm.engine.worker.sampler = interpreted
    try:
        got = llm.generate(prompts, params)
    finally:
        llm.engine.worker.sampler = cpu
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert expected[1].token_ids[2] == eos  # min_tokens held the end token back for two tokens
    for a, b in zip(got, expected):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
