"""Speculative decoding through the engine on the CPU cached path (batch-invariant mode): greedy tokens
and logprobs with drafts equal those without, in both sampling modes; the deterministic mode's seeded
tokens do not depend on how many drafts are verified, on which drafts, or on the batch.

The model: the oracle-draft tiny config (vocabulary 256, so a step takes milliseconds). Its random
draft accepts almost nothing, so most runs rewrite the drafts to the reference continuation with every
third token wrong: acceptance, partial acceptance and rejection all happen (the counters say so).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from services.engine import LLM, SamplingParams
from services.worker.runners.model_runner import ModelRunner
from services.worker.spec.speculator import Speculator
from services.worker.worker import Worker
from tests.model.deepseek_v41.oracle_configs import DRAFT_CASES, finish
from tests.model.deepseek_v41.oracle_harness import toy_tokenizer

CASE = DRAFT_CASES[0]
NEXTN = CASE.cfg.dspark_block_size
ENGINE = dict(device="cpu", batch_invariant=True, max_model_len=96, block_size=8, max_num_seqs=8)
PROMPTS = [[0, *range(3, 3 + n)] for n in (5, 13, 2)]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from model.deepseek_v41.init import write_random_checkpoint
    from model.deepseek_v41.tokenizer import engram_token_map
    from services.engine.model_source import load_model

    tok = toy_tokenizer(CASE.cfg.vocab_size)
    cfg = finish(CASE.cfg, engram_token_map(tok)[1])
    path = write_random_checkpoint(tmp_path_factory.mktemp("spec") / "ckpt", cfg, CASE.seed, tok)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(str(path))
    torch.set_num_threads(threads)


def generate(
    source,
    params,
    prompts=PROMPTS,
    nextn=0,
    spec_sampling="rejection",
    rewrite=None,
    curve=None,
    decode_rows=None,
    static_proposal=False,
    **engine_args,
):
    """(outputs, speculator or None). ``curve``: varlen on, with this step-cost curve (rows → ms);
    ``decode_rows``: a list that gets every decode request's rows per step (``plan.seqlens_q``);
    ``static_proposal``: the draft proposes through the static proposal (what a CUDA graph captures), eagerly."""
    if not nextn:
        return LLM(source=source, **ENGINE, **engine_args).generate(prompts, params), None
    llm_args = dict(ENGINE, num_speculative_tokens=nextn, spec_sampling=spec_sampling, **engine_args)
    if curve is not None:
        llm_args.update(spec_varlen=True, spec_step_cost_ms=tuple(curve.items()))
    probe = LLM(source=source, **llm_args)  # only for its resolved worker config
    runner = ModelRunner(source.model, probe.config.worker_config(), nextn=nextn, with_taps=True)
    speculator = Speculator(
        source.model,
        nextn,
        spec_sampling,
        rewrite,
        batch_invariant=ENGINE["batch_invariant"],
        static_proposal=static_proposal,
    )
    worker = Worker(runner, speculator=speculator)
    if decode_rows is not None:
        execute = worker.execute

        def recording(plan, rows, previous=None, **extra):
            if not plan.is_prefill:  # the decode requests' rows (a mixed step's prompt chunks follow them)
                decode_rows.extend(plan.seqlens_q.tolist()[: plan.num_decode_requests])
            return execute(plan, rows, previous, **extra)

        worker.execute = recording
    llm = LLM(source=source, worker=worker, **llm_args)
    return llm.generate(prompts, params), speculator


def line(fixed_ms: float, per_row_ms: float, max_rows: int = 16 * (1 + NEXTN)) -> dict[int, float]:
    """A step-cost curve over every row count: fixed_ms + per_row_ms · rows."""
    return {rows: fixed_ms + per_row_ms * rows for rows in range(1, max_rows + 1)}


# Varlen curves. STEEP: a draft is worth its row only when its confidence beats about 0.1 ms × the batch's
# tokens per ms, so most requests verify few drafts or none; FLAT: rows are almost free, so nearly every
# draft is verified. The perturbed-curve test runs both.
STEEP, FLAT = line(1.0, 0.1), line(10.0, 0.001)


def known_drafts(reference, prompts=PROMPTS):
    """Drafts = the reference continuation, every third one wrong. Request ids are "0", "1", … in prompt order."""

    def rewrite(request_id: str, anchor: int, drafts: list[int]) -> list[int]:
        i = int(request_id)
        out = reference[i]
        first = anchor + 1 - len(prompts[i])  # output index of the token at anchor + 1
        proposal = []
        for j, d in enumerate(drafts):
            k = first + j
            token = out[k] if 0 <= k < len(out) else d
            proposal.append((token + 1) % 256 if (anchor + j) % 3 == 0 else token)
        return proposal

    return rewrite


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_off(source):
    return generate(source, GREEDY)[0]


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("mode", ["rejection", "deterministic"])
def test_greedy_tokens_with_speculation_equal_tokens_without(source, greedy_off, mode, varlen):
    reference = [o.token_ids for o in greedy_off]
    rows: list[int] = []
    outs, spec = generate(
        source,
        GREEDY,
        nextn=NEXTN,
        spec_sampling=mode,
        rewrite=known_drafts(reference),
        curve=line(1.0, 0.02) if varlen else None,
        decode_rows=rows,
    )
    assert [o.token_ids for o in outs] == reference
    assert [o.logprobs for o in outs] == [o.logprobs for o in greedy_off]
    # Acceptance happened, and so did rejection: both paths ran.
    assert 0 < spec.num_drafts_accepted < spec.num_drafts_verified
    if varlen:  # varlen really chose: some requests verified fewer drafts than others
        assert len(set(rows)) > 1 and max(rows) > 1, rows
    else:
        assert set(rows) == {1 + NEXTN}
    print(
        f"\n{mode} {'varlen' if varlen else 'fixed'}: accepted {spec.num_drafts_accepted} of "
        f"{spec.num_drafts_verified} drafts; rows per request and step {sorted(set(rows))}"
    )


def test_deterministic_seeded_tokens_do_not_depend_on_drafts_or_batch(source):
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=100 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    base, _ = generate(source, params, nextn=1, spec_sampling="deterministic")  # the model's own draft
    tokens = [o.token_ids for o in base]
    known, spec = generate(source, params, nextn=NEXTN, spec_sampling="deterministic", rewrite=known_drafts(tokens))
    assert [o.token_ids for o in known] == tokens
    assert 0 < spec.num_drafts_accepted < spec.num_drafts_verified
    order = [2, 0, 1]  # another batch order, 3 drafts each
    prompts = [PROMPTS[i] for i in order]
    shuffled, _ = generate(
        source,
        [params[i] for i in order],
        prompts=prompts,
        nextn=3,
        spec_sampling="deterministic",
        rewrite=known_drafts([tokens[i] for i in order], prompts),
    )
    assert [o.token_ids for o in shuffled] == [tokens[i] for i in order]
    alone, _ = generate(source, [params[1]], prompts=[PROMPTS[1]], nextn=NEXTN, spec_sampling="deterministic")
    assert alone[0].token_ids == tokens[1]


BATCH = [[0, *range(3 + i, 5 + i + (5 * i) % 13)] for i in range(16)]  # 16 prompts of 3 to 15 tokens


def test_deterministic_seeded_tokens_with_varlen_do_not_depend_on_batch_order_or_cost_curve(source):
    """The seeded, deterministic mode's guarantee, on the CPU, async off (async on, against these
    synchronous tokens: ``test_async_scheduling_with_drafts_gives_the_same_tokens``): with varlen on, a seeded
    request's tokens are the same alone, in a batch of 16 in three orders, and under a perturbed cost curve,
    while varlen verifies different drafts in each. The known drafts (the tokens of the first run, every third
    one wrong) make acceptance happen."""
    params = [SamplingParams(max_tokens=8, temperature=0.9, seed=500 + i, ignore_eos=True) for i in range(16)]
    run = dict(nextn=NEXTN, spec_sampling="deterministic", max_num_seqs=16)
    base_rows: list[int] = []
    base, _ = generate(source, params, prompts=BATCH, curve=STEEP, decode_rows=base_rows, **run)
    tokens = [o.token_ids for o in base]
    assert len({tuple(t) for t in tokens}) == 16
    seen_rows = {tuple(base_rows)}
    # Three orders (the first also under the perturbed, flat curve), with known drafts: acceptance happens.
    orders = (list(range(16)), list(range(15, -1, -1)), [(5 * i + 3) % 16 for i in range(16)])
    for order, curve in zip(orders, (FLAT, STEEP, STEEP)):
        prompts = [BATCH[i] for i in order]
        rows: list[int] = []
        outs, spec = generate(
            source,
            [params[i] for i in order],
            prompts=prompts,
            curve=curve,
            decode_rows=rows,
            rewrite=known_drafts([tokens[i] for i in order], prompts),
            **run,
        )
        assert [o.token_ids for o in outs] == [tokens[i] for i in order]
        assert 0 < spec.num_drafts_accepted < spec.num_drafts_verified
        seen_rows.add(tuple(rows))
        if curve is FLAT:
            flat_rows = rows
    alone, _ = generate(source, [params[7]], prompts=[BATCH[7]], curve=STEEP, **run)
    assert alone[0].token_ids == tokens[7]
    # Varlen chose differently across the runs, and the flat curve verified more drafts than the steep one.
    assert len(seen_rows) > 2
    assert sum(flat_rows) / len(flat_rows) > sum(base_rows) / len(base_rows) + 1
    print(
        f"\nmean rows per request and step: steep {sum(base_rows) / len(base_rows):.2f}, "
        f"flat {sum(flat_rows) / len(flat_rows):.2f}"
    )


@pytest.mark.parametrize("mode", ["rejection", "deterministic"])
def test_async_scheduling_with_drafts_gives_the_same_tokens(source, greedy_off, mode):
    """Async scheduling with drafts (the seqlen fix-up: step N+1 is planned counting N's rows as accepted; the
    worker moves N+1's rows down by N's rejected rows and feeds N's new drafts in). Fixed and varlen, the
    tokens equal the synchronous run's: greedy (both modes) equals speculation off, and seeded deterministic
    tokens equal the synchronous varlen run's. A wrong fix-up would also trip the speculator's check that the
    draft context continues exactly at each step's first row."""
    reference = [o.token_ids for o in greedy_off]
    for curve in (None, line(1.0, 0.02)):
        outs, spec = generate(
            source,
            GREEDY,
            nextn=NEXTN,
            spec_sampling=mode,
            rewrite=known_drafts(reference),
            curve=curve,
            async_scheduling=True,
        )
        assert [o.token_ids for o in outs] == reference
        assert [o.logprobs for o in outs] == [o.logprobs for o in greedy_off]
        assert 0 < spec.num_drafts_accepted < spec.num_drafts_verified
    if mode == "deterministic":
        params = [
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=300 + i, ignore_eos=True)
            for i in range(len(PROMPTS))
        ]
        sync, _ = generate(source, params, nextn=NEXTN, spec_sampling=mode, curve=STEEP)
        tokens = [o.token_ids for o in sync]
        outs, spec = generate(
            source,
            params,
            nextn=NEXTN,
            spec_sampling=mode,
            curve=FLAT,
            rewrite=known_drafts(tokens),
            async_scheduling=True,
        )
        assert [o.token_ids for o in outs] == tokens
        assert 0 < spec.num_drafts_accepted < spec.num_drafts_verified


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_varlen_with_the_measured_curve_runs_and_returns_every_block(source, async_scheduling):
    """No curve given: the engine measures its decode steps (services/engine/step_cost.py; under async scheduling
    the interval between consecutive decode steps' read-backs) and varlen uses the fit; every request finishes
    and the pools come back."""
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=40 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    llm = LLM(
        source=source,
        **dict(ENGINE, batch_invariant=False),
        num_speculative_tokens=NEXTN,
        spec_sampling="deterministic",
        spec_varlen=True,
        async_scheduling=async_scheduling,
    )
    llm.engine.step_cost.refit_interval = 2  # a fit within the run's few decode steps
    outs = llm.generate(PROMPTS, params)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    # Measured: two or more graph sizes timed for the batch's request bucket (the curve may pool to one value on a
    # loaded machine, so its values need not differ).
    meter = llm.engine.step_cost
    assert meter.num_steps > 0 and meter.measured(len(PROMPTS))
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks and stats.free_state_slots == stats.total_state_slots


