"""Speculative decoding's speed: tokens/s with the DSpark draft against speculation off, at forced
acceptance rates (``shinkai bench speculative``; its GPU table is in docs/speculative.md).

Random weights accept almost no draft, so each draft is accepted independently with probability a
(services/worker/spec/forced_acceptance.py); the target still verifies every draft row and the draft still
proposes every block (but where varlen's back-off skips a request whose proposals it never verifies:
``proposals_skipped``), so the step costs are real. Speculation off at every batch size, then for every mode
(fixed: 1 + n rows per request; varlen: the rows MtpVarlen picks from the forced chances a^(j+1) and the
step-cost curve measured from the engine's own decode steps, reported after each run as ``step_cost_means``:
mean ms and steps per request bucket and graph size) every batch size and every a, on one engine a mode (the
forced verdict swapped between runs). Each run is greedy with ``ignore_eos`` (every request makes exactly ``max_tokens``
tokens) through ``generate.run_batch``: total tokens/s over the wall time (prefill included), decode-only
tokens/s, and per request (total / batch, as every request runs the whole time).

Every case runs on the same path, "off" included, for a like-for-like ratio: the torch model by default, or
the kernel backend (``--kernel-backend``) with CUDA graphs (``--cuda-graphs``: every decode step, verify steps
included, replays one; every row-counting size is captured when each case's engine is built), synchronously
unless ``--async-scheduling``. Stdlib-only at import (the CLI registers it); torch loads when it runs.

Each row also says where a step's time goes (a step with drafts can cost several steps without):
``eager_steps`` and ``graph_replays`` of the timed run (the DecodeStepGraphs's: a decode step outside a captured size
runs eagerly), ``draft_graph_captures`` in all and ``draft_graph_captures_timed`` inside the timed run (a capture
there means the warm-up saw another ``ProposalKey``; ``draft_keys`` and ``draft_keys_timed``: the keys the static
proposal has seen, in all and first inside the timed run, also without graphs, ``--static-proposal``),
``verify_graph_captures``/``verify_keys`` and their ``_timed`` the same for the static verify
(services/worker/spec/static_verify.py),
the worker's host ms per step (``worker_ms_per_step``:
``Worker.execute``, the runner's launch or eager run, the sampler, and with drafts the speculator, whose one read
waits for the device), and with drafts the speculator's host ms per step by phase (``spec_ms_per_step``,
services/worker/spec/timings.py). All are host ``perf_counter`` times around the existing calls; no sync is added.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def build(
    source,
    engine_args: dict,
    nextn: int,
    varlen: bool,
    acceptance: float | None,
    spec_sampling: str = "rejection",
    static_proposal: bool | None = None,
):
    """An LLM on ``source``: speculation off (nextn 0) or on with forced acceptance ``acceptance``; the draft's
    proposal replays CUDA graphs with ``cuda_graphs`` (``static_proposal``: the static proposal, see
    ``Speculator``), captured here for every bucket up to max_num_seqs (greedy requests: the benchmark's)."""
    from services.engine import LLM
    from services.engine.config import EngineConfig
    from services.worker.build import build_worker
    from services.worker.spec.forced_acceptance import ForcedAcceptance

    if not nextn:
        return LLM(source=source, **engine_args)
    args = dict(engine_args, num_speculative_tokens=nextn, spec_varlen=varlen, spec_sampling=spec_sampling)
    config = EngineConfig(**args)
    # every draft key a greedy batch can ask for and every verify key, captured before any timing
    worker = build_worker(
        source.model,
        config.worker_config(),
        static_proposal=static_proposal,
        greedy_only=True,
        forced_acceptance=ForcedAcceptance(acceptance if acceptance is not None else 0.0),
    )
    return LLM(source=source, worker=worker, **args)


def counters(llm) -> dict:
    """The worker's step counters now (None where its runner or speculator has none)."""
    worker = llm.engine.worker
    runner, spec = getattr(worker, "runner", None), getattr(worker, "speculator", None)
    graphs, verifies = getattr(spec, "draft_graphs", None), getattr(spec, "verify_graphs", None)
    return {
        "eager_steps": getattr(runner, "num_eager", None),
        "graph_replays": getattr(runner, "num_replays", None),
        "draft_graph_captures": getattr(graphs, "num_captures", None),
        "draft_keys": None if graphs is None else len(graphs.static),
        "verify_graph_captures": getattr(verifies, "num_captures", None),
        "verify_keys": None if verifies is None else len(verifies.static),
    }


@contextmanager
def timed_worker(llm) -> Iterator[list[float]]:
    """Within the block, the worker's ``execute`` (an instance attribute over the method) adds each call's host
    seconds to the yielded list; the previous ``execute`` is back after it."""
    import time

    worker = llm.engine.worker
    execute, seconds = worker.execute, []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    worker.execute = timed
    try:
        yield seconds
    finally:
        worker.execute = execute


def step_counters(before: dict, after: dict, worker_s: list[float]) -> dict:
    """The benchmark row's step fields (see the module docstring) from ``counters`` around the timed run."""

    def delta(name: str):
        return None if after[name] is None else after[name] - before[name]

    out = {
        "worker_steps": len(worker_s),
        "worker_ms_per_step": round(1000 * sum(worker_s) / len(worker_s), 3) if worker_s else None,
        "eager_steps": delta("eager_steps"),
        "graph_replays": delta("graph_replays"),
        "draft_graph_captures": after["draft_graph_captures"],
        "draft_graph_captures_timed": delta("draft_graph_captures"),
        "draft_keys": after["draft_keys"],
        "draft_keys_timed": delta("draft_keys"),
        "verify_graph_captures": after["verify_graph_captures"],
        "verify_graph_captures_timed": delta("verify_graph_captures"),
        "verify_keys": after["verify_keys"],
        "verify_keys_timed": delta("verify_keys"),
    }
    return out


def profile_run(llm, batch: int, prompt_len: int, device: str, max_tokens: int) -> dict:
    """The kernels of a short extra run at ``batch`` (its prefill included, one step of ``steps``), per step: the
    device's busy ms, launches and the top kernels (``step_profile``'s tables), after the timed run."""
    import time

    import torch

    from services.bench.generate import run_batch
    from services.bench.step.profile import device_trace, profile_summary

    with timed_worker(llm) as seconds, device_trace(torch.device(device)) as prof:
        t0 = time.perf_counter()
        run_batch(llm, batch, prompt_len, max_tokens, seed=batch + 1)
        wall = time.perf_counter() - t0
    steps = max(1, len(seconds))
    return {"steps": steps, **profile_summary(prof, wall, steps)}


def run_case(llm, spec, batch: int, args: argparse.Namespace, device: str) -> dict:
    """One timed run at ``batch`` on ``llm`` after a warm-up at it (CUDA graphs of its sizes captured, the draft's
    lazily; varlen's first step times): the run's figures, the step counters and the speculator's as deltas."""
    from services.bench.generate import run_batch

    run_batch(llm, batch, args.prompt_len, 4, seed=99)
    before = counters(llm)
    spec_before = spec_counters(spec)
    if spec is not None:
        spec.timings.reset()  # the phase times of the timed run only
    with timed_worker(llm) as worker_s:
        r = run_batch(llm, batch, args.prompt_len, args.max_tokens, seed=batch)
    r.update(step_counters(before, counters(llm), worker_s))
    r.update({k: v - spec_before[k] for k, v in spec_counters(spec).items()})
    r.update(
        spec_steps=spec.timings.num_steps if spec else 0,
        spec_ms_per_step={k: round(v, 3) for k, v in spec.timings.ms_per_step().items()} if spec else None,
    )
    meter = llm.engine.step_cost  # varlen's measured curve after the run (None without it)
    r["step_cost_means"] = (
        None
        if meter is None
        else {  # per request bucket, per graph size: [ms, steps]
            str(bucket): {str(k): [round(ms, 3), n] for k, (ms, n) in means.items()}
            for bucket, means in meter.all_means().items()
        }
    )
    if args.profile:
        r["profile"] = profile_run(llm, batch, args.prompt_len, device, min(24, args.max_tokens))
    return r


def spec_counters(spec) -> dict:
    """The speculator's life-long counts now (all 0 without one)."""
    return {
        "drafts_verified": spec.num_drafts_verified if spec else 0,
        "drafts_accepted": spec.num_drafts_accepted if spec else 0,
        "proposals_skipped": spec.num_proposals_skipped if spec else 0,
    }


def report(r: dict, batch: int, mode: str, a: float | None, profile: bool) -> None:
    a_text = "" if a is None else f" a={a:<4}"
    print(
        f"batch {batch:>3} {mode:>6}{a_text}: {r['tokens_per_s']:>9.1f} tokens/s "
        f"({r['tokens_per_s_per_request']:.1f} per request; decode {r['decode_tokens_per_s']}), "
        f"{r['speedup_vs_off']:.2f}x off; drafts accepted {r['drafts_accepted']} of {r['drafts_verified']}; "
        f"proposals skipped {r['proposals_skipped']}"
    )
    print(
        f"    {r['worker_steps']} steps, worker {r['worker_ms_per_step']} host ms/step; eager steps "
        f"{r['eager_steps']}, graph replays {r['graph_replays']}; draft graph captures "
        f"{r['draft_graph_captures']} ({r['draft_graph_captures_timed']} in the timed run), keys {r['draft_keys']} "
        f"({r['draft_keys_timed']} new in it); verify graph captures {r['verify_graph_captures']} "
        f"({r['verify_graph_captures_timed']} in the timed run), keys {r['verify_keys']} "
        f"({r['verify_keys_timed']} new in it); "
        f"speculator host ms/step {r['spec_ms_per_step']}"
    )
    if profile:
        prof = r["profile"]
        print(
            f"    profile of {prof['steps']} steps: {prof['busy_ms']:.3f} ms busy, "
            f"{prof['launches_per_step']:.0f} launches a step; top kernels (µs/step, launches/step):"
        )
        for k in prof["kernels"][:12]:
            print(f"      {k['us_per_step']:9.1f} {k['launches_per_step']:6.1f}  {k['kernel'][:90]}")


def main(args: argparse.Namespace) -> int:
    import torch

    from services.engine.model_source import load_model
    from services.worker.spec.forced_acceptance import ForcedAcceptance

    torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # With the kernel backend on CUDA the model is built straight into its form (GPU-only presets need it).
    precision = args.kernel_backend if device.startswith("cuda") else None
    source = load_model(args.model, device=device, precision=precision)
    nextn = args.num_speculative_tokens
    engine_args = dict(
        device=device,
        kernel_backend=args.kernel_backend,
        cuda_graphs=args.cuda_graphs,
        async_scheduling=args.async_scheduling,
        max_num_seqs=max(args.batch),
        max_model_len=args.prompt_len + args.max_tokens + nextn + 8,
        block_size=args.block_size,
    )
    machine = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor(),
        "model": args.model,
        "torch": torch.__version__,
        "torch_threads": args.threads,
        "kernel_backend": args.kernel_backend,
        "cuda_graphs": args.cuda_graphs,
    }
    results, off_tps = [], {}
    # One engine per mode (its build, pools and graphs do not depend on the batch or on a), every batch and a run
    # on it in turn: the forced verdict is swapped between runs and the speculator's counters taken as deltas.
    for mode in ["off"] + list(args.modes):
        llm = build(
            source,
            engine_args,
            0 if mode == "off" else nextn,
            mode == "varlen",
            None,
            static_proposal=args.static_proposal or None,
        )
        allocated_gb = torch.cuda.memory_allocated() / 2**30 if device.startswith("cuda") else None
        spec = getattr(llm.engine.worker, "speculator", None)
        for batch in args.batch:
            for a in [None] if mode == "off" else args.acceptance:
                if spec is not None:
                    spec.forced_acceptance = ForcedAcceptance(a)
                r = run_case(llm, spec, batch, args, device)
                r.update(
                    mode=mode,
                    acceptance=a,
                    num_speculative_tokens=0 if mode == "off" else nextn,
                    tokens_per_s_per_request=round(r["tokens_per_s"] / batch, 2),
                    allocated_gb_after_build=None if allocated_gb is None else round(allocated_gb, 2),
                )
                if mode == "off":
                    off_tps[batch] = r["tokens_per_s"]
                r["speedup_vs_off"] = round(r["tokens_per_s"] / off_tps[batch], 3)
                results.append(r)
                report(r, batch, mode, a, args.profile)
                if args.json_path:  # after every case, so a run cut short keeps what it measured
                    Path(args.json_path).write_text(json.dumps({"machine": machine, "results": results}, indent=2))
        del llm, spec
        gc.collect()  # the engine's pools and graphs go before the next mode's engine sizes its own
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"machine: {machine}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset or checkpoint (default tiny)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="batch sizes (default 1 16 64)")
    p.add_argument(
        "--acceptance",
        type=float,
        nargs="+",
        default=[0.0, 0.5, 0.8, 1.0],
        help="forced per-draft acceptance probabilities a (default 0 0.5 0.8 1)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=("fixed", "varlen"),
        default=["fixed", "varlen"],
        help="verification modes (default fixed varlen)",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=5, help="drafts per request (default 5)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--block-size", type=int, default=128, help="paged block size (default 128)")
    p.add_argument(
        "--kernel-backend", choices=("fp8", "fp32"), help="the Triton kernel backend (default: the torch model)"
    )
    p.add_argument("--cuda-graphs", action="store_true", help="replay CUDA graphs for decode (needs --kernel-backend)")
    p.add_argument(
        "--static-proposal",
        action="store_true",
        help="the draft proposes through the static proposal (what --cuda-graphs captures), eagerly "
        "without graphs (default: with --cuda-graphs only)",
    )
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="plan step N+1 while step N runs (off by default with speculation)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="after each case's timed run, profile a short run: device ms and launches per step, top kernels",
    )
    p.add_argument("--json", dest="json_path", help="write the figures as JSON here")


if __name__ == "__main__":  # python -m services.bench.speculative.run (the same as `shinkai bench speculative`)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
