"""Prefix-caching benchmark: a multi-turn workload and an agent workload, each run with the cache on and off.

- multi-turn: ``conversations`` conversations of ``turns`` turns; each turn adds ``user_tokens`` random tokens
  to the history and generates ``answer_tokens`` (greedy, ``ignore_eos``); all conversations' turn k are
  queued together, and turn k + 1 resends the whole history;
- agent: ``requests`` requests sharing a ``shared_tokens`` prefix, each with its own ``suffix_tokens``, queued in
  waves of ``wave`` (a loop's calls arrive over time; the engine learns the shared prefix from the first ones).

Per turn (or wave): TTFT p50 and p99 (queued → first token), the engine steps from queued to each request's first
token (mean and max: the snapshot policy's chunk cuts show here on any device), the steps the round took, the
prefill tokens the engine computed (prompt-chunk rows planned), and the prompt tokens; per run: output tokens per
second over the whole run and the steps summed. The on and off runs
use one engine each, built in turn with the device's defaults (on CUDA: the kernel backend, CUDA graphs, async
scheduling).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_IDS = itertools.count()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="a preset or checkpoint directory (default tiny)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--workload", choices=("multi-turn", "agent", "both"), default="both")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-tokens", type=int, default=512)
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--shared-tokens", type=int, default=4096)
    p.add_argument("--suffix-tokens", type=int, default=256)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--wave", type=int, default=8, help="agent requests queued together (default 8)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: what the workloads need")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the larger of conversations and wave")
    p.add_argument("--json", dest="json_path", help="write the figures as JSON here")


def _tokens(g: torch.Generator, vocab: int, n: int) -> list[int]:
    import torch  # here, not at import: `shinkai`'s parser imports this module for its flags

    return torch.randint(3, vocab - 1, (n,), generator=g).tolist()


def _round(llm, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    """Queues ``prompts`` together and steps until all end: (figures, each request's output tokens)."""
    import torch

    from services.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.scheduler.stats().num_prefill_tokens
    ids = [f"bench-{next(_IDS)}" for _ in prompts]
    queued = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    first: dict[str, float] = {}
    first_step: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    num_steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        num_steps += 1
        for out in outs:
            now = time.perf_counter()
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = now - queued
                first_step[out.request_id] = num_steps
            if out.finished:
                outputs[out.request_id] = list(out.token_ids)
    ttft = torch.tensor([first[i] for i in ids])
    ttft_steps = torch.tensor([float(first_step[i]) for i in ids])
    return {
        "prompt_tokens": sum(len(p) for p in prompts),
        "prefill_tokens_computed": engine.scheduler.stats().num_prefill_tokens - before,
        "ttft_p50_s": round(float(ttft.quantile(0.5)), 4),
        "ttft_p99_s": round(float(ttft.quantile(0.99)), 4),
        "ttft_steps_mean": round(float(ttft_steps.mean()), 2),
        "ttft_steps_max": int(ttft_steps.max()),
        "steps": num_steps,
        "output_tokens": sum(len(o) for o in outputs.values()),
        "wall_s": round(time.perf_counter() - queued, 4),
    }, [outputs[i] for i in ids]


def multi_turn(llm, args: argparse.Namespace, vocab: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(1)
    histories = [[] for _ in range(args.conversations)]
    turns = []
    for _ in range(args.turns):
        histories = [h + _tokens(g, vocab, args.user_tokens) for h in histories]
        figures, answers = _round(llm, histories, args.answer_tokens)
        histories = [h + a for h, a in zip(histories, answers)]
        turns.append(figures)
    return turns


def agent(llm, args: argparse.Namespace, vocab: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(2)
    shared = _tokens(g, vocab, args.shared_tokens)
    prompts = [shared + _tokens(g, vocab, args.suffix_tokens) for _ in range(args.requests)]
    return [_round(llm, prompts[i : i + args.wave], args.answer_tokens)[0] for i in range(0, len(prompts), args.wave)]


def _summary(rounds: list[dict]) -> dict:
    wall = sum(r["wall_s"] for r in rounds)
    return {
        "prompt_tokens": sum(r["prompt_tokens"] for r in rounds),
        "prefill_tokens_computed": sum(r["prefill_tokens_computed"] for r in rounds),
        "steps": sum(r["steps"] for r in rounds),
        "output_tokens_per_s": round(sum(r["output_tokens"] for r in rounds) / wall, 1) if wall else None,
    }


def main(args: argparse.Namespace) -> int:
    import torch

    from services.engine import LLM

    needed = max(
        args.turns * (args.user_tokens + args.answer_tokens),
        args.shared_tokens + args.suffix_tokens + args.answer_tokens,
    )
    max_model_len = args.max_model_len or needed
    max_num_seqs = args.max_num_seqs or max(args.conversations, args.wave)
    results: dict[str, dict] = {}
    for caching in (False, True):  # one engine at a time, each with the device's defaults (LLM builds the model)
        llm = LLM(
            model=args.model,
            load_format=args.load_format,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=caching,
        )
        vocab = llm.source.config.vocab_size
        run: dict[str, object] = {}
        if args.workload in ("multi-turn", "both"):
            turns = multi_turn(llm, args, vocab)
            run["multi_turn"] = {"turns": turns, **_summary(turns)}
        if args.workload in ("agent", "both"):
            waves = agent(llm, args, vocab)
            run["agent"] = {"waves": waves, **_summary(waves)}
        results["on" if caching else "off"] = run
        _save(args, results)  # after each run: a run cut short by a time limit keeps the one before
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for name in ("multi_turn", "agent"):
        if name in results["on"]:
            off, on = results["off"][name], results["on"][name]
            print(
                f"{name}: prefill tokens computed {off['prefill_tokens_computed']} off, "
                f"{on['prefill_tokens_computed']} on (of {on['prompt_tokens']} prompt tokens); "
                f"steps {off['steps']} off, {on['steps']} on; "
                f"output tok/s {off['output_tokens_per_s']} off, "
                f"{on['output_tokens_per_s']} on"
            )
    return 0


def _save(args: argparse.Namespace, results: dict[str, dict]) -> None:
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"args": vars(args) | {"func": None}, **results}, indent=2))