def test_rejection_mode_seeded_tokens_do_not_depend_on_the_batch(source):
    """Rejection sampling reads the draft's distributions (the coin and the residual), so the draft runs in
    the batch-invariant mode too: a request gives the same tokens alone and in a batch."""
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7 + i, ignore_eos=True) for i in range(len(PROMPTS))
    ]
    batch, spec = generate(source, params, nextn=NEXTN)
    alone, _ = generate(source, [params[1]], prompts=[PROMPTS[1]], nextn=NEXTN)
    assert alone[0].token_ids == batch[1].token_ids and alone[0].logprobs == batch[1].logprobs
    assert spec.num_drafts_verified > 0


@pytest.mark.parametrize("mode", ["rejection", "deterministic"])
def test_the_static_proposal_gives_the_eager_proposals_seeded_tokens(source, mode):
    """The static proposal (bucketed, padded: services/worker/spec/static_draft_proposal.py) in the engine loop, with
    the model's own drafts and seeded sampling (rejection reads the draft's distributions): the same tokens and
    logprobs as the eager proposal, with varlen choosing per request, so its drafts and confidences agree too."""
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7 + i, ignore_eos=True) for i in range(len(PROMPTS))
    ]
    curve = line(1.0, 0.02)
    want, _ = generate(source, params, nextn=NEXTN, spec_sampling=mode, curve=curve)
    got, spec = generate(source, params, nextn=NEXTN, spec_sampling=mode, curve=curve, static_proposal=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    assert spec.draft_graphs is not None and len(spec.draft_graphs.static) > 0 and spec.num_drafts_verified > 0


SPECULATIVE_FILES = (
    "speculator.py",
    "verifier.py",
    "draft_proposal.py",
    "static_draft_proposal.py",
    "accepted_context.py",
)


class DeviceReads(TorchFunctionMode):
    """Host reads of tensors (a sync each on CUDA) made by the speculative step's own code, by call site."""

    NAMES = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu"}

    def __init__(self):
        super().__init__()
        self.reads = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            frame = sys._getframe(1)
            while frame is not None and (
                "/torch/" in frame.f_code.co_filename or frame.f_code.co_filename.endswith("batch_invariant.py")
            ):
                frame = frame.f_back
            name = Path(frame.f_code.co_filename).name if frame is not None else ""
            if name in SPECULATIVE_FILES:
                self.reads[f"{func.__name__} @ {name}:{frame.f_lineno}"] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode, static_proposal", [("rejection", False), ("deterministic", True)])
def test_a_speculative_step_reads_the_device_once(source, monkeypatch, mode, static_proposal):
    """Verification (every request at once), the draft's context writes and the proposal run on the device; a
    step reads back once: the verdicts with the next drafts and confidences (the sampler's own read-back is
    the worker's). Seeded sampling, the model's own drafts, varlen choosing per request."""
    steps = []
    step = Speculator.step

    def counting(self, *args, **kwargs):
        steps.append(1)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Speculator, "step", counting)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7 + i, ignore_eos=True) for i in range(len(PROMPTS))
    ]
    with DeviceReads() as counter:
        _, spec = generate(
            source, params, nextn=NEXTN, spec_sampling=mode, curve=line(1.0, 0.02), static_proposal=static_proposal
        )
    assert spec.num_drafts_verified > 0
    ((site, num),) = counter.reads.items()  # one call site: the step's read
    assert site.startswith("tolist @ speculator.py") and 0 < num <= len(steps), (counter.reads, len(steps))


