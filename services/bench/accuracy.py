"""`shinkai bench accuracy`: the kernel backend's FP8 path against the fp32 torch reference (the FP8
accuracy targets of docs/accuracy.md: mean KL ≤ 1e-3, max ≤ 1e-2, top-1 agreement ≥ 99% where the reference's top-2
margin is ≥ 0.05), at V4.1's real widths and, for contrast, on the tiny preset.

The reference is the torch ``ModelRunner`` (fp32 weights; on the GPU it equals the CPU runner within
6e-6). It is driven by the real scheduler through chunked prefill and greedy decode, and its logits at
every row are recorded. A candidate runner then replays the same plans: a fresh scheduler given the
same requests and fed the reference's tokens makes the same plans (it is deterministic; the row keys
are checked step by step), so sampling never diverges and every position is compared.

Per position: KL(ref ‖ candidate) in fp64, the reference's entropy (a near-uniform output would make
any KL small) and whether the argmaxes agree where the reference's top-2 logit margin is ≥ 0.05.
Reported over all positions, prompt (prefill) and generated (decode) positions, and context buckets.

v41-s1 runs on its 8-layer subset with one layer of every kind (step_build.KINDS_OF_V41), built in fp32
on the GPU (~60 GB). Prompts of 600–2000 tokens reach past ``index_topk`` (512) compressed entries in
both ratio-1 and ratio-2 layers. ``measure`` converts the model: the FP8 candidate runs on a copy that
shares the fp32 tensors (its FP8 weights are ~¼ more), the fp32 candidate last, in place.

``--branch-scale-log2 N`` multiplies every layer's residual branches by 2^-N before anything runs
(``scale_branches``): the loud random init is chaotic and cannot meet the criterion under any numerics
(docs/accuracy.md §3); N = 4 makes it contractive, as trained models are. The default (0) still
reports the loud init.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.bench.targets import Target, past, verdict_lines

MARGIN = 0.05
TARGETS = {"mean_kl": 1e-3, "max_kl": 1e-2, "top1": 0.99}
BUCKETS = (0, 256, 512, 1024, 2048)
"""Context-length bucket edges (tokens seen, position + 1); the last bucket is open."""


@dataclass(frozen=True)
class Workload:
    prompt_lens: tuple[int, ...] = (2000, 1400, 1000, 600)
    decode_steps: int = 32  # greedy decode steps after each prompt
    budget: int = 1024  # max_num_batched_tokens: prompts are prefilled in chunks
    block_size: int = 128
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return max(self.prompt_lens) + self.decode_steps + 1


@dataclass
class Recording:
    """The reference run: per step its row keys (request, position) and logits [R, V] fp32."""

    prompts: dict[str, list[int]]
    seqs: dict[str, list[int]]  # prompt + the reference's greedy tokens
    steps: list[tuple[list[tuple[str, int]], Any]] = field(default_factory=list)


def make_prompts(vocab_size: int, workload: Workload) -> dict[str, list[int]]:
    import torch

    gen = torch.Generator().manual_seed(workload.seed)
    return {
        f"r{i}": torch.randint(3, vocab_size, (n,), generator=gen).tolist() for i, n in enumerate(workload.prompt_lens)
    }


def engine_config(workload: Workload):
    from services.engine.config import EngineConfig

    n = len(workload.prompt_lens)
    return EngineConfig(
        block_size=workload.block_size,
        max_num_seqs=n,
        max_num_batched_tokens=workload.budget,
        max_model_len=workload.max_model_len,
    )


def _scheduler(cfg, workload: Workload):
    from scheduler_rs import Scheduler, SchedulerConfig

    config = engine_config(workload)
    ratios = sorted({cfg.ratio(layer) for layer in cfg.kv_source_layer_ids}, reverse=True)
    return Scheduler(
        SchedulerConfig(
            block_size=config.block_size,
            num_blocks=config.resolved_num_blocks(),
            num_state_slots=config.resolved_num_state_slots(),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            window_size=cfg.sliding_window,
            compress_ratios=ratios or [1],
        )
    )


def _drive(
    runner,
    workload: Workload,
    prompts: dict[str, list[int]],
    choose: Callable[[str, int, Any], int],
    on_step: Callable[[list[tuple[str, int]], Any], None],
) -> None:
    """Every request through the scheduler and ``runner``; ``choose(request, position, logits row)`` is
    the token at ``position`` (the row is the one that predicts it)."""
    from scheduler_rs import StepResult

    sched = _scheduler(runner.cfg, workload)
    for request_id, prompt in prompts.items():
        sched.add_request(request_id, prompt, max_tokens=workload.decode_steps + 1, ignore_eos=True)
    while sched.has_unfinished():
        plan = sched.schedule()
        out = runner.execute(plan, all_rows=True)
        ids = plan.request_ids  # one conversion (each read of the attribute builds the list)
        keys = [(ids[i], pos) for pos, i in zip(plan.positions.tolist(), plan.row_requests.tolist())]
        on_step(keys, out.logits)
        num_tokens, token_ids = [], []
        ends, seqlens_k = plan.query_start.tolist()[1:], plan.seqlens_k.tolist()
        for i, (request_id, n) in enumerate(zip(plan.request_ids, plan.num_sample_rows.tolist())):
            assert n <= 1, "one sampled row per request (no drafts)"
            num_tokens.append(n)
            if n:  # the request's last row predicts the token at seqlens_k
                last = ends[i] - 1
                assert keys[last] == (request_id, seqlens_k[i] - 1)
                token_ids.append(choose(request_id, seqlens_k[i], out.logits[last]))
        sched.update(plan, StepResult(num_tokens, token_ids))


def record_reference(runner, workload: Workload, prompts: dict[str, list[int]]) -> Recording:
    """Greedy decode on ``runner``, every row's logits kept (on the runner's device)."""
    rec = Recording(prompts, {request_id: list(p) for request_id, p in prompts.items()})

    def choose(request_id: str, pos: int, row) -> int:
        token = int(row.argmax())
        assert len(rec.seqs[request_id]) == pos
        rec.seqs[request_id].append(token)
        return token

    _drive(runner, workload, prompts, choose, lambda keys, logits: rec.steps.append((keys, logits)))
    return rec


def row_stats(ref, ours, chunk: int = 256) -> dict[str, Any]:
    """ref, ours [R, V] logits → per row: KL(ref ‖ ours), the reference's entropy and top-2 margin, and
    whether the argmaxes agree (fp64 softmax maths, ``chunk`` rows at a time)."""
    import torch

    kl, entropy, margin, agree = [], [], [], []
    for i in range(0, ref.shape[0], chunk):
        r, o = ref[i : i + chunk].double(), ours[i : i + chunk].to(ref.device).double()
        p, q = r.log_softmax(-1), o.log_softmax(-1)
        prob = p.exp()
        kl.append((prob * (p - q)).sum(-1))  # exactly 0 for bitwise-equal logits
        entropy.append(-(prob * p).sum(-1))
        top2 = r.topk(2, dim=-1).values
        margin.append(top2[:, 0] - top2[:, 1])
        agree.append(r.argmax(-1) == o.argmax(-1))
    return {k: torch.cat(v).cpu() for k, v in (("kl", kl), ("entropy", entropy), ("margin", margin), ("agree", agree))}


def compare(rec: Recording, runner, workload: Workload) -> dict[str, dict[str, Any]]:
    """Replay ``rec``'s plans on ``runner`` (teacher-forced with the reference's tokens) → summary."""
    import torch

    steps = iter(rec.steps)
    parts: list[dict[str, Any]] = []

    def on_step(keys, logits) -> None:
        ref_keys, ref_logits = next(steps)
        assert keys == ref_keys, "the replayed plan differs from the reference's"
        stats = row_stats(ref_logits, logits)
        stats["position"] = torch.tensor([pos for _, pos in keys])
        stats["decode"] = torch.tensor([pos >= len(rec.prompts[request_id]) for request_id, pos in keys])
        parts.append(stats)

    _drive(runner, workload, rec.prompts, lambda request_id, pos, row: rec.seqs[request_id][pos], on_step)
    assert next(steps, None) is None, "the replay ran fewer steps than the reference"
    return summarize({k: torch.cat([p[k] for p in parts]) for k in parts[0]})


def _group(rows: dict[str, Any], mask) -> dict[str, Any]:
    kl = rows["kl"][mask]
    wide = mask & (rows["margin"] >= MARGIN)
    n_wide = int(wide.sum())
    return {
        "positions": int(mask.sum()),
        "mean_kl": float(kl.mean()) if kl.numel() else None,
        "max_kl": float(kl.max()) if kl.numel() else None,
        "top1": float(rows["agree"][wide].double().mean()) if n_wide else None,
        "margin_rows": n_wide,
        "top1_all": float(rows["agree"][mask].double().mean()) if kl.numel() else None,
        "mean_entropy": float(rows["entropy"][mask].mean()) if kl.numel() else None,
    }


def summarize(rows: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per group ("all", "prefill", "decode", "ctx a-b"): positions, mean/max KL, top-1 agreement at
    margin ≥ MARGIN (and over every row), the reference's mean entropy (nats)."""
    import torch

    context = rows["position"] + 1
    groups = {"all": torch.ones_like(rows["decode"]), "prefill": ~rows["decode"], "decode": rows["decode"]}
    for lo, hi in zip(BUCKETS, BUCKETS[1:] + (None,)):
        groups[f"ctx {lo + 1}-{hi or ''}"] = (context > lo) & (context <= hi if hi else True)
    return {name: _group(rows, mask) for name, mask in groups.items() if mask.any()}


