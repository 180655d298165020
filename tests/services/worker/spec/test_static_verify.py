"""The static verify (services/worker/spec/static_verify.py), run eagerly, equals the eager verify half step by
step through the engine loop: every step's verdicts (errors, accepted counts, emitted tokens), the draft rings
``write_context`` leaves (the whole state-slot pool, ``==``), and each sampled row's token, logprob and top-n
(``emitted_output``). Both verifier modes, fixed and varlen, with requests finishing at different steps so the
batch shrinks through several buckets, and a last prompt chunk longer than the draft's window.
On CUDA: its graph replay equals the eager run, with no sync (``set_sync_debug_mode("error")``)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import services.worker.spec.speculator as speculator_module
from model.batch_invariant import batch_invariant
from model.deepseek_v41.dspark import DSpark
from services.engine import SamplingParams
from services.worker.sampling.device_sampling import SamplingKey
from services.worker.sampling.sampler import Sampler, SamplingRow
from services.worker.spec.accepted_context import DeviceVerdict, Sampling, emitted_output, write_context
from services.worker.spec.static_verify import StaticVerify, VerifyGraphs, VerifyKey
from services.worker.spec.verifier import device_draws, signed_seed
from services.worker.state.cache_engine import CacheEngine, ring_size
from tests.model.deepseek_v41.oracle_configs import DRAFT_CASES
from tests.services.worker.spec.test_speculator import NEXTN, generate, known_drafts, line, source  # noqa: F401

PROMPTS = [[0, *range(3, 3 + n)] for n in (5, 13, 2, 9, 4)]
MAX_TOKENS = (12, 3, 6, 2, 24)  # requests end at different steps: batches 5, 4, 3, 2, 1 (buckets 8 … 1)


@pytest.fixture(scope="module")
def reference(source):  # noqa: F811 - the pytest fixture imported above
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    return [o.token_ids for o in generate(source, params, prompts=PROMPTS)[0]]


class Compare:
    """Wraps the eager verify half: after its ``write_context``, reruns the step's verify half through a
    ``StaticVerify`` on the pool as it was before and checks every output against the eager one."""

    def __init__(self, monkeypatch, mode: str) -> None:
        self.mode, self.num_steps, self.keys, self.num_accepted = mode, 0, set(), 0
        self.speculator = self.graphs = None
        self.processed = self.rows = None
        process, write_context = Sampler.process, speculator_module.write_context

        def recording_process(sampler, logits, rows, rank_all=False, **masks):  # masks: a constraint's token bitmask
            self.rows, self.processed = list(rows), process(sampler, logits, rows, rank_all=rank_all, **masks)
            self.rank_all = rank_all
            return self.processed

        def checked_write_context(draft, sampling, verdict, taps, cache):
            before = cache.slots.clone()
            write_context(draft, sampling, verdict, taps, cache)
            self.check(sampling, verdict, taps, cache, before)

        monkeypatch.setattr(Sampler, "process", recording_process)
        monkeypatch.setattr(speculator_module, "write_context", checked_write_context)

    def check(self, sampling, verdict, taps, cache, before) -> None:
        spec, processed = self.speculator, self.processed
        num_top = processed.order.shape[1] and min(max(r.num_logprobs for r in self.rows), processed.order.shape[1])
        num_top = num_top if self.rank_all else 0
        want = emitted_output(processed, verdict, sampling, num_top)
        eager = cache.slots.clone()
        cache.slots.copy_(before)
        key = VerifyKey.of(sampling, spec.nextn, cache.layout.draft_window, self.mode)
        assert key is not None  # this config's window fits the static verify's entries: every step checks
        if self.graphs is None:  # every bucket up to 8 shares the largest's buffers, stale rows included
            self.graphs = VerifyGraphs(spec.model, spec.nextn, use_graphs=False)
            self.graphs.capture(cache, VerifyKey.buckets(8, self.mode))
        draft_probs = [spec.draft_probs.get(s.request_id) for s in sampling] if self.mode == "rejection" else []
        out = self.graphs.verify(key, cache, sampling, self.rows, processed, taps, draft_probs)
        got_rings = cache.slots.clone()
        cache.slots.copy_(eager)  # the run goes on from the eager path's rings
        num_r, num_rows = len(sampling), processed.logprobs.shape[0]
        assert torch.equal(out.verdict.errors[:num_r], verdict.errors)
        assert torch.equal(out.verdict.num_accepted[:num_r], verdict.num_accepted)
        for r, a in enumerate(verdict.num_accepted.tolist()):
            assert torch.equal(out.verdict.tokens[r, : a + 1], verdict.tokens[r, : a + 1]), (r, a)
        assert torch.equal(out.tokens[:num_rows], want.token_ids)
        assert torch.equal(out.logprobs[:num_rows], want.logprobs)
        assert torch.equal(got_rings, eager)
        self.num_steps += 1
        self.keys.add(key)
        self.num_accepted += int(verdict.num_accepted.sum())


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("mode", ["rejection", "deterministic"])
def test_the_static_verify_equals_the_eager_verify_half_every_step(source, reference, monkeypatch, mode, varlen):  # noqa: F811 - the pytest fixture imported above
    # Greedy and seeded rows; known drafts (the greedy reference, every third wrong) so drafts are accepted,
    # partly accepted and rejected; top-n logprobs on one request.
    params = [
        SamplingParams(
            max_tokens=n,
            temperature=0.0 if i % 2 else 0.9,
            seed=11 + i,
            ignore_eos=True,
            logprobs=2 if i == 0 else None,
        )
        for i, n in enumerate(MAX_TOKENS)
    ]
    compare = Compare(monkeypatch, mode)
    speculator_module_speculator = speculator_module.Speculator

    class Recorded(speculator_module_speculator):  # the test's handle on the engine's speculator
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            compare.speculator = self

    monkeypatch.setattr("tests.services.worker.spec.test_speculator.Speculator", Recorded)
    outs, spec = generate(
        source,
        params,
        prompts=PROMPTS,
        nextn=NEXTN,
        spec_sampling=mode,
        rewrite=known_drafts(reference, PROMPTS),
        curve=line(1.0, 0.02) if varlen else None,
    )
    assert spec is compare.speculator and spec.verify_graphs is None  # the eager path ran; the static was checked
    assert compare.num_steps > len(max(reference, key=len)) // (1 + NEXTN)
    assert compare.num_accepted > 0
    assert {k.num_requests for k in compare.keys} >= {8, 4, 2, 1}


@pytest.mark.parametrize("case", DRAFT_CASES[:2], ids=["window-8", "window-4"])
def test_the_static_context_writes_equal_write_context(case):
    """``test_accepted_context``'s requests (partly and fully accepted decode requests, one whose rows outnumber
    the ring, a last prompt chunk longer than the ring, a lone decode row, an error request) through a forced
    static verify: the rings equal ``write_context`` of the same verdict, every pass of W entries included."""
    cfg = case.cfg
    torch.manual_seed(0)
    model = types.SimpleNamespace(
        cfg=cfg, draft=DSpark(cfg).eval(), embed=nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    )
    nextn = cfg.dspark_block_size
    requests = [
        (1 + nextn, 1 + nextn, 20, 1, 2, False),
        (1 + nextn, 1 + nextn, 3, 2, nextn, False),
        (1 + nextn, 1 + nextn, 50, 3, nextn - 1, False),
        (13, 1, 0, 4, 0, False),
        (1, 1, 40, 5, 0, False),
        (3, 3, 9, 6, 2, True),
    ]
    sampling, start, row = [], 0, 0
    for i, (num_plan, n, first, slot, _, _) in enumerate(requests):
        sampling.append(
            Sampling(i, str(i), slice(start, start + n), list(range(row, row + num_plan)), slot, first, [7] * (n - 1))
        )
        start, row = start + n, row + num_plan
    logits = torch.randn(start, cfg.vocab_size)
    logits[start - 2, 3] = float("nan")  # the error request's middle row
    rows = [
        SamplingRow(
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            seed=1,
            position=p,
            forced_top_k=None,
            banned_token_ids=(),
            num_logprobs=0,
        )
        for p in range(start)
    ]
    processed = Sampler().process(logits, rows)
    taps = torch.randn(row, model.draft.main_proj.in_features)
    got, want = (
        CacheEngine(cfg, 16, num_blocks=2, num_state_slots=8, ring=ring_size(cfg), draft=True) for _ in range(2)
    )
    noise = torch.randint(0, 120, got.slots.shape, dtype=torch.uint8)  # finite fp32 values where nothing is written
    got.slots.copy_(noise), want.slots.copy_(noise)
    with torch.no_grad(), batch_invariant():
        key = VerifyKey.of(sampling, nextn, cfg.sliding_window, "forced")
        static = StaticVerify(model, got, key, nextn)
        static.fill(sampling, rows, processed, taps, forced=[a for *_, a, _ in requests])
        out = static.run()
        num_r = len(requests)
        verdict = DeviceVerdict(
            out.verdict.errors[:num_r], out.verdict.num_accepted[:num_r], out.verdict.tokens[:num_r]
        )
        write_context(model.draft, sampling, verdict, taps, want)
    assert verdict.errors.tolist() == [e for *_, e in requests]
    assert verdict.num_accepted.tolist() == [a for *_, a, _ in requests]
    assert static.num_entries > cfg.sliding_window or case is DRAFT_CASES[0]  # window-4: passes of W entries
    assert torch.equal(got.slots, want.slots)


def test_a_step_with_the_static_verify_reads_the_device_once(source, monkeypatch):  # noqa: F811 - the pytest fixture imported above
    """The engine loop with the static proposal and verify (rejection: the draft distributions' copies too,
    seeded rows, the model's own drafts, varlen): the one host read per step is the speculator's ``tolist``;
    static_verify.py reads nothing."""
    import tests.services.worker.spec.test_speculator as speculator_tests

    files = speculator_tests.SPECULATIVE_FILES + ("static_verify.py",)
    monkeypatch.setattr(speculator_tests, "SPECULATIVE_FILES", files)
    params = [SamplingParams(max_tokens=6, temperature=0.9, seed=7 + i, ignore_eos=True) for i in range(3)]
    with speculator_tests.DeviceReads() as counter:
        _, spec = generate(
            source,
            params,
            prompts=PROMPTS[:3],
            nextn=NEXTN,
            spec_sampling="rejection",
            curve=line(1.0, 0.02),
            static_proposal=True,
        )
    assert spec.verify_graphs is not None and len(spec.verify_graphs.static) > 0 and spec.num_drafts_verified > 0
    ((site, num),) = counter.reads.items()
    assert site.startswith("tolist @ speculator.py") and 0 < num, counter.reads


@pytest.mark.parametrize("greedy_only", [False, True])
def test_capture_graphs_builds_every_bucket_ahead(source, greedy_only):  # noqa: F811 - the pytest fixture imported above
    """``Speculator.capture_graphs`` (what ``LLM`` calls with ``cuda_graphs``, the bench with ``greedy_only``):
    every verify bucket up to the batch and the draft's buckets without bans or bias, all sharing the largest
    verify's buffers."""
    cfg = source.model.cfg
    cache = CacheEngine(cfg, 8, num_blocks=2, num_state_slots=6, ring=ring_size(cfg), draft=True)
    spec = speculator_module.Speculator(source.model, NEXTN, "deterministic", static_proposal=True)
    spec.capture_graphs(cache, 5, greedy_only=greedy_only)
    plain = SamplingKey(False, 0, 0)  # the static verify processes the rows: no ranking, ban or bias
    assert set(spec.verify_graphs.static) == {VerifyKey(g, "deterministic", plain) for g in (1, 2, 4, 8)}
    largest = spec.verify_graphs.static[VerifyKey(8, "deterministic", plain)]
    assert all(s.logits.data_ptr() == largest.logits.data_ptr() for s in spec.verify_graphs.static.values())
    draft_keys = {(k.num_rows, k.all_greedy) for k in spec.draft_graphs.static}
    assert draft_keys == {(g, greedy) for g in (1, 2, 4, 8) for greedy in ((True,) if greedy_only else (True, False))}


def test_a_step_whose_entries_do_not_fit_has_no_key():
    """A last prompt chunk writes its last min(rows, W) entries; more than bucket(1 + nextn) takes the eager path."""
    chunk = Sampling(0, "0", slice(0, 1), list(range(20)), 1, 0, [])
    decode = Sampling(1, "1", slice(1, 5), list(range(20, 24)), 2, 30, [4, 5, 6])
    assert VerifyKey.of([decode, chunk], 3, 16, "rejection") is None
    assert VerifyKey.of([decode, chunk], 3, 4, "rejection") == VerifyKey(2, "rejection")
    assert VerifyKey.of([decode], 3, 16, "deterministic") == VerifyKey(1, "deterministic")


def test_device_draws_equal_the_host_draws():
    from kernels.philox import DrawCase, draw_bits

    seeds = [0, 7, (1 << 64) - 1, 1 << 63, 123456789012345]
    positions = [[p + j for j in range(4)] for p in (0, 5, 1 << 40, 99, (1 << 59) + 3)]
    for case in DrawCase:
        want = draw_bits([s for s in seeds for _ in range(4)], [p for row in positions for p in row], case).view(5, 4)
        got = device_draws(torch.tensor([signed_seed(s) for s in seeds]), torch.tensor(positions), case)
        assert torch.equal(got, want), case


def test_placeholders_write_only_the_null_slot(source):  # noqa: F811 - the pytest fixture imported above
    """Warm-up before a capture: every request a placeholder; the pool outside slot 0 is untouched."""
    cfg = source.model.cfg
    cache = CacheEngine(cfg, 8, num_blocks=2, num_state_slots=4, ring=ring_size(cfg), draft=True)
    cache.slots.copy_(torch.randint(0, 256, cache.slots.shape, dtype=torch.uint8))
    before = cache.slots.clone()
    graphs = VerifyGraphs(source.model, NEXTN, use_graphs=False)
    keys = VerifyKey.buckets(2, "rejection")
    graphs.capture(cache, keys)
    for key in keys:
        static = graphs.static[key]
        static.fill((), (), None, None)
        static.run()
    assert torch.equal(cache.slots[1:], before[1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ["rejection", "deterministic", "forced"])
def test_on_cuda_the_graph_replay_equals_the_eager_run_without_a_sync(mode):
    """One step's verify half (a partly verified decode request, a lone decode row, a last prompt chunk longer
    than the window) on CUDA: the graph's replay equals the same static verify run eagerly, on the pool and every
    output, from the same pool; the second replay (refilled buffers) runs under ``set_sync_debug_mode("error")``."""
    cfg = DRAFT_CASES[0].cfg
    v, w, nextn = cfg.vocab_size, cfg.sliding_window, cfg.dspark_block_size
    torch.manual_seed(0)
    model = types.SimpleNamespace(
        cfg=cfg, draft=DSpark(cfg).eval().cuda(), embed=nn.Embedding(v, cfg.hidden_size).cuda()
    )
    spans, plan_rows = [1 + nextn, 1, 1], [1 + nextn, 1, w + 3]
    sampling, start, row = [], 0, 0
    for i, (n, num_plan) in enumerate(zip(spans, plan_rows)):
        sampling.append(
            Sampling(
                i,
                str(i),
                slice(start, start + n),
                list(range(row, row + num_plan)),
                i + 1,
                20 + 7 * i,
                [5, 9, 2][: n - 1] + [1] * max(n - 4, 0),
            )
        )
        start, row = start + n, row + num_plan
    rows = [
        SamplingRow(
            temperature=0.0 if mode == "forced" or r == 1 + nextn else 0.8,
            top_k=0,
            top_p=1.0,
            seed=3,
            position=21 + r,
            forced_top_k=None,
            banned_token_ids=(),
            num_logprobs=0,
        )
        for r in range(start)
    ]
    taps = torch.randn(row, model.draft.main_proj.in_features, device="cuda")
    draft_probs = [torch.softmax(torch.randn(nextn, v, device="cuda"), -1), None, None]
    forced = [2, 0, 0] if mode == "forced" else None
    cache = CacheEngine(cfg, 8, num_blocks=2, num_state_slots=4, ring=ring_size(cfg), draft=True, device="cuda")
    initial = torch.randint(0, 120, cache.slots.shape, dtype=torch.uint8, device="cuda")  # finite fp32 ring values
    results = []
    with torch.no_grad():
        for use_graphs in (False, True):
            graphs = VerifyGraphs(model, nextn, use_graphs)
            key = VerifyKey.of(sampling, nextn, cache.layout.draft_window, mode)
            graphs.capture(cache, [key])
            for debug in ("default", "error"):  # twice: the second fill and run from the same pool
                logits = torch.randn(start, v, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
                processed = Sampler().process(logits, rows)
                cache.slots.copy_(initial)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode(debug if use_graphs else "default")
                try:
                    out = graphs.verify(key, cache, sampling, rows, processed, taps, draft_probs, forced)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            results.append(
                (
                    cache.slots.clone(),
                    out.verdict.errors.clone(),
                    out.verdict.num_accepted.clone(),
                    out.verdict.tokens.clone(),
                    out.tokens.clone(),
                    out.logprobs.clone(),
                )
            )
            assert graphs.num_replays == (2 if use_graphs else 0)
    for want, got in zip(*results):
        assert torch.equal(want, got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_cuda_llm_captures_every_verify_and_draft_bucket_ahead(source):  # noqa: F811 - the pytest fixture imported above
    """``LLM`` with ``cuda_graphs`` and drafts captures its buckets when built: a run of batches 3 then 1 captures
    nothing more, replays verify and draft graphs, and gives speculation off's greedy tokens."""
    from services.engine import LLM
    from services.engine.model_source import load_model

    args = dict(
        device="cuda",
        kernel_backend="fp8",
        batch_invariant=True,
        max_model_len=96,
        block_size=8,
        max_num_seqs=4,
        num_blocks=64,
    )
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [
        o.token_ids for o in LLM(source=load_model(source.name, device="cuda"), **args).generate(PROMPTS[:3], greedy)
    ]
    llm = LLM(source=load_model(source.name, device="cuda"), cuda_graphs=True, num_speculative_tokens=NEXTN, **args)
    spec = llm.engine.worker.speculator
    captures = (spec.verify_graphs.num_captures, spec.draft_graphs.num_captures)
    assert captures[0] == len(VerifyKey.buckets(4, "rejection"))
    got = [o.token_ids for o in llm.generate(PROMPTS[:3], greedy)] + [
        o.token_ids for o in llm.generate(PROMPTS[:1], greedy)
    ]
    assert (spec.verify_graphs.num_captures, spec.draft_graphs.num_captures) == captures
    assert spec.verify_graphs.num_replays > 0 and spec.draft_graphs.num_replays > 0
    assert got == want + want[:1]
