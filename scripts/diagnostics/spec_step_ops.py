"""Eager aten ops per speculative step outside the CUDA graphs, by phase: where a step's time goes.

On the CPU, tiny, the DecodeStepGraphs's static decode step, the static verify and the static draft proposal run
eagerly (``use_graphs=False``: the code the graphs capture); ops inside ``StaticDecodeStep.run``,
``StaticVerify.run`` and ``StaticDraftProposal.run`` are what one replay each does on the GPU, every other
non-view op is an eager op there (a launch, or host work on a host tensor). Forced acceptance, greedy, batch 1
by default (``--spec-sampling``: a verifier instead, with the draft's own drafts); ``--eager-verify`` runs the verify
half eagerly instead (verifier, write_context, emitted_output).

    python scripts/diagnostics/spec_step_ops.py [--batch 1] [--acceptance 0] [--max-tokens 16] [--eager-verify]
        [--spec-sampling forced|rejection|deterministic] [--op-names]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import services.worker.spec.speculator as speculator_module
from services.bench.generate import run_batch
from services.engine import LLM
from services.engine.config import EngineConfig
from services.engine.model_source import load_model
from services.worker.runners.decode_step_graphs import DecodeStepGraphs
from services.worker.runners.model_runner import ModelRunner
from services.worker.runners.static_decode_step import StaticDecodeStep
from services.worker.sampling.sampler import Sampler
from services.worker.spec.forced_acceptance import ForcedAcceptance
from services.worker.spec.speculator import Speculator
from services.worker.spec.static_draft_proposal import StaticDraftProposal
from services.worker.spec.static_verify import StaticVerify
from services.worker.worker import Worker

VIEWS = {
    "view",
    "_unsafe_view",
    "select",
    "slice",
    "unsqueeze",
    "squeeze",
    "t",
    "permute",
    "expand",
    "detach",
    "alias",
    "lift_fresh",
    "as_strided",
    "transpose",
    "split",
    "unbind",
    "_reshape_alias",
    "split_with_sizes",
    "chunk",
    "unflatten",
    "reshape",
    "flatten",
    "narrow",
    "diagonal",
    "real",
    "empty",
}
"""Ops that make no kernel launch (views, metadata, uninitialised allocation)."""
GRAPHS = ("graph: decode step", "graph: draft proposal", "graph: verify")


class Phases(TorchDispatchMode):
    """Counts non-view aten ops under the innermost phase ``wrap`` entered."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "other"
        self.ops: collections.Counter = collections.Counter()
        self.names: collections.Counter = collections.Counter()  # (phase, op name) → count
        self.seconds: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in VIEWS:
            self.ops[self.phase] += 1
            self.names[self.phase, name] += 1
        return func(*args, **(kwargs or {}))

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def wrapped(*args, **kwargs):
            outer, self.phase, t0 = self.phase, phase, time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - t0
                self.phase = outer

        setattr(owner, name, wrapped)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--acceptance", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--eager-verify", action="store_true", help="the verify half eagerly (no static verify)")
    p.add_argument(
        "--spec-sampling",
        choices=("forced", "rejection", "deterministic"),
        default="forced",
        help="forced: the benchmark's acceptance (--acceptance); else that verifier with the draft's own "
        "drafts (greedy rows)",
    )
    p.add_argument("--op-names", action="store_true", help="also list each phase's ops by name")
    args = p.parse_args()
    torch.set_num_threads(1)
    source = load_model("tiny", device="cpu")
    nextn = args.num_speculative_tokens
    engine_args = dict(
        device="cpu",
        max_num_seqs=args.batch,
        max_model_len=8 + args.max_tokens + nextn + 8,
        block_size=8,
        num_speculative_tokens=nextn,
    )
    config = EngineConfig(**engine_args).worker_config()
    runner = DecodeStepGraphs(
        ModelRunner(source.model, config, nextn=nextn, with_taps=True), config, use_graphs=False, attention="reference"
    )
    forced = args.spec_sampling == "forced"
    spec = Speculator(
        source.model,
        nextn,
        "rejection" if forced else args.spec_sampling,
        forced_acceptance=ForcedAcceptance(args.acceptance) if forced else None,
        static_proposal=True,
    )
    if args.eager_verify:
        spec.verify_graphs = None
    worker = Worker(runner, speculator=spec)
    llm = LLM(source=source, worker=worker, **engine_args)
    run_batch(llm, args.batch, 8, 4, seed=99)  # warm-up
    phases = Phases()
    phases.wrap(runner, "execute", "runner (outside its graph)")
    phases.wrap(StaticDecodeStep, "run", GRAPHS[0])
    phases.wrap(StaticDraftProposal, "run", GRAPHS[1])
    phases.wrap(StaticVerify, "run", GRAPHS[2])
    phases.wrap(Sampler, "process", "sampler process")
    phases.wrap(spec, "_verify", "verify")
    phases.wrap(spec, "_static_verify", "verify (outside its graph)")
    phases.wrap(speculator_module, "write_context", "write_context")
    if hasattr(speculator_module, "emitted_output"):
        phases.wrap(speculator_module, "emitted_output", "emitted_output")
    phases.wrap(spec, "_propose", "propose (outside its graph)")
    phases.wrap(spec, "step", "speculator step (rest)")
    decode = [0]
    execute = worker.execute

    def counted(plan, rows, previous=None):
        decode[0] += not plan.is_prefill
        return execute(plan, rows, previous)

    worker.execute = counted
    eager = runner.num_eager
    with phases:
        run_batch(llm, args.batch, 8, args.max_tokens, seed=1)
    n = decode[0]
    print(
        f"{n} decode steps, {runner.num_eager - eager} eager runner steps (prefill); draft keys "
        f"{sorted(k.num_rows for k in spec.draft_graphs.static)}"
    )
    for phase, num in phases.ops.most_common():
        print(
            f"{phase:>28}: {num / n:8.1f} ops/step  "
            f"({1000 * phases.seconds[phase] / n:7.2f} CPU ms/step, nested phases included)"
        )
    if args.op_names:
        for (phase, name), num in sorted(phases.names.items(), key=lambda item: (item[0][0], -item[1])):
            if phase not in GRAPHS and not phase.startswith("runner"):
                print(f"    {phase:>28} {name:>24}: {num / n:6.1f}")
    outside = sum(v for k, v in phases.ops.items() if k not in GRAPHS and not k.startswith("runner"))
    print(f"speculative step, eager ops outside the graphs (runner excluded): {outside / n:.1f} per step")


if __name__ == "__main__":
    main()
