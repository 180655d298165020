"""The warm-up before ready: synthetic requests through the engine's own step loop, so every kernel variant a
step can take is compiled before the first real request (docs/performance.md, "Kernel variants").

A Triton kernel compiles once per specialisation key: its constexprs, the launch options and the specialised
properties of its integer and pointer arguments. The kernels keep that set small and enumerable (the step-sized
integers are ``do_not_specialize``; the constexprs that follow a step's token count T or its context width W take
one value per power of two of it), so a handful of steps covers it:

- **token buckets**: one prompt of every power of two up to the step budget (and the budget itself), each alone
  with one output token: a prefill step of that many rows (the decode graphs were captured at build);
- **decode rows**: for every power of two of rows up to ``max_num_seqs``, that many short requests at once: a
  decode step of that many rows (a graph replay where the sizes were captured, an eager step otherwise);
- **context widths**: one long prompt (``max_context`` tokens, default ``max_model_len`` up to ``MAX_CONTEXT``)
  prefilled in budget-sized chunks while a short request decodes beside it: mixed steps (or, scheduled
  ``separate``, prefill and decode steps) at every power of two of the context, the compressed layers' widths
  with it;
- **prefix-cache hits**: with prefix caching, two requests that resume from the long prompt's cached blocks at
  different offsets; the cache is cleared afterwards and its events dropped, so no warm-up block is announced;
- **sampling**: first the sampler kernel's variants, compiled without a launch and in parallel threads
  (``KernelSampler.compile_variants``: the rows' parameters, not the step's shape, pick them; not with drafts,
  whose steps never run the kernel); then the greedy requests above, and one seeded request with temperature,
  top-p, top-k, min-p, penalties and logprobs.

With speculative decoding every decode step above verifies drafts (1 + k rows a request, or varlen's choice per
request) and the draft proposes a block for each request: a verify step's rows run the prompt path, whose variants
follow the rows' power of two, which the token buckets cover (every power of two up to the budget, and the budget
holds ``max_num_seqs × (1 + k)``); the draft's call for B requests has B · block rows, and as the power of two of
B · m for B between 2ʲ and 2ʲ⁺¹ is that of 2ʲ · m or twice it, the decode groups' counts cover every B. The CPU
test with drafts (fixed and varlen) finds no key the warm-up missed.
``progress(phase, done, total)`` is called with the phase ``"compiling"`` after the sampler's variants and after
each warm-up request ends (``done`` of ``total``), so a readiness report can show it; the caller decides when the
engine counts as ready (after ``warm_up`` returns).

Before any of that, while the weights load, the variants an earlier start of the same engine compiled are compiled
at once in a thread pool from its compile manifest (services/engine/precompile.py), and this start's compiles are
recorded for the next one: the profiling step, the captures and the steps above then find those variants compiled.
On a first start (no manifest) they compile one at a time as they are launched.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams

log = logging.getLogger("shinkai.engine")

PHASE = "compiling"
MAX_CONTEXT = 65_536
"""The long prompt's length at most (about 7 s of prefill at v41-s1's full depth): contexts past it compile their
selection buckets (one per power of two) on first use."""
Progress = Callable[[str, int, int], None]
"""(phase, done, total): the readiness report's hook."""


@dataclass(frozen=True)
class WarmupRequest:
    """One synthetic request of the warm-up."""

    prompt_length: int  # prompt tokens
    max_tokens: int  # output tokens (ignore_eos: always this many)
    prefix_of: int | None = None  # resumes from the first this-many tokens of the long prompt (prefix cache), or None
    sampled: bool = False  # seeded sampling with every processing option on, else greedy
    beside_long: bool = False  # decodes while the long prompt prefills (added just before it)
    copies: int = 1  # added at once, different prompts: decode steps of this many rows


def token_buckets(budget: int) -> list[int]:
    """Every power of two up to the step budget, and the budget: the step sizes a prefill can fall into."""
    sizes, n = [], 1
    while n < budget:
        sizes.append(n)
        n *= 2
    return [*sizes, budget]


