"""The warm-up before ready (services/engine/warmup.py): its plan, and on the kernel engine interpreted on the CPU,
no kernel specialisation after it that it did not already launch.

Under Triton's interpreter nothing compiles, so the test counts specialisation keys (tests/kernels/spec_keys.py:
Triton's own binder over each launch's arguments): the keys a GPU would compile. After ``warm_up`` it sends
prompts of many lengths, some together (mixed steps with decode rows), some resuming from the prefix cache at
other offsets, with greedy and sampled requests, and finds no key the warm-up had not launched; with drafts (fixed
and varlen verification) the same for verify steps and the draft's proposals.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from services.engine import LLM, SamplingParams
from services.engine.config import EngineConfig
from services.engine.warmup import PHASE, plan_warmup, token_buckets, warm_up
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.runners.model_runner import ModelRunner
from tests.kernels.spec_keys import SpecKeys

ENGINE = dict(device="cpu", block_size=4, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=8)


def test_token_buckets_and_plan():
    assert token_buckets(16) == [1, 2, 4, 8, 16] and token_buckets(24) == [1, 2, 4, 8, 16, 24]
    plan = plan_warmup(budget=16, max_model_len=48, block_size=8, prefix_caching=True, max_num_seqs=3)
    assert [(r.prompt_length, r.max_tokens) for r in plan[:5]] == [(1, 1), (2, 1), (4, 1), (8, 1), (16, 1)]
    assert [r.copies for r in plan[5:8]] == [1, 2, 3] and all(r.max_tokens == 2 for r in plan[5:8])
    beside, long = plan[8], plan[9]
    assert beside.beside_long and long.prompt_length == 46  # the whole context, less two output tokens
    assert beside.max_tokens >= -(-46 // 16)  # decodes through every chunk of the long prompt
    hits = [r for r in plan if r.prefix_of is not None]
    assert [r.prefix_of for r in hits] == [9, 33] and all(r.prompt_length <= 46 for r in hits)
    assert plan[-1].sampled
    assert not any(r.prefix_of for r in plan_warmup(16, 48, 8, prefix_caching=False))
    assert plan_warmup(16, 48, 8, True, max_context=20)[7].prompt_length == 20  # one decode group (1 row)


SMALL = dict(
    num_hidden_layers=5,
    compress_ratios=(0, 2, 1, 1, 1, 0),
    kv_source_layer_ids=(1, 2),
    index_source_layer_ids=(1, 2, 4),
    candidate_source_layer_id=2,
    engram_layer_ids=(1,),
    engram_num_embeddings=(1,),
    hc_sinkhorn_iters=2,
)
"""The oracle config cut to one layer of each kind: window-only, a ratio-2 KV and index source (Engram), a ratio-1
KV, index and candidate source, a ratio-1 layer reusing its selection, a ratio-1 index source within the
candidates; two Sinkhorn iterations (a constexpr; the interpreter's time is mostly mHC's finishing kernel)."""


@pytest.fixture(scope="module")
def small_source(tmp_path_factory):
    return _checkpoint(tmp_path_factory, SMALL)


def _checkpoint(tmp_path_factory, fields: dict):
    """The oracle config with ``fields`` as a checkpoint: a loader of fresh copies (the kernel backend converts a
    model in place)."""
    from model.deepseek_v41.init import write_random_checkpoint
    from model.deepseek_v41.tokenizer import engram_token_map
    from services.engine.model_source import load_model
    from tests.model.deepseek_v41.oracle_configs import ORACLE, finish
    from tests.model.deepseek_v41.oracle_harness import toy_tokenizer

    tok = toy_tokenizer(ORACLE.vocab_size)
    cfg = finish(dataclasses.replace(ORACLE, **fields), engram_token_map(tok)[1])
    path = write_random_checkpoint(tmp_path_factory.mktemp("model") / "ckpt", cfg, 8, tok)
    return lambda: load_model(str(path))


def kernel_llm(source, **engine_args) -> LLM:
    """An LLM on the FP8 kernel backend, every kernel interpreted (sampler included)."""
    config = EngineConfig(**{**ENGINE, **engine_args})
    kernels = KernelSet(*(load_interpreted(name) for name in KernelSet.NAMES), interpreted=True)
    runner = ModelRunner(source.model, config.worker_config(), backend="kernels", precision="fp8", kernels=kernels)
    return LLM(source=source, runner=runner, **{**ENGINE, **engine_args})


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_no_new_kernel_variant_after_the_warm_up(small_source):
    llm = kernel_llm(small_source())
    calls = []
    keys = SpecKeys()
    with interpreter(), keys:
        steps = warm_up(llm.engine, lambda *a: calls.append(a))
        warmed = keys.snapshot()
        num_warm = sum(len(k) for k in warmed.values())
        assert calls[0] == (PHASE, 0, calls[-1][2]) and calls[-1][1] == calls[-1][2] and steps > 0
        assert not llm.engine.has_unfinished()
        gen = torch.Generator().manual_seed(5)
        vocab = range(3, 250)

        def prompt(n):
            return [vocab[int(i)] for i in torch.randint(0, len(vocab), (n,), generator=gen)]

        shared = prompt(24)
        greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        sampled = SamplingParams(max_tokens=2, temperature=1.0, top_p=0.8, seed=3, logprobs=1, ignore_eos=True)
        # Lengths off every bucket, together (mixed steps: chunks beside decode rows, budgets cut mid-prompt) ...
        llm.generate([prompt(n) for n in (3, 11, 27)], [greedy, sampled, greedy])
        # ... and resuming from the prefix cache after 1 and 4 blocks, with a few tokens more each.
        llm.generate([shared], greedy)
        llm.generate([shared[:cut] + prompt(extra) for cut, extra in ((5, 3), (17, 6))], greedy)
        assert llm.engine.stats().prefix_cache_hits > 0
    print(f"\n{num_warm} kernel variants after {steps} warm-up steps; {keys.num_launches} launches in all")
    print("  per kernel:", {name.split(".")[-1]: len(k) for name, k in sorted(warmed.items())})
    assert keys.new_since(warmed) == {}


SPEC = dict(
    num_hidden_layers=1,
    compress_ratios=(0, 0),
    kv_source_layer_ids=(),
    index_source_layer_ids=(),
    candidate_source_layer_id=None,
    engram_layer_ids=(),
    engram_num_embeddings=(),
    hc_sinkhorn_iters=2,
    num_nextn_predict_layers=1,
    dspark_target_layer_ids=(0,),
    dspark_block_size=3,
    dspark_markov_rank=16,
    dspark_n_routed_experts=4,
    dspark_num_experts_per_tok=2,
)
"""The cheapest target under a DSpark draft: one window-only layer tapped by one draft stage (its own window
attention, MoE and mHC sites, blocks of 3). The compressed layers' variants are ``SMALL``'s test's: a verify
step's rows reach them as a prompt chunk of as many rows does."""
SPEC_ENGINE = dict(ENGINE, max_num_seqs=2, num_speculative_tokens=2)  # decode rows 2 × (1 + 2) within the budget 8


