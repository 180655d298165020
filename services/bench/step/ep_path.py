"""`shinkai bench step --dp 1 --ep-path`: one GPU's decode steps with the expert-parallel kernel layer against the
engine without it, on one model.

The expert-parallel path at world size 1 (services/worker/parallel/ep_kernel_moe.py) is everything a rank of a
group runs per MoE layer: the picks packed into fixed-capacity buffers, two ``all_to_all_single`` calls over a
one-rank NCCL group (the packed rows, meta and counts; the outputs back: copies to itself), the grouped GEMMs
over the rank's slots plus the shared expert, and the combine; in the decode graphs with everything else.
Without it the layer is ``KernelMoE``. The experts are ``--expert-format``'s (the last one named; MXFP4 by
default). Each batch size is built and timed twice per path, alternated (without, with, without, with), and the
pooled step times' medians are compared: the expert-parallel path's cost on one GPU, before any wire.

With ``--profile``, each path's last build also profiles its decode steps (``profile.profile_decode``, every
kernel kept): both kernel tables are printed, then the kernels whose launches per step differ between the two
(``profile.kernel_diff``: what the expert-parallel path adds or drops) and those of equal launches whose time
differs most (the same kernel on other shapes or configs), all of it in the JSON's ``profile`` rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

CONTEXT = 1024
ROUNDS = 2
TOP = 20  # kernels printed per table
TOP_SAME = 8  # kernels of equal launches printed by their time difference


def _print_diff(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(
            f"  {r['extra_us']:+10.1f} µs  ×{r['launches_without']:6.1f} → ×{r['launches_with']:6.1f}  "
            f"{r['kernel'][:80]}"
        )


def profile_report(batch: int, without: dict[str, Any], with_ep: dict[str, Any]) -> dict[str, Any]:
    """Two ``profile_decode`` results at ``batch`` (every kernel kept), without and with the expert-parallel path
    → printed side by side with their difference (``kernel_diff``), and the JSON row holding all three."""
    from services.bench.step.profile import kernel_diff, launches_line, print_kernels

    diff = kernel_diff(without["kernels"], with_ep["kernels"])
    for name, p in (("without", without), ("with the EP path", with_ep)):
        print(
            f"profile decode batch {batch} {name}: {p['wall_ms']:.3f} ms per step (profiled), device busy "
            f"{p['busy_ms']:.3f} ms; {launches_line(p)}"
        )
        print_kernels(p["kernels"][:TOP])
    extra = sum(r["extra_launches"] for r in diff)
    print(
        f"profile decode batch {batch}: the EP path launches {extra:+.0f} kernels per step, "
        f"{with_ep['kernel_ms'] - without['kernel_ms']:+.3f} ms in kernels; kernels whose launches differ:"
    )
    _print_diff([r for r in diff if r["extra_launches"]])
    same = sorted((r for r in diff if not r["extra_launches"]), key=lambda r: -abs(r["extra_us"]))
    print(f"profile decode batch {batch}: the largest time differences at equal launches:")
    _print_diff(same[:TOP_SAME])
    return {"section": "profile", "batch": batch, "context": CONTEXT, "without": without, "with": with_ep, "diff": diff}


def one_rank_parallel(cfg, max_num_seqs: int, device):
    """An ``ExpertParallel`` over a one-rank NCCL group (started here once), passes of ``max_num_seqs`` tokens."""
    import torch.distributed as dist

    from services.worker.parallel.ep_moe import ExpertParallel
    from services.worker.parallel.exchange import Exchange
    from services.worker.parallel.expert_slots import ExpertSlots
    from services.worker.parallel.peer_exchange import GroupPeerExchange

    if not dist.is_initialized():
        rendezvous = Path(tempfile.mkdtemp(prefix="shinkai-ep-path-")) / "rendezvous"
        dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    group = dist.new_group(backend="nccl")
    slots = [ExpertSlots.startup(cfg.n_routed_experts, 1, 0, 0, device) for _ in range(cfg.num_hidden_layers)]
    return ExpertParallel(Exchange(group, 1), slots, peer=GroupPeerExchange(group, 1), pass_tokens=max_num_seqs)


def main(args: argparse.Namespace) -> int:
    import torch

    from services.bench.step.build import builder, runner_cache
    from services.bench.step.profile import profile_decode
    from services.bench.step.timing import decode_model_len, time_decode
    from services.worker.parallel.ep_kernel_moe import unshard_kernel_experts

    if not torch.cuda.is_available():
        raise SystemExit("bench step --ep-path runs on a GPU (the kernel backend compiled, NCCL)")
    device = torch.device("cuda")
    model = args.model or "v41-s1"
    try:
        batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else (1, 64, 256)
    except ValueError:
        raise SystemExit(f"--batches: expected comma-separated integers, got {args.batches!r}") from None
    steps = 20
    graphs = not args.no_graphs
    expert_format = args.expert_format.split(",")[-1]
    build, cfg, full_layers = builder(model, device, "kernels", args.layers, graphs, expert_format)
    print(
        f"model {model} ({cfg.num_hidden_layers} of {full_layers} layers), experts {expert_format}, "
        f"CUDA graphs {graphs}, context {CONTEXT}, {torch.cuda.get_device_name()}"
    )
    rows: list[dict[str, Any]] = []
    for batch in batches:
        seconds: dict[str, list[float]] = {"without": [], "with": []}
        profiles: dict[str, dict[str, Any]] = {}
        for round_ in range(ROUNDS):
            for path in ("without", "with"):
                parallel = one_rank_parallel(cfg, batch, device) if path == "with" else None
                llm = build(
                    max_num_seqs=batch, max_model_len=decode_model_len(batch, CONTEXT, steps), expert_parallel=parallel
                )
                t = time_decode(
                    llm.engine, runner_cache(llm), batch=batch, context=CONTEXT, steps=steps, vocab_size=cfg.vocab_size
                )
                seconds[path] += t.seconds
                if args.profile and round_ == ROUNDS - 1:  # after the timed steps, on the same build
                    profiles[path] = profile_decode(
                        llm.engine,
                        runner_cache(llm),
                        batch=batch,
                        context=CONTEXT,
                        steps=steps,
                        vocab_size=cfg.vocab_size,
                        top=None,
                    )
                if parallel is not None:
                    unshard_kernel_experts(llm.source.model)
                del llm
                gc.collect()  # the engine's cycles (pools, graphs) go now, not inside the next build's timed steps
                torch.cuda.empty_cache()
        without, with_ep = statistics.median(seconds["without"]), statistics.median(seconds["with"])
        row = {
            "section": "ep path decode",
            "batch": batch,
            "context": CONTEXT,
            "ms_without": without * 1e3,
            "ms_with": with_ep * 1e3,
            "slowdown": with_ep / without - 1,
        }
        rows.append(row)
        print(
            f"decode batch {batch:>4}: without {row['ms_without']:8.3f} ms, with the EP path {row['ms_with']:8.3f} ms "
            f"({100 * row['slowdown']:+.1f}%; median of {len(seconds['with'])} steps each, {ROUNDS} builds alternated)"
        )
        if profiles:
            rows.append(profile_report(batch, profiles["without"], profiles["with"]))
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(
                {
                    "model": model,
                    "layers": cfg.num_hidden_layers,
                    "expert_format": expert_format,
                    "device": torch.cuda.get_device_name(),
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0