def test_a_speculative_step_processes_the_logits_once_and_never_runs_the_sampler(source, greedy_off, monkeypatch):
    """The step's sampler output (tokens, logprobs, top-n) comes from the verification's processed distributions
    (``emitted_output``), not from a second pass of the sampler with its draws; greedy logprobs still equal
    speculation off. Once: ``Sampler.process``, or the static verify's own processing (device_sampling.py)."""
    from services.worker.sampling.sampler import Sampler

    calls = {"process": 0, "call": 0}
    process = Sampler.process

    def counting_process(self, *args, **kwargs):
        calls["process"] += 1
        return process(self, *args, **kwargs)

    def refused(self, *args, **kwargs):
        calls["call"] += 1
        raise AssertionError("the speculative step ran the whole sampler")

    import services.worker.spec.static_verify as static_verify_module

    device_process = static_verify_module.process  # the static verify's own processing of the step's logits

    def counting_device_process(*args, **kwargs):
        calls["process"] += 1
        return device_process(*args, **kwargs)

    monkeypatch.setattr(Sampler, "process", counting_process)
    monkeypatch.setattr(static_verify_module, "process", counting_device_process)
    monkeypatch.setattr(Sampler, "__call__", refused)
    reference = [o.token_ids for o in greedy_off]
    outs, spec = generate(source, GREEDY, nextn=NEXTN, rewrite=known_drafts(reference), static_proposal=True)
    assert [o.token_ids for o in outs] == reference
    assert [o.logprobs for o in outs] == [o.logprobs for o in greedy_off]
    assert calls == {"process": spec.timings.num_steps, "call": 0} and spec.num_drafts_accepted > 0
    assert set(spec.timings.seconds) == {"sample", "verify", "propose", "read", "other"}


