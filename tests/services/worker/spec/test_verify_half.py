"""verify_half: the static verify that processes the step's logits itself gives the eager path's tokens and logprobs
in the engine loop, for rows with temperatures, top-k, top-p, bans, bias and top-n logprobs."""

import types

import pytest
import torch
from torch import nn

from model.deepseek_v41.dspark import DSpark
from services.engine import SamplingParams
from services.worker.sampling.device_sampling import SamplingKey
from services.worker.sampling.sampler import Sampler, SamplingRow
from services.worker.spec.accepted_context import Sampling
from services.worker.spec.static_verify import VerifyGraphs, VerifyKey
from services.worker.state.cache_engine import CacheEngine, ring_size
from tests.model.deepseek_v41.oracle_configs import DRAFT_CASES
from tests.services.worker.spec.test_speculator import NEXTN, generate, line, source  # noqa: F401

PROMPTS = [[0, *range(3, 3 + n)] for n in (5, 9, 2, 7)]

PARAMS = [
    SamplingParams(max_tokens=10, temperature=0.9, seed=11, top_k=6, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, banned_token_ids=(5, 9, 17)),
    SamplingParams(max_tokens=12, temperature=1.2, seed=12, top_p=0.7, ignore_eos=True, logit_bias=((3, 4.0),)),
    SamplingParams(
        max_tokens=5,
        temperature=0.6,
        seed=13,
        ignore_eos=True,
        banned_token_ids=(4,),
        logit_bias=((8, -2.5), (40, 1.5)),
    ),
]


@pytest.mark.parametrize("mode", ["rejection", "deterministic"])
def test_the_static_processing_gives_the_eager_paths_tokens_and_logprobs(source, monkeypatch, mode):  # noqa: F811 - the pytest fixture imported above
    """Eager: the eager proposal and verify half, ``Sampler.process`` every step. Static: the static proposal and
    verify (eagerly: the code the graphs capture), every step's processing inside the static verify (keys with
    ranking, bans and bias)."""
    curve = line(1.0, 0.02)  # varlen: requests verify different numbers of drafts
    want, _ = generate(source, PARAMS, prompts=PROMPTS, nextn=NEXTN, spec_sampling=mode, curve=curve)
    calls = [0]
    process = Sampler.process

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return process(self, *args, **kwargs)

    monkeypatch.setattr(Sampler, "process", counting)
    got, spec = generate(
        source, PARAMS, prompts=PROMPTS, nextn=NEXTN, spec_sampling=mode, curve=curve, static_proposal=True
    )
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    keys = {k.sampling for k in spec.verify_graphs.static}
    assert SamplingKey(True, 16, 16) in keys  # ranked (top-n, top-k, top-p), banned and biased rows
    # This config's draft window fits every step's entries (prefill too), so no step ran the eager processing.
    assert calls[0] == 0 and spec.num_drafts_verified > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ["rejection", "deterministic"])
def test_on_cuda_the_processing_graph_replay_equals_the_eager_run_and_the_sampler_without_a_sync(mode):
    """A step of three requests (ranked, banned, biased and plain rows) through a static verify that processes the
    logits itself, rejection reading the draft distributions from a per-slot buffer: the graph's replay equals the
    eager run on the pool and every output, its processing equals ``Sampler.process``, and the second replay
    (refilled buffers) runs under ``set_sync_debug_mode("error")``."""
    cfg = DRAFT_CASES[0].cfg
    v, nextn = cfg.vocab_size, cfg.dspark_block_size
    torch.manual_seed(0)
    model = types.SimpleNamespace(
        cfg=cfg, draft=DSpark(cfg).eval().cuda(), embed=nn.Embedding(v, cfg.hidden_size).cuda()
    )
    spans = [1 + nextn, 1, 3]
    sampling, start = [], 0
    for i, n in enumerate(spans):
        sampling.append(
            Sampling(
                i,
                str(i),
                slice(start, start + n),
                list(range(start, start + n)),
                i + 1,
                20 + 7 * i,
                [5, 9, 2, 1, 1, 1, 1, 1][: n - 1],
            )
        )
        start += n
    kinds = [dict(top_k=7), dict(banned_token_ids=(3, 4)), dict(logit_bias=((6, 2.0),), top_p=0.8), {}]
    rows = [
        SamplingRow(
            **{
                **dict(
                    temperature=0.0 if r == 1 + nextn else 0.8,
                    top_k=0,
                    top_p=1.0,
                    seed=3,
                    position=21 + r,
                    forced_top_k=None,
                    banned_token_ids=(),
                    num_logprobs=0,
                ),
                **kinds[r % len(kinds)],
            }
        )
        for r in range(start)
    ]
    taps = torch.randn(start, model.draft.main_proj.in_features, device="cuda")
    cache = CacheEngine(cfg, 8, num_blocks=2, num_state_slots=4, ring=ring_size(cfg), draft=True, device="cuda")
    slot_probs = torch.softmax(torch.randn(4, nextn, v, device="cuda"), -1)
    initial = torch.randint(0, 120, cache.slots.shape, dtype=torch.uint8, device="cuda")  # finite fp32 ring values
    logits = torch.randn(start, v, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    want = Sampler().process(logits, rows)
    results = []
    with torch.no_grad():
        for use_graphs in (False, True):
            graphs = VerifyGraphs(model, nextn, use_graphs, slot_probs=lambda cache: slot_probs)
            key = VerifyKey.of(sampling, nextn, cache.layout.draft_window, mode, rows)
            assert key.sampling == SamplingKey(True, 16, 16)
            graphs.capture(cache, [key])
            for debug in ("default", "error"):  # twice: the second fill and run from the same pool
                cache.slots.copy_(initial)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode(debug if use_graphs else "default")
                try:
                    out = graphs.verify(key, cache, sampling, rows, None, taps, logits=logits)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            p = out.processed
            for name in ("banned", "logprobs", "probs", "errors"):
                assert torch.equal(getattr(p, name)[:start], getattr(want, name)), name
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
    for want_tensor, got in zip(*results):
        assert torch.equal(want_tensor, got)
