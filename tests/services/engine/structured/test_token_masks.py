"""The token bitmask with speculative decoding: each draft row is masked from the grammar's state after the drafts
before it, so every emitted token obeys the grammar; greedy constrained tokens and logprobs with drafts equal those
without (both acceptance modes), and seeded ones in the deterministic mode do not depend on the drafts or the
batch. The model, harness and draft rewriting are the speculator tests' (vocabulary 256, batch-invariant mode)."""

from __future__ import annotations

import re

import pytest
import torch

from services.engine import SamplingParams
from services.engine.structured.constraint import Constraint
from services.engine.structured.grammars import GrammarCompiler
from services.engine.structured.token_masks import fill_rows
from tests.services.worker.spec.test_speculator import (  # noqa: F401
    NEXTN,
    PROMPTS,
    generate,
    known_drafts,
    line,
    source,
)

pytestmark = pytest.mark.timeout(300)

PATTERN = "(the|cat|sat|on|mat|dog){3,8}"  # whole words of the toy vocabulary: no dead end
CONSTRAINT = Constraint("regex", PATTERN)
MAX_TOKENS = 12  # eight words and the end token fit


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, constraint=CONSTRAINT)


def _seeded() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=300 + i, constraint=CONSTRAINT)
        for i in range(len(PROMPTS))
    ]


def _check_valid(source, outs) -> None:  # noqa: F811
    vocab = {i: t for t, i in source.tokenizer.get_vocab().items()}
    for out in outs:
        assert out.finish_reason == "stop", (out.finish_reason, out.error)
        words = [vocab[t] for t in out.token_ids if t != source.config.eos_token_id]
        assert re.fullmatch(PATTERN, "".join(words)), words


@pytest.fixture(scope="module")
def greedy_off(source):  # noqa: F811
    outs, _ = generate(source, _greedy())
    _check_valid(source, outs)
    return outs


@pytest.mark.parametrize("schedule", ["fixed", "varlen", "async"])
@pytest.mark.parametrize("mode", ["rejection", "deterministic"])
def test_greedy_constrained_tokens_with_drafts_equal_those_without(source, greedy_off, mode, schedule):  # noqa: F811
    """Fixed drafts, varlen verification (some requests verify fewer), and async scheduling with varlen."""
    reference = [o.token_ids for o in greedy_off]
    rows: list[int] = []
    outs, spec = generate(
        source,
        _greedy(),
        nextn=NEXTN,
        spec_sampling=mode,
        rewrite=known_drafts(reference),
        curve=line(1.0, 0.02) if schedule != "fixed" else None,
        decode_rows=rows if schedule != "async" else None,
        async_scheduling=schedule == "async",
    )
    assert [o.token_ids for o in outs] == reference
    assert [o.logprobs for o in outs] == [o.logprobs for o in greedy_off]
    assert 0 < spec.num_drafts_accepted < spec.num_drafts_verified  # drafts passed and failed under the mask
    if schedule == "varlen":
        assert len(set(rows)) > 1 and max(rows) > 1, rows
    _check_valid(source, outs)


def test_deterministic_seeded_constrained_tokens_do_not_depend_on_drafts_or_batch(source):  # noqa: F811
    params = _seeded()
    base, _ = generate(source, params, nextn=1, spec_sampling="deterministic")  # the model's own draft
    _check_valid(source, base)
    tokens = [o.token_ids for o in base]
    known, spec = generate(source, params, nextn=NEXTN, spec_sampling="deterministic", rewrite=known_drafts(tokens))
    assert [o.token_ids for o in known] == tokens
    assert 0 < spec.num_drafts_accepted < spec.num_drafts_verified
    alone, _ = generate(source, [params[1]], prompts=[PROMPTS[1]], nextn=NEXTN, spec_sampling="deterministic")
    assert alone[0].token_ids == tokens[1]


def test_rejection_sampling_under_a_mask_gives_valid_output(source):  # noqa: F811
    outs, spec = generate(source, _seeded(), nextn=NEXTN, spec_sampling="rejection")
    _check_valid(source, outs)
    assert spec.num_drafts_verified > 0


def test_draft_rows_are_masked_after_the_drafts_before_them(source):  # noqa: F811
    """Row j: the grammar after drafts 1..j; a refused draft leaves the rows after it all-allowed; the matcher
    ends where it began."""
    vocab = source.tokenizer.get_vocab()
    grammars = GrammarCompiler(source.tokenizer, source.config.vocab_size, source.config.eos_token_id)
    compiled = grammars.compile(Constraint("regex", "the(cat|dog)sat")).result()
    matcher = grammars.matcher(compiled)

    def allowed(mask, row):
        return {t for t, i in vocab.items() if (int(mask[row, i // 32]) >> (i % 32)) & 1}

    mask = grammars.bitmask(4)
    fill_rows(matcher, mask, 0, [vocab["the"], vocab["dog"], vocab["on"]])  # "on" is refused
    assert allowed(mask, 0) == {"the"} and allowed(mask, 1) == {"cat", "dog"} and allowed(mask, 2) == {"sat"}
    assert torch.equal(mask[3], grammars.bitmask(1)[0])  # after the refused draft: all allowed
    fresh = grammars.bitmask(1)
    matcher.fill_next_token_bitmask(fresh, 0)
    assert allowed(fresh, 0) == {"the"}  # rolled back


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("mode", ["rejection", "deterministic"])
def test_constrained_speculation_on_the_gpu_gives_valid_output(source, backend, mode):  # noqa: F811
    """On CUDA (the torch model, or the kernel backend with its graphs and static verify): constrained requests
    with drafts, greedy and seeded, stop and match the grammar, and the pools come back whole."""
    from services.engine import LLM
    from services.engine.model_source import load_model

    gpu = load_model(source.name, device="cuda")
    args = dict(device="cuda", max_model_len=96, block_size=8, max_num_seqs=8, num_blocks=64)
    if backend == "torch":
        args.update(kernel_backend=None, cuda_graphs=False, async_scheduling=False)
    llm = LLM(source=gpu, **args, num_speculative_tokens=NEXTN, spec_sampling=mode)
    _check_valid(source, llm.generate(PROMPTS, _greedy()))
    _check_valid(source, llm.generate(PROMPTS, _seeded()))
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks
    assert llm.engine.worker.speculator.num_drafts_verified > 0
