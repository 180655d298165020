"""Batch-invariant mode on CPU (the tiny model): DeepInfer's test with ``==`` (walkthrough Pass 3, "When
the same prompt must give the same answer"), chunked prefill at several budgets, and forced tokens.

Every comparison is Python ``==`` on floats: the mode's promise is bits, not closeness."""

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.config import EngineConfig
from services.worker.build import build_runner

NUM_PROMPTS = 16
NUM_TOKENS = 16


pytestmark = pytest.mark.usefixtures("pools_checked_after_every_step")  # conftest.py


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 129_000, (n,), generator=g).tolist()


def _answer(out) -> tuple:
    return out.token_ids, out.logprobs, out.top_logprobs


@pytest.fixture(scope="module")
def llm():
    # A 48-token prefill budget splits the longer prompts across steps, and mixes prompts in one step.
    return LLM(model="tiny", block_size=16, max_num_batched_tokens=48, max_num_seqs=NUM_PROMPTS, batch_invariant=True)


def test_a_batch_and_each_prompt_alone_forced_to_its_tokens_are_equal(llm):
    prompts = [_prompt(k, 5 + 7 * k) for k in range(NUM_PROMPTS)]  # 5 … 110 tokens
    params = [
        SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_p=0.7, logprobs=5, seed=1000 + k, ignore_eos=True)
        for k in range(NUM_PROMPTS)
    ]
    batch = llm.generate(prompts, params)
    for k, (prompt, p, together) in enumerate(zip(prompts, params, batch)):
        assert len(together.token_ids) == NUM_TOKENS
        forced = SamplingParams(
            max_tokens=NUM_TOKENS,
            temperature=1.0,
            top_p=0.7,
            logprobs=5,
            seed=7 + k,
            ignore_eos=True,
            forced_token_ids=tuple(together.token_ids),
        )
        alone = llm.generate(prompt, forced)[0]
        assert _answer(alone) == _answer(together), f"prompt {k} differs alone"
    s = llm.stats()
    assert s.free_blocks == s.total_blocks and s.free_state_slots == s.total_state_slots


class _LogitsRecorder:
    """The runner, with every sampled row's logits recorded per request id."""

    def __init__(self, runner):
        self.runner = runner
        self.logits: dict[str, list[torch.Tensor]] = {}

    def execute(self, plan, *args, **kwargs):
        out = self.runner.execute(plan, *args, **kwargs)
        row = 0
        for request_id, n in zip(plan.request_ids, plan.num_sample_rows.tolist()):
            self.logits.setdefault(request_id, []).extend(out.logits[row : row + n].clone())
            row += n
        return out

    def release(self, request_id):
        self.runner.release(request_id)


@pytest.mark.parametrize("budget", [16, 40, 256])
def test_chunked_prefill_at_any_budget_gives_equal_logits(llm, budget):
    """The same two requests at three prefill budgets (one chunk, or many, beside the other request):
    every sampled row's logits are equal under ``==`` to the 256-token budget's."""
    prompts = [_prompt(50, 100), _prompt(51, 37)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    results = {}
    for b in sorted({budget, 256}):
        args = dict(block_size=16, max_num_batched_tokens=b, max_num_seqs=4, batch_invariant=True)
        recorder = _LogitsRecorder(build_runner(llm.source.model, EngineConfig(**args).worker_config()))
        run = LLM(model="tiny", source=llm.source, runner=recorder, **args)
        outs = run.generate(prompts, params)
        results[b] = [torch.stack(recorder.logits[o.request_id]) for o in outs]
    for mine, full in zip(results[budget], results[256]):
        assert torch.equal(mine, full)


def test_forced_tokens_are_output_with_their_processed_logprobs(llm):
    prompt = _prompt(3, 20)
    free = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    forced_ids = (free.top_logprobs[0][2][0], free.token_ids[1], 17)  # the 3rd-ranked token first
    out = llm.generate(
        prompt, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True, forced_token_ids=forced_ids)
    )[0]
    assert tuple(out.token_ids[:3]) == forced_ids
    assert out.logprobs[0] == free.top_logprobs[0][2][1]  # its logprob where it ranked 3rd
    assert out.top_logprobs[0] == free.top_logprobs[0]
    assert out.token_ids[3] == max(out.top_logprobs[3], key=lambda t: (t[1], -t[0]))[0]  # greedy resumes


def test_forced_token_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match="forced_token_ids"):
        llm.generate(_prompt(4, 8), SamplingParams(max_tokens=2, forced_token_ids=(200_000,)))


@pytest.mark.parametrize("threads, capability", [(1, "default"), (2, "avx2")])
def test_the_mode_holds_under_other_thread_counts_and_cpu_capabilities(threads, capability):
    """The probe in a fresh process (both settings are read at torch's import); the in-process tests above
    cover this machine's own defaults."""
    import json
    import os
    import subprocess
    import sys

    # The CPU's own capability, read without ATEN_CPU_CAPABILITY (this process's may be capped by it).
    native = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    cpu = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=native,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.strip()
    if capability == "avx2" and cpu not in ("AVX2", "AVX512"):
        pytest.skip(f"this CPU has no AVX2 ({cpu})")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run(
        [sys.executable, "-m", "tests.services.engine.batch_invariant_probe"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["capability"] == capability.upper()
    assert result["alone_equal"] == [True] * 4 and result["prefix_equal"]


# ---------------------------------------------------------------- CUDA: the kernel backend's form of the mode


def cuda(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


@cuda
def test_gpu_batch_and_each_prompt_alone_are_equal_with_graphs_eager_and_async_off():
    """The tiny model on the FP8 kernel backend: the walkthrough's test (a batch, then each prompt alone
    forced to its tokens) with CUDA graphs and async scheduling on (the CUDA defaults), and the same
    batch with graphs off (eager decode steps) and with async scheduling off: all ``==``."""
    prompts = [_prompt(k, 5 + 7 * k) for k in range(NUM_PROMPTS)]
    params = [
        SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_p=0.7, logprobs=5, seed=1000 + k, ignore_eos=True)
        for k in range(NUM_PROMPTS)
    ]
    args = dict(
        model="tiny",
        device="cuda",
        block_size=16,
        max_num_batched_tokens=48,
        max_num_seqs=NUM_PROMPTS,
        num_blocks=256,
        num_state_slots=NUM_PROMPTS + 1,
        max_model_len=256,
        batch_invariant=True,
    )
    llm = LLM(**args)
    assert llm.config.kernel_backend == "fp8" and llm.config.cuda_graphs and llm.config.async_scheduling
    batch = llm.generate(prompts, params)
    for k, (prompt, together) in enumerate(zip(prompts, batch)):
        forced = SamplingParams(
            max_tokens=NUM_TOKENS,
            temperature=1.0,
            top_p=0.7,
            logprobs=5,
            seed=7 + k,
            ignore_eos=True,
            forced_token_ids=tuple(together.token_ids),
        )
        assert _answer(llm.generate(prompt, forced)[0]) == _answer(together), f"prompt {k} differs alone"
    resolved = {f: getattr(llm.config, f) for f in llm.config.__dataclass_fields__}  # the CUDA defaults
    for switch in ({"enforce_eager": True, "cuda_graphs": False}, {"async_scheduling": False}):
        other = LLM(source=llm.source, **{**resolved, **switch}).generate(prompts, params)
        assert [_answer(o) for o in other] == [_answer(o) for o in batch], f"{switch} differs"
