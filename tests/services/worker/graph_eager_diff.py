"""GPU diagnostic: the first op where the static decode step and the eager step part, in the batch-invariant mode.

Both runners (``test_static_decode_step.setup``, the compiled kernel backend, FP8) run the same plans;
before each step the static runner takes the eager one's pools. On the first decode step whose logits
differ, the step is run again on both with every module output and every attention, indexer and
compressor call recorded, and the first record that differs is printed (its name, the max |Δ|).

    python3 -m tests.services.worker.graph_eager_diff
"""

from __future__ import annotations

import copy
import json

import torch

import kernels.decode_attention as decode_attention
import kernels.indexer as indexer
from services.worker.runners.static_decode_step import StaticDecodeStep
from tests.scheduler_rs.fake_worker import run_step
from tests.services.worker.runners.test_model_runner import case
from tests.services.worker.runners.test_static_decode_step import setup

WATCHED = (
    "attn_norm",
    "ffn_norm",
    "wq_a",
    "q_norm",
    "wq_b",
    "wkv",
    "kv_norm",
    "wo_a",
    "wo_b",
    "ffn",
    "engram",
    "weights_proj",
)


def record(model, sink: list) -> list:
    handles = []
    for name, module in model.named_modules():
        if name.split(".")[-1] in WATCHED:
            handles.append(
                module.register_forward_hook(
                    lambda m, a, out, name=name: sink.append((name, out[0] if isinstance(out, tuple) else out))
                )
            )
    return handles


def _rows_first(t: torch.Tensor) -> torch.Tensor:
    return t[0] if t.dim() >= 3 and t.shape[0] == 1 else t  # block-level [1, R, ...] → [R, ...]


def first_difference(eager: list, static: list, rows: int) -> dict | None:
    if len(eager) != len(static):
        return {"records": [len(eager), len(static)]}
    for (name_a, a), (name_b, b) in zip(eager, static):
        a, b = _rows_first(a), _rows_first(b)
        if name_a != name_b:
            return {"order differs": [name_a, name_b]}
        if name_a.startswith("select"):
            same = all(sorted(x[x >= 0].tolist()) == sorted(y[y >= 0].tolist()) for x, y in zip(a[:rows], b[:rows]))
            if not same:
                return {"at": name_a}
            continue
        if not torch.equal(a[:rows], b[:rows]):
            return {"at": name_a, "max_abs": float((a[:rows].float() - b[:rows].float()).abs().max())}
    return None


def main() -> int:
    model = case("oracle", "cuda").model
    sched, eager, static, token_at, _ = setup(
        "oracle", "cuda", "triton", False, model=copy.deepcopy(model), backend="kernels"
    )
    for runner in (eager, static.runner):
        runner.batch_invariant = True
    calls: list = []
    attend, select = decode_attention.sparse_decode_attention, indexer.indexer_select

    def attend_rec(*args, **kwargs):
        out = attend(*args, **kwargs)
        calls.append(("attend", out))
        return out

    def select_rec(*args, **kwargs):
        out = select(*args, **kwargs)
        calls.append(("select", out[0]))
        return out

    decode_attention.sparse_decode_attention, indexer.indexer_select = attend_rec, select_rec
    result: dict = {"steps": 0}
    while sched.has_unfinished():
        plan = sched.schedule()
        static.runner.cache.blocks.copy_(eager.cache.blocks)
        static.runner.cache.slots.copy_(eager.cache.slots)
        blocks, slots = eager.cache.blocks.clone(), eager.cache.slots.clone()
        want = eager.execute(plan, all_rows=True)
        got = static.execute(plan, all_rows=True)
        result["steps"] += 1
        if StaticDecodeStep.fits(plan) and not torch.equal(got.logits, want.logits):
            traces: list[tuple[list, list]] = []
            for runner, run in (
                (eager, lambda: eager.execute(plan, all_rows=True)),
                (static.runner, lambda: static.execute(plan, all_rows=True)),
            ):
                runner.cache.blocks.copy_(blocks)
                runner.cache.slots.copy_(slots)
                calls.clear()
                modules: list = []
                handles = record(runner.model, modules)
                run()
                for h in handles:
                    h.remove()
                traces.append((modules, [(f"{n}#{i}", t) for i, (n, t) in enumerate(calls)]))
            result.update(
                step=result["steps"],
                rows=plan.num_rows,
                logits_max_abs=float((got.logits - want.logits).abs().max()),
                modules=first_difference(traces[0][0], traces[1][0], plan.num_rows),
                calls=first_difference(traces[0][1], traces[1][1], plan.num_rows),
            )
            break
        sched.update(plan, run_step(plan, token_at))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