def accuracy_targets(summary: dict[str, Any]) -> list[Target]:
    """The targets of ``TARGETS`` on the "all" group (top-1 only where a position had a clear margin)."""
    s = summary["all"]
    targets = [Target("mean KL", s["mean_kl"], TARGETS["mean_kl"]), Target("max KL", s["max_kl"], TARGETS["max_kl"])]
    if s["top1"] is not None:
        targets.append(Target("top-1 agreement", s["top1"], TARGETS["top1"], at_most=False))
    return targets


def meets_targets(summary: dict[str, Any]) -> bool:
    return not past(accuracy_targets(summary))


def scale_branches(model, branch_scale_log2: int | None) -> None:
    """Every layer's residual branches (attention ``wo_b``, routed and shared expert ``w2``) × 2^-N in
    place (``None``: × 0, the embedding-only model). A power of two is exact in FP8 (e4m3 mantissas and
    block scales are unchanged), so the FP8 model is the scaled fp32 model's own FP8 form.

    Why: trained models are contractive (a perturbation of a hidden state decays through the layers);
    the loud random init is chaotic, every discrete choice (cache rounding, indexer and candidate top-k,
    MoE top-k) turns any rounding into flips, and no numerics short of bit-equality meet the targets there
    (docs/accuracy.md §3: fp32-sized noise alone gives max KL 0.03 on the tiny configs). × 2^-4 makes
    the random model contractive while its layers still move the output (KL 0.015 against × 0)."""
    import torch

    f = 0.0 if branch_scale_log2 is None else 2.0**-branch_scale_log2
    with torch.no_grad():
        for block in model.layers:
            block.attn.wo_b.weight.mul_(f)
            block.ffn.w2.mul_(f)
            block.ffn.shared_w2.mul_(f)


