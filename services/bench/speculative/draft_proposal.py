"""Where one DSpark proposal's time goes: ``python -m services.bench.speculative.draft_proposal``.

Runs greedy requests with speculation (forced acceptance a, services/worker/spec/forced_acceptance.py, so every
step proposes) and counts, per proposal (``Speculator``'s propose, from the anchors to the drafts on the host):

- aten ops: top-level dispatcher calls (an op that another op calls is not counted again); on a GPU each is
  one kernel launch or more, so at batch 1 their count, not their arithmetic, sets the proposal's time;
  split into the inputs (built on the host: their ops run on the CPU, then one copy per tensor), the draft's
  window read and stages, and the per-slot loop (the profiler ranges ``speculator.PROPOSE_RANGES``);
and per speculative step (``Speculator.step``: the verification, the draft's context writes, the proposal):

- host reads of tensors (``tolist``, ``item``, ``bool``, ``int``, ``float``, ``nonzero``, ``cpu``), by call
  site: on CUDA each waits for the device (a sync);
- tensors built from Python data straight onto a device (``torch.tensor`` / ``as_tensor`` of lists with a
  ``device`` other than "cpu"): on CUDA a blocking copy each (the step builds its tensors on the host and
  copies them non-blocking instead).

On CUDA it also counts the kernel launches under the ranges (a replayed graph, ``--cuda-graphs``, is one
launch). Times are not reported: the counters slow every call; ``services/bench/speculative/run.py`` measures
tokens/s. Stdlib-only at import; torch loads when it runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu")
BUILDS = ("tensor", "as_tensor")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")
"""Runtime calls that start device work: a kernel each, or a whole captured graph (the static proposal)."""


def _in_step() -> str | None:
    """The call site (file:line in the repository) of a torch call made inside ``Speculator._step``."""
    frame, site = sys._getframe(2), None
    while frame is not None:
        name = frame.f_code.co_filename
        if site is None and "/torch/" not in name and name != __file__ and not name.endswith("batch_invariant.py"):
            site = f"{Path(name).name}:{frame.f_lineno}"
        if frame.f_code.co_name == "_step" and name.endswith("speculator.py"):
            return site
        frame = frame.f_back
    return None


def main(args: argparse.Namespace) -> int:
    import torch
    from torch.overrides import TorchFunctionMode

    from services.bench.speculative.run import build
    from services.engine import SamplingParams
    from services.engine.model_source import load_model
    from services.worker.spec.speculator import PROPOSE_RANGES

    class Counter(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.reads: collections.Counter = collections.Counter()
            self.builds: collections.Counter = collections.Counter()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            onto_device = (kwargs or {}).get("device") not in (None, "cpu")
            if name in READS or (name in BUILDS and onto_device and args and not isinstance(args[0], torch.Tensor)):
                site = _in_step()
                if site is not None:
                    (self.reads if name in READS else self.builds)[f"{name} @ {site}"] += 1
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    source = load_model(args.model, device=device)
    engine_args = dict(
        device=device,
        kernel_backend=args.kernel_backend,
        max_num_seqs=args.batch,
        max_model_len=args.prompt_len + args.max_tokens + args.num_speculative_tokens + 8,
        block_size=16,
        batch_invariant=args.batch_invariant,
        cuda_graphs=args.cuda_graphs,
    )
    llm = build(
        source,
        engine_args,
        args.num_speculative_tokens,
        False,
        args.acceptance,
        args.spec_sampling,
        args.static_proposal or None,
    )
    prompts = [[1] + [3 + (7 * i + j) % 200 for j in range(args.prompt_len - 1)] for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    # Warm-up at the batch: the draft's graph of its bucket is captured here, not in the counted run.
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    speculator = llm.engine.worker.speculator
    steps, step = [0], speculator.step

    def counted_step(*step_args, **step_kwargs):  # this instance's steps, for the per-step counts
        steps[0] += 1
        return step(*step_args, **step_kwargs)

    speculator.step = counted_step
    with Counter() as counter, torch.profiler.profile(activities=activities, acc_events=True) as prof:
        llm.generate(prompts, params)
    ranges = [e for e in prof.events() if e.name in PROPOSE_RANGES]
    ops = collections.Counter()
    launches = collections.Counter()
    for e in prof.events():
        chain, parent = [], e.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        part = next((n for n in chain if n in PROPOSE_RANGES), None)
        if part is None:
            continue
        if e.name.startswith("aten::") and not any(n.startswith("aten::") for n in chain):
            ops[part] += 1
        if e.name in LAUNCHES:
            launches[part] += 1
    num = sum(1 for e in ranges if e.name == PROPOSE_RANGES[1])
    per = {part: round(ops[part] / num, 1) for part in PROPOSE_RANGES}
    result = {
        "proposals": num,
        "batch": args.batch,
        "device": device,
        "spec_sampling": args.spec_sampling,
        "proposal": "graphs" if args.cuda_graphs else "static" if args.static_proposal else "eager",
        "aten_ops_per_proposal": per,
        "kernel_launches_per_proposal": {part: round(launches[part] / num, 1) for part in PROPOSE_RANGES},
        "steps": steps[0],
        "host_reads_per_step": {k: round(v / steps[0], 2) for k, v in sorted(counter.reads.items())},
        "device_builds_per_step": {k: round(v / steps[0], 2) for k, v in sorted(counter.builds.items())},
    }
    print(json.dumps(result, indent=2))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset or checkpoint (default tiny)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--batch", type=int, default=1, help="requests (default 1)")
    p.add_argument("--num-speculative-tokens", type=int, default=5, help="drafts per request (default 5)")
    p.add_argument(
        "--spec-sampling",
        choices=("rejection", "deterministic"),
        default="rejection",
        help="speculative sampling mode (default rejection)",
    )
    p.add_argument("--acceptance", type=float, default=0.0, help="forced acceptance a (default 0)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per request (default 16)")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request (default 8)")
    p.add_argument("--kernel-backend", choices=("fp8", "fp32"), help="the kernel backend (default: the torch model)")
    p.add_argument("--batch-invariant", action="store_true", help="the batch-invariant mode")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="CUDA graphs for decode and the draft's proposal (needs --kernel-backend)",
    )
    p.add_argument(
        "--static-proposal",
        action="store_true",
        help="the static proposal (what a graph captures) run eagerly: its ops on the CPU",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--json", dest="json_path", help="write the counts here")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