@pytest.fixture(scope="module")
def spec_source(tmp_path_factory):
    return _checkpoint(tmp_path_factory, SPEC)


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_no_new_kernel_variant_in_speculative_steps_after_the_warm_up(spec_source, varlen):
    """With drafts every decode step verifies them (1 + k rows a request, or varlen's choice per request, the
    step-cost curve measured from the engine's own steps) and the draft proposes the next block: after the
    warm-up, requests of other lengths together (verify rows beside prompt chunks) and resuming from the prefix
    cache launch no key the warm-up had not."""
    from services.worker.build import build_worker

    args = dict(SPEC_ENGINE, spec_varlen=varlen)
    source = spec_source()
    config = EngineConfig(**{**ENGINE, **args})
    kernels = KernelSet(*(load_interpreted(name) for name in KernelSet.NAMES), interpreted=True)
    nextn = config.num_speculative_tokens
    runner = ModelRunner(
        source.model,
        config.worker_config(),
        backend="kernels",
        precision="fp8",
        kernels=kernels,
        nextn=nextn,
        with_taps=True,
    )
    llm = LLM(source=source, worker=build_worker(source.model, config.worker_config(), runner=runner), **args)
    speculator = llm.engine.worker.speculator
    keys = SpecKeys()
    with interpreter(), keys:
        steps = warm_up(llm.engine)
        warmed = keys.snapshot()
        verified = speculator.num_drafts_verified
        assert verified > 0  # the warm-up's decode steps verified drafts
        gen = torch.Generator().manual_seed(7)

        def prompt(n):
            return torch.randint(3, 250, (n,), generator=gen).tolist()

        greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        sampled = SamplingParams(max_tokens=5, temperature=1.0, top_p=0.8, seed=3, logprobs=1, ignore_eos=True)
        llm.generate([prompt(n) for n in (3, 13, 19)], [greedy, sampled, greedy])
        shared = prompt(21)
        llm.generate([shared], greedy)
        llm.generate([shared[:9] + prompt(2)], sampled)
        assert llm.engine.stats().prefix_cache_hits > 0 and speculator.num_drafts_verified > verified
    num_warm = sum(len(k) for k in warmed.values())
    print(
        f"\n{num_warm} kernel variants after {steps} warm-up steps; {keys.num_launches} launches in all; "
        f"{speculator.num_drafts_verified} drafts verified"
    )
    assert keys.new_since(warmed) == {}