def shared_copy(model):
    """A deep copy of ``model``'s module tree that shares its tensors: converting the copy in place
    swaps the copy's modules only (the conversion makes new tensors; the originals stay untouched)."""
    import torch

    memo: dict[int, Any] = {}
    for m in model.modules():
        tensors = [
            *m._parameters.values(),
            *m._buffers.values(),
            *(v for v in vars(m).values() if isinstance(v, torch.Tensor)),
        ]
        memo.update((id(t), t) for t in tensors if t is not None)
    return copy.deepcopy(model, memo)


FORMAT_FLOOR = "fp8-torch"
"""A ``measure`` precision: FP8 weights and activations, FP8/FP4 caches, through the kernels' torch
references (``KernelSet.references()``): the formats' own KL, which no kernel can beat."""


def measure(
    model,
    workload: Workload,
    precisions: Sequence[str] = ("fp8", "fp32"),
    kernels=None,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Reference run on the torch runner, then each kernel precision replayed → {precision: summary}.
    "fp32" converts ``model`` itself and must come last; other precisions run on a shared copy."""
    import gc

    import torch

    from services.worker.runners.model_runner import ModelRunner

    if "fp32" in precisions and precisions[-1] != "fp32":
        raise ValueError("fp32 converts the model in place: it must be the last precision")
    from services.worker.kernel_model.kernel_set import KernelSet

    config = engine_config(workload).worker_config()
    prompts = make_prompts(model.cfg.vocab_size, workload)
    rec = record_reference(ModelRunner(model, config), workload, prompts)
    results = {}
    for precision in precisions:
        target = model if precision == "fp32" else shared_copy(model)
        if precision == FORMAT_FLOOR:  # the same FP8 formats through the kernels' torch references
            runner = ModelRunner(target, config, backend="kernels", precision="fp8", kernels=KernelSet.references())
        else:
            runner = ModelRunner(target, config, backend="kernels", precision=precision, kernels=kernels)
        results[precision] = compare(rec, runner, workload)
        log(report(precision, results[precision]))
        del runner, target
        gc.collect()  # the copy's FP8 tensors go before the fp32 conversion allocates
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def report(label: str, summary: dict[str, dict[str, Any]]) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    lines = [
        f"{label}: KL(ref ‖ {label}); top-1 at ref top-2 margin ≥ {MARGIN}",
        f"  {'group':14} {'positions':>9} {'mean KL':>10} {'max KL':>10} {'top-1':>8} {'(rows)':>7} "
        f"{'top-1 all':>9} {'ref H':>7}",
    ]
    for name, s in summary.items():
        lines.append(
            f"  {name:14} {s['positions']:>9} {f(s['mean_kl'], '10.3g')} {f(s['max_kl'], '10.3g')} "
            f"{f(s['top1'], '8.4f')} {s['margin_rows']:>7} {f(s['top1_all'], '9.4f')} "
            f"{f(s['mean_entropy'], '7.3f')}"
        )
    lines.append("  FP8 accuracy targets, over all positions:")
    lines += ["    " + line for line in verdict_lines(accuracy_targets(summary))]
    return "\n".join(lines)


def run_preset(
    name: str, workload: Workload, precisions: Sequence[str], device, branch_scale_log2: int = 0, kernels=None
) -> dict[str, Any]:
    """Build ``name`` in fp32 on ``device`` (v41-s1: its 8-layer subset), its residual branches × 2^-N
    (``scale_branches``; 0, the default, keeps the loud random init, whose numbers are still the ones
    reported unless asked), and measure it. ``kernels``: a KernelSet (None: the compiled kernels;
    ``KernelSet.references()``: the same formats in torch, the FP8 format floor)."""
    import torch

    from services.bench.step.build import KINDS_OF_V41, load_source, model_config

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = model_config(name, len(KINDS_OF_V41) if name == "v41-s1" else None)
    source = load_source(name, cfg, device, "torch")
    if branch_scale_log2:
        scale_branches(source.model, branch_scale_log2)
    print(
        f"\n== {name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, index_topk {cfg.index_topk}, "
        f"top-{cfg.num_experts_per_tok} of {cfg.n_routed_experts} experts; prompts {list(workload.prompt_lens)}, "
        f"{workload.decode_steps} decode steps, budget {workload.budget}; residual branches × 2^-{branch_scale_log2}"
    )
    results = measure(source.model, workload, precisions, kernels)
    del source
    torch.cuda.empty_cache()
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", default="tiny,v41-s1", help="comma-separated presets (default tiny,v41-s1)")
    parser.add_argument("--prompts", default="2000,1400,1000,600", help="prompt lengths in tokens")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens (prefill chunk)")
    parser.add_argument(
        "--precisions",
        default="fp8,fp32",
        help=f"comma-separated, fp32 last: fp8, fp32, {FORMAT_FLOOR} (the FP8 formats in torch)",
    )
    parser.add_argument(
        "--branch-scale-log2",
        type=int,
        default=0,
        metavar="N",
        help="residual branches (attention wo_b, expert w2) × 2^-N before anything runs: a "
        "contractive model, as trained ones are (default 0: the loud random init)",
    )
    parser.add_argument("--json", default=None, help="write every summary to this file")


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("shinkai bench accuracy: the kernel backend needs a CUDA device")
    workload = Workload(tuple(int(n) for n in args.prompts.split(",")), args.decode_steps, args.budget)
    results = {
        name: run_preset(name, workload, args.precisions.split(","), torch.device("cuda"), args.branch_scale_log2)
        for name in args.presets.split(",")
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shinkai bench accuracy", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