def test_rejection_mode_seeded_run_with_the_models_own_draft_ends_and_releases(source, monkeypatch):
    monkeypatch.setitem(ENGINE, "batch_invariant", False)  # not needed here, and slower
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3, ignore_eos=True)
    outs, spec = generate(source, params, nextn=NEXTN)
    assert all(len(o.token_ids) == MAX_TOKENS and o.finish_reason == "length" for o in outs)
    assert spec.num_drafts_verified > 0
    assert spec.next_positions == {} and spec.drafts == {}  # every finished request's draft state is released


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_scheduler_bookkeeping_and_pools_hold_after_every_step_with_drafts_and_preemption(source, greedy_off, varlen):
    """The scheduler's speculative bookkeeping, driven by real steps: after every step (pools too small for
    three requests' drafts, so recompute preemptions happen) the pools are conserved, nothing is in flight,
    the accepted count is committed (computed = tokens − 1: every token but the newest has KV), no block past
    the tokens is kept (rejected and unverified drafts' blocks came back), each running request's draft rings
    (in its state slot) hold exactly its positions before the newest token, and the window ring keeps
    nextn + 1 positions of backtracking room. The last request runs to max_model_len. Greedy tokens still equal
    speculation off."""
    small = dict(
        ENGINE,
        max_model_len=len(PROMPTS[1]) + MAX_TOKENS,
        block_size=4,
        num_blocks=12,
        preemption_mode="recompute",
        num_speculative_tokens=NEXTN,
    )
    if varlen:
        small.update(spec_varlen=True, spec_step_cost_ms=tuple(line(1.0, 0.02).items()))
    probe = LLM(source=source, **small)
    runner = ModelRunner(source.model, probe.config.worker_config(), nextn=NEXTN, with_taps=True)
    speculator = Speculator(
        source.model, NEXTN, batch_invariant=True, rewrite_drafts=known_drafts([o.token_ids for o in greedy_off])
    )
    llm = LLM(source=source, worker=Worker(runner, speculator=speculator), **small)
    scheduler = llm.engine.scheduler
    assert runner.cache.layout.ring_size == scheduler.config.ring_size >= CASE.cfg.sliding_window + NEXTN + 1
    for i, prompt in enumerate(PROMPTS):
        llm.engine.add_request(str(i), prompt, GREEDY)
    outputs, num_preemptions, num_steps = {}, 0, 0
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            outputs[out.request_id] = out
        num_steps += 1
        scheduler.check_invariants()
        live = {str(i): scheduler.request(str(i)) for i in range(len(PROMPTS)) if scheduler.request(str(i))}
        assert set(speculator.next_positions) <= set(live) and set(speculator.drafts) <= set(live)
        for request_id, state in live.items():
            num_preemptions = max(num_preemptions, state.num_preemptions)
            assert state.num_inflight_tokens == 0
            assert len(state.block_table) <= -(-len(state.token_ids) // 4)
            assert len(state.draft_token_ids) <= NEXTN
            if state.status == "running":
                assert state.num_computed_tokens == len(state.token_ids) - 1
                assert speculator.next_positions[request_id] == state.num_computed_tokens
    assert num_preemptions > 0 and speculator.num_drafts_accepted > 0
    assert [outputs[str(i)].token_ids for i in range(len(PROMPTS))] == [o.token_ids for o in greedy_off]
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks and stats.free_state_slots == stats.total_state_slots
    assert speculator.next_positions == {} and speculator.drafts == {}
    print(
        f"\n{'varlen' if varlen else 'fixed'}: {num_steps} steps, up to {num_preemptions} preemptions of a "
        f"request, accepted {speculator.num_drafts_accepted} of {speculator.num_drafts_verified}"
    )


def test_the_draft_does_not_run_where_no_draft_could_be_verified(source, greedy_off, monkeypatch):
    """Varlen on a given curve proportional to rows (a step of R rows costs R ms): even certain drafts do not
    raise the tokens per millisecond, so the scheduler's plans say ``propose_drafts`` 0, the draft never
    runs (its context is still written), every step has one row per request, and greedy tokens and
    logprobs equal speculation off. On a curve with a fixed cost the same requests propose again (varlen's
    back-off skips a few proposals after one it verified none of)."""
    calls = []
    propose = type(source.model.draft).propose
    monkeypatch.setattr(
        type(source.model.draft), "propose", lambda self, *a, **k: calls.append(1) or propose(self, *a, **k)
    )
    rows: list[int] = []
    outs, speculator = generate(source, GREEDY, nextn=NEXTN, curve=line(0.0, 1.0), decode_rows=rows)
    assert [o.token_ids for o in outs] == [o.token_ids for o in greedy_off]
    assert [o.logprobs for o in outs] == [o.logprobs for o in greedy_off]
    assert calls == [] and speculator.num_drafts_verified == 0 and set(rows) == {1}
    assert speculator.num_proposals_skipped > 0 and speculator.next_positions == {}
    outs, speculator = generate(source, GREEDY, nextn=NEXTN, curve=line(1.0, 0.02), decode_rows=rows)
    # Only varlen's back-off skips here (after a proposal it verified none of): the draft runs far more often.
    assert calls and speculator.num_drafts_verified > 0 and speculator.num_proposals_skipped < len(calls)
    print(f"\nproportional curve: the draft ran 0 times; fixed-cost curve: {len(calls)} times")


@pytest.mark.parametrize("varlen, async_scheduling", [(False, False), (True, True)], ids=["fixed", "varlen-async"])
def test_verify_steps_run_the_static_graph_step(source, greedy_off, varlen, async_scheduling):
    """CUDA graphs with drafts: every decode step, verify steps included, runs the DecodeStepGraphs's static step (run
    eagerly here, ``use_graphs=False``: the code a graph captures), which also returns the draft's taps; under
    async scheduling a step after a step with drafts takes the seqlen fix-up into its static buffers. Known
    drafts make acceptance, partial acceptance and rejection happen; varlen (curve 1 + 0.02 · rows) varies the
    rows per request. In the batch-invariant mode the static step is bit-identical to the eager one, so
    greedy tokens and logprobs equal speculation off."""
    from services.engine.config import EngineConfig
    from services.worker.runners.decode_step_graphs import DecodeStepGraphs

    args = dict(ENGINE, num_speculative_tokens=NEXTN, async_scheduling=async_scheduling)
    if varlen:
        args.update(spec_varlen=True, spec_step_cost_ms=tuple(line(1.0, 0.02).items()))
    config = EngineConfig(**args).worker_config()
    runner = DecodeStepGraphs(
        ModelRunner(source.model, config, nextn=NEXTN, with_taps=True), config, use_graphs=False, attention="reference"
    )
    reference = [o.token_ids for o in greedy_off]
    speculator = Speculator(source.model, NEXTN, rewrite_drafts=known_drafts(reference), batch_invariant=True)
    worker = Worker(runner, speculator=speculator)
    rows, num_prefill = [], []
    execute = worker.execute

    def recording(plan, sample_rows, previous=None):
        if plan.kind != "decode":  # prefill and mixed steps run eagerly (a prompt cut at a snapshot boundary)
            num_prefill.append(plan)
        rows.extend(plan.seqlens_q.tolist()[: plan.num_decode_requests])
        return execute(plan, sample_rows, previous)

    worker.execute = recording
    outs = LLM(source=source, worker=worker, **args).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert [o.logprobs for o in outs] == [o.logprobs for o in greedy_off]
    assert 0 < speculator.num_drafts_accepted < speculator.num_drafts_verified
    assert max(rows) > 1 and (not varlen or len(set(rows)) > 2)
    assert runner.num_replays == 0 and runner.num_eager == len(num_prefill)  # only steps with prompt rows ran eagerly
    print(
        f"\n{'varlen' if varlen else 'fixed'}{' async' if async_scheduling else ''}: accepted "
        f"{speculator.num_drafts_accepted} of {speculator.num_drafts_verified}; rows per request {sorted(set(rows))}"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["rejection", "deterministic"])
def test_speculation_runs_on_the_gpu_torch_path(source, mode):
    """The torch model on CUDA (no kernel backend, no graphs, synchronous): every tensor of the verifier and
    the speculator lives on the model's device. Greedy tokens are printed against speculation off, not
    asserted: without the batch-invariant mode (CPU only) GPU products may round differently with 6 rows."""
    from services.engine.model_source import load_model

    gpu = load_model(source.name, device="cuda")
    args = dict(
        device="cuda",
        kernel_backend=None,
        cuda_graphs=False,
        async_scheduling=False,
        max_model_len=96,
        block_size=8,
        max_num_seqs=8,
        num_blocks=64,
    )
    off = LLM(source=gpu, **args).generate(PROMPTS, GREEDY)
    llm = LLM(source=gpu, **args, num_speculative_tokens=NEXTN, spec_sampling=mode)
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks
    spec = llm.engine.worker.speculator
    assert spec.num_drafts_verified > 0 and spec.next_positions == {}
    same = sum(a.token_ids == b.token_ids for a, b in zip(off, outs))
    print(
        f"\n{mode} on {torch.cuda.get_device_name()}: greedy equal to speculation off for {same} of {len(outs)} "
        f"requests; accepted {spec.num_drafts_accepted} of {spec.num_drafts_verified}"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_greedy_speculation_on_the_kernel_backend_equals_speculation_off(source, precision):
    """The kernel backend (eager, batch-invariant launch configurations: kernels/invariance.py), fixed, varlen
    and varlen with async scheduling: greedy tokens with drafts equal tokens without, as on the CPU. Decode
    steps with drafts run every row through the prefill attention kernel, steps without through the decode
    kernel, so this also checks that both kernels give a row the same logits' argmax. Known drafts make
    acceptance happen."""
    from services.engine.config import EngineConfig
    from services.engine.model_source import load_model

    args = dict(
        device="cuda",
        kernel_backend=precision,
        cuda_graphs=False,
        async_scheduling=False,
        batch_invariant=True,
        max_model_len=96,
        block_size=8,
        max_num_seqs=8,
        num_blocks=64,
    )
    off = LLM(source=load_model(source.name, device="cuda"), **args).generate(PROMPTS, GREEDY)
    reference = [o.token_ids for o in off]
    for varlen, async_scheduling in ((False, False), (True, False), (True, True)):
        gpu = load_model(source.name, device="cuda")  # each runner converts its model in place
        spec_args = dict(args, num_speculative_tokens=NEXTN, async_scheduling=async_scheduling)
        if varlen:
            spec_args.update(spec_varlen=True, spec_step_cost_ms=tuple(line(1.0, 0.02).items()))
        runner = ModelRunner(gpu.model, EngineConfig(**spec_args).worker_config(), nextn=NEXTN, with_taps=True)
        speculator = Speculator(gpu.model, NEXTN, rewrite_drafts=known_drafts(reference))
        llm = LLM(source=gpu, worker=Worker(runner, speculator=speculator), **spec_args)
        outs = llm.generate(PROMPTS, GREEDY)
        name = ("varlen" if varlen else "fixed") + (" async" if async_scheduling else "")
        print(
            f"\n{precision} {name}: accepted {speculator.num_drafts_accepted} of "
            f"{speculator.num_drafts_verified}; equal for {sum(o.token_ids == r for o, r in zip(outs, reference))} "
            f"of {len(outs)}"
        )
        assert [o.token_ids for o in outs] == reference
        assert 0 < speculator.num_drafts_accepted < speculator.num_drafts_verified
        stats = llm.stats()
        assert stats.free_blocks == stats.total_blocks and stats.free_state_slots == stats.total_state_slots


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("varlen, async_scheduling", [(False, False), (True, True)], ids=["fixed", "varlen-async"])
def test_cuda_graphs_replay_verify_steps(source, varlen, async_scheduling):
    """CUDA graphs with drafts on the FP8 kernel backend, batch-invariant (``build_runner`` captures every
    row-counting size up to max_num_seqs × (1 + nextn)): every decode step, verify steps included, replays a
    graph (prefill steps run eagerly), so does every proposal of the draft (a graph per batch bucket), greedy
    tokens with known drafts equal speculation off without graphs, and every request finishes with the pools
    whole."""
    from services.engine.config import EngineConfig
    from services.engine.model_source import load_model
    from services.worker.build import build_runner

    args = dict(
        device="cuda",
        kernel_backend="fp8",
        cuda_graphs=False,
        async_scheduling=False,
        batch_invariant=True,
        max_model_len=96,
        block_size=8,
        max_num_seqs=8,
        num_blocks=64,
    )
    reference = [
        o.token_ids for o in LLM(source=load_model(source.name, device="cuda"), **args).generate(PROMPTS, GREEDY)
    ]
    gpu = load_model(source.name, device="cuda")
    spec_args = dict(args, cuda_graphs=True, async_scheduling=async_scheduling, num_speculative_tokens=NEXTN)
    if varlen:
        spec_args.update(spec_varlen=True, spec_step_cost_ms=tuple(line(1.0, 0.02).items()))
    runner = build_runner(gpu.model, EngineConfig(**spec_args).worker_config())
    speculator = Speculator(gpu.model, NEXTN, rewrite_drafts=known_drafts(reference), cuda_graphs=True)
    llm = LLM(source=gpu, worker=Worker(runner, speculator=speculator), **spec_args)
    outs = llm.generate(PROMPTS, GREEDY)
    print(
        f"\n{runner.num_replays} graph replays, {runner.num_eager} eager steps; accepted "
        f"{speculator.num_drafts_accepted} of {speculator.num_drafts_verified}; equal for "
        f"{sum(o.token_ids == r for o, r in zip(outs, reference))} of {len(outs)}"
    )
    assert [o.token_ids for o in outs] == reference
    assert runner.num_replays > 0 and runner.num_eager <= len(PROMPTS)  # prefill steps only
    assert speculator.draft_graphs.num_replays > 0  # the draft's proposals replayed their graphs too
    graphs = speculator.draft_graphs  # one capture per key: a key that changed per step would re-capture
    assert graphs.num_captures == len(graphs.graphs), (graphs.num_captures, list(graphs.graphs))
    assert 0 < speculator.num_drafts_accepted < speculator.num_drafts_verified
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks and stats.free_state_slots == stats.total_state_slots