def plan_warmup(
    budget: int,
    max_model_len: int,
    block_size: int,
    prefix_caching: bool,
    max_num_seqs: int = 1,
    max_context: int | None = None,
) -> list[WarmupRequest]:
    """The warm-up's requests, in order (module docstring)."""
    room = max_model_len - 2  # a prompt leaves room for two output tokens
    # One output token: the prefill step alone (decode steps come with the request beside the long prompt).
    requests = [WarmupRequest(min(n, room), 1) for n in token_buckets(budget) if n <= room]
    # Decode steps of every power of two of rows (graph replays where graphs are captured, eager steps otherwise).
    requests += [WarmupRequest(min(2, room), 2, copies=n) for n in token_buckets(max_num_seqs)]
    long = min(room, max_context or MAX_CONTEXT)
    chunks = -(-long // budget)
    requests.append(WarmupRequest(min(3, room), min(chunks + 4, max_model_len - 3), beside_long=True))
    requests.append(WarmupRequest(long, 1))
    if prefix_caching and long > 2 * block_size:
        # Resume after one cached block, and after most of them: two offsets, a chunk's worth of new tokens each.
        for cached in (block_size + 1, (long // block_size - 1) * block_size + 1):
            requests.append(WarmupRequest(min(room, cached + min(budget, room - cached)), 1, prefix_of=cached))
    requests.append(WarmupRequest(min(5, room), 3, sampled=True))
    return requests


def _params(request: WarmupRequest) -> SamplingParams:
    if not request.sampled:
        return SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(
        max_tokens=request.max_tokens,
        temperature=0.8,
        top_p=0.9,
        top_k=20,
        min_p=0.01,
        seed=0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logprobs=2,
        ignore_eos=True,
    )


def warm_up(
    engine: Engine,
    progress: Progress | None = None,
    max_context: int | None = None,
    compiled_ahead: Callable[[], object] | None = None,
) -> int:
    """Runs ``plan_warmup``'s requests through ``engine`` until all have ended; returns the steps it took. The
    engine must be idle (no request); it is idle again afterwards, its prefix cache empty."""
    if engine.has_unfinished():
        raise RuntimeError("the warm-up runs before the engine takes requests")
    config = engine.config
    plan = plan_warmup(
        config.max_num_batched_tokens,
        config.max_model_len,
        config.block_size,
        engine.prefix_cache_enabled,
        config.max_num_seqs,
        max_context,
    )
    # Ordinary tokens: not the end token, not an image placeholder, not below 3 (the special ids of the presets).
    banned = {engine.eos_token_id, engine.image_token_id}
    vocabulary = [t for t in range(3, engine.vocab_size) if t not in banned]
    rng = random.Random(0)
    long_prompt = [rng.choice(vocabulary) for _ in range(max(r.prompt_length for r in plan))]
    start, steps, done = time.perf_counter(), 0, 0
    total = sum(r.copies for r in plan) + 1
    if progress is not None:
        progress(PHASE, 0, total)
    # The sampler kernel's variants first, compiled at once in threads (their rows' parameters, not the step's
    # shape, pick them: the requests below reach only a few). With drafts the speculator processes every step's
    # logits in torch and the kernel never runs.
    sampler = getattr(engine.worker, "sampler", None)
    speculating = getattr(engine.worker, "speculator", None) is not None
    compile_variants = None if speculating else getattr(sampler, "compile_variants", None)
    if compiled_ahead is not None:  # the sampler's variants compiled in other processes: read from Triton's cache
        compiled_ahead()
    num_sampler_variants = (
        0 if compile_variants is None else compile_variants(engine.vocab_size, config.device or "cpu")
    )

    def one_done() -> None:  # the sampler's variants, or a request ended or refused
        nonlocal done
        done += 1
        if progress is not None:
            progress(PHASE, done, total)

    one_done()

    def step_until(finished: Callable[[], bool]) -> None:
        nonlocal steps
        while not finished():
            for out in engine.step():
                if out.finished:
                    one_done()
            steps += 1

    for i, request in enumerate(plan):
        params = _params(request)
        for copy in range(request.copies):
            if request.prefix_of is not None:
                fresh = [rng.choice(vocabulary) for _ in range(request.prompt_length - request.prefix_of)]
                prompt = long_prompt[: request.prefix_of] + fresh
            elif request.prompt_length == len(long_prompt):
                prompt = long_prompt
            else:
                prompt = [rng.choice(vocabulary) for _ in range(request.prompt_length)]
            try:
                engine.validate(prompt, params)
            except ValueError as e:  # e.g. penalties on a remote worker: that variant is never served either
                log.info("warm-up: skipped a request the engine refuses (%s)", e)
                one_done()
                continue
            engine.add_request(f"warmup-{i}-{copy}", prompt, params)
        if request.beside_long:
            step_until(lambda: not engine.scheduler.stats().num_waiting)  # its prefill: it decodes from now on
        else:
            step_until(lambda: not engine.has_unfinished())
    if engine.hashes is not None:
        engine.scheduler.clear_prefix_cache()
        engine.take_kv_events()  # nothing of the warm-up reaches a router
    log.info(
        "warm-up: %d sampler variants, %d requests, %d steps in %.1f s",
        num_sampler_variants,
        total - 1,
        steps,
        time.perf_counter() - start,
    )
    return steps