@pytest.mark.usefixtures("one_torch_thread")
def test_progress_ends_at_its_total_when_drafts_refuse_a_request():
    """With drafts the engine refuses the warm-up's request with penalties: it is skipped, and still counted in
    the progress reports, so the last report is ``total`` of ``total`` (a readiness bar that reaches its end)."""
    progress: list[tuple] = []
    llm = LLM(
        model="tiny",
        max_num_seqs=2,
        max_num_batched_tokens=64,
        max_model_len=256,
        block_size=16,
        num_blocks=64,
        warmup=True,
        num_speculative_tokens=3,
        progress=lambda *a: progress.append(a),
    )
    assert llm.config.warmup
    phase, done, total = progress[-1]
    assert phase == "compiling" and done == total > 0
    assert [d for _, d, _ in progress] == sorted(d for _, d, _ in progress)


# ---------------------------------------------------------------- CUDA: compiles counted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nextn", [0, 3], ids=["plain", "drafts"])
def test_no_compile_after_the_warm_up_on_the_gpu(nextn):
    """The tiny model on the CUDA defaults (FP8 kernels, decode graphs, async scheduling, the warm-up; with drafts
    the defaults' eager synchronous steps, each decode step verifying 3 drafts of tiny's DSpark draft): Triton's
    cache-miss hook (called before every compile of a variant the process has not loaded) counts the compiles
    of the build (graph capture and warm-up), then of prompts of many lengths alone and together, prefix-cache
    hits at several offsets and sampled requests with logprobs: none after the warm-up."""
    import time

    import triton

    compiles: list[str] = []

    def missed(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        compiles.append(f"{fn.name}: {repr}")
        return None  # compile as usual

    progress: list[tuple] = []  # (time, compiles so far, phase, done, total)
    triton.knobs.runtime.jit_cache_hook = missed
    try:
        start = time.perf_counter()
        llm = LLM(
            model="tiny",
            device="cuda",
            max_num_seqs=4,
            max_num_batched_tokens=128,
            max_model_len=1024,
            block_size=16,
            num_blocks=320,  # not sized from the GPU's memory: other test files may share the GPU
            progress=lambda *a: progress.append((time.perf_counter(), len(compiles), *a)),
            **({"num_speculative_tokens": nextn} if nextn else {}),
        )
        built_s, built = time.perf_counter() - start, len(compiles)
        assert llm.config.warmup and llm.config.cuda_graphs == (nextn == 0)
        assert progress[-1][3] == progress[-1][4] > 0
        gen = torch.Generator().manual_seed(9)
        vocab = llm.source.config.vocab_size

        def prompt(n):
            return torch.randint(3, min(vocab, 30000), (n,), generator=gen).tolist()

        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        sampled = SamplingParams(
            max_tokens=4, temperature=0.7, top_p=0.9, top_k=40, logprobs=3, seed=1, ignore_eos=True
        )
        lengths = (1, 3, 7, 17, 31, 33, 100, 127, 128, 129, 200, 300, 511, 777, 1000)
        for n in lengths:
            llm.generate([prompt(n)], greedy)
        together = [prompt(n) for n in lengths[::2]]  # mixed steps: chunks beside decode rows
        llm.generate(together, [(greedy, sampled)[i % 2] for i in range(len(together))])
        shared = prompt(900)
        llm.generate([shared], greedy)
        cuts = (17, 100, 513, 850)
        llm.generate([shared[:cut] + prompt(13 + cut % 50) for cut in cuts], sampled)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    after = compiles[built:]
    (t0, c0, *_), (t1, c1, *_), (t2, c2, *_) = progress[0], progress[1], progress[-1]
    print(
        f"\nbuild {built_s:.1f} s, {built} compiles: load, precompile, capture {t0 - start:.1f} s ({c0}), "
        f"sampler variants {t1 - t0:.1f} s ({c1 - c0}), warm-up requests {t2 - t1:.1f} s ({c2 - c1}); "
        f"after the warm-up: {len(after)} compiles"
    )
    by_kernel = collections.Counter(line.split(":")[0] for line in compiles[:built])
    print("  compiled in the build, per kernel:", dict(sorted(by_kernel.items())))
    for line in after:
        print("  new:", line[:300])
    assert after == []
