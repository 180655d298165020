"""Engine equals model: the cached runner, driven by the real scheduler through chunked prefill and
decode, gives the full-sequence reference logits at every position.

Three random tiny configs (tests/model/deepseek_v41/oracle_configs.py: ratio-2 and ratio-1 sources,
Reindex layers inside and without candidates, windows 4/8/16, Engram 2- to 4-grams), 16-token blocks,
four requests of different lengths in one batch, prefill budgets that cut inside ratio-2 groups and
across block boundaries, then decode steps. Tokens are teacher-forced so both sides see the same
sequence.

Bin flips: the cached path computes in other matmul shapes, so fp32 noise (~1e-7) can move a value
that sits on an FP8/FP4 rounding edge into the next bin. As in the oracle harness, the reference
run is recorded and the cached run takes the reference's pre-rounding value wherever the two agree
to FLIP_BOUNDARY_TOL *and* lie that close to a rounding boundary (a traced flip); nothing else is
touched, so a real bug still shows. Oracle top-k near ties exempt that position onwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from model.batch_invariant import batch_invariant
from model.deepseek_v41.init import random_checkpoint
from model.deepseek_v41.loader import assign_weights
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.quant import fake_quant_compressed_kv, fake_quant_fp8_e4m3, fake_quant_indexer
from model.deepseek_v41.tokenizer import engram_token_map
from scheduler_rs import Scheduler, SchedulerConfig
from services.engine.config import EngineConfig
from services.worker.runners.model_runner import ModelRunner
from tests import tolerances as tol
from tests.model.deepseek_v41.oracle_configs import CASES, finish
from tests.model.deepseek_v41.oracle_harness import (
    QuantCall,
    boundary_distance,
    record_ours,
    topk_margins,
    toy_tokenizer,
)
from tests.scheduler_rs.configs import scheduler_config
from tests.scheduler_rs.fake_worker import run_step

BLOCK = 16
PROMPTS = (37, 20, 45, 9)
MAX_TOKENS = 5
ROUNDING = {
    "fp8": ("fp8", fake_quant_fp8_e4m3),
    "kv4": ("kv4", fake_quant_compressed_kv),
    "idx4k": ("idx4", fake_quant_indexer),
    "idx4q": ("idx4", fake_quant_indexer),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@dataclass
class Case:
    model: DeepseekV41
    seqs: dict[str, list[int]]  # prompt + the tokens fed back, per request
    reference: torch.Tensor  # [B, S, V] full-sequence logits
    calls: dict[tuple[int, str], QuantCall]  # (layer, kind) → recorded rounding
    exempt_from: dict[str, int]  # request → first position after an oracle top-k near tie
    replayed: list[int] = field(default_factory=list)


def _build(name: str, device: str) -> Case:
    case = next(c for c in CASES if c.name == name)
    token_map, num = engram_token_map(toy_tokenizer(case.cfg.vocab_size))
    cfg = finish(case.cfg, num)
    model = DeepseekV41(cfg, token_map, num)
    assign_weights(model, random_checkpoint(cfg, case.seed))
    model.eval().to(device)
    g = torch.Generator().manual_seed(case.seed)
    seqs = {
        f"r{i}": torch.randint(3, cfg.vocab_size, (n + MAX_TOKENS,), generator=g).tolist()
        for i, n in enumerate(PROMPTS)
    }
    fed = [s[:-1] for s in seqs.values()]  # the last sampled token is never fed
    ids = torch.zeros(len(fed), max(map(len, fed)), dtype=torch.long)
    for b, s in enumerate(fed):
        ids[b, : len(s)] = torch.tensor(s)  # right padding cannot reach earlier positions
    with torch.no_grad(), record_ours() as rec:
        reference = model(ids.to(device))
    keys = []
    for block in model.layers:
        a, layer = block.attn, block.layer
        keys.append((layer, "fp8"))
        keys += [(layer, "kv4"), (layer, "idx4k")] if a.ratio and a.compressor is not None else []
        keys += [(layer, "idx4q")] if a.ratio and a.indexer is not None else []
    assert [ROUNDING[k][0] for _, k in keys] == [c.kind for c in rec.quant]
    exempt = {rid: len(s) for rid, s in zip(seqs, fed)}
    for b, pos, _ in topk_margins(rec, *ids.shape, margin=tol.SAME_MODEL_TOPK_MARGIN_MIN)[1]:
        rid = f"r{b}"
        exempt[rid] = min(exempt[rid], pos)
    return Case(model, seqs, reference, dict(zip(keys, rec.quant)), exempt)


_CASES: dict[tuple[str, str], Case] = {}


def case(name: str, device: str = "cpu") -> Case:
    if (name, device) not in _CASES:
        _CASES[(name, device)] = _build(name, device)
    return _CASES[(name, device)]


def replay(c: Case, aliases: dict[str, str] | None = None):
    """The cached run's rounding hook: the reference's value at traced near-boundary elements.
    ``aliases`` maps extra request ids (a fork) to the request whose sequence they share."""
    batch_of = {rid: b for b, rid in enumerate(c.seqs)}
    batch_of.update({alias: batch_of[rid] for alias, rid in (aliases or {}).items()})

    def hook(kind, layer, x, request_ids, index):
        call = c.calls[(layer, kind)]
        rows = torch.tensor([batch_of[r] for r in request_ids], dtype=torch.long, device=index.device)
        before = call.before[rows, index].to(x.dtype)
        near = boundary_distance(QuantCall(ROUNDING[kind][0], x, x)) <= tol.FLIP_BOUNDARY_TOL
        snap = near & ((x - before).abs() <= tol.FLIP_BOUNDARY_TOL)
        snapped = torch.where(snap, before, x)
        rounding = ROUNDING[kind][1]
        c.replayed.append(int((rounding(snapped) != rounding(x)).sum()))
        return snapped

    return hook


@dataclass
class Run:
    logits: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    tables: dict[str, list[int]] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (first, last) position of non-initial prefill chunks
    runner: ModelRunner | None = None


def drive(c: Case, budget: int, corrupt=None, batch_invariant: bool = False) -> Run:
    cfg = c.model.cfg
    ratios = sorted({cfg.ratio(layer) for layer in cfg.kv_source_layer_ids}, reverse=True)
    n = len(c.seqs)
    config = EngineConfig(
        block_size=BLOCK,
        num_blocks=64,
        num_state_slots=n + 1,
        max_num_seqs=n,
        max_num_batched_tokens=budget,
        max_model_len=128,
        batch_invariant=batch_invariant,
    ).worker_config()
    runner = ModelRunner(c.model, config, rounding=None if batch_invariant else replay(c))
    c.replayed.clear()
    sched = Scheduler(
        SchedulerConfig(
            block_size=BLOCK,
            num_blocks=64,
            num_state_slots=n + 1,
            max_num_seqs=n,
            max_num_batched_tokens=budget,
            max_model_len=128,
            window_size=cfg.sliding_window,
            compress_ratios=ratios,
        )
    )
    for rid, s in c.seqs.items():
        sched.add_request(rid, s[:-MAX_TOKENS], max_tokens=MAX_TOKENS, ignore_eos=True)
    fed: list[int] = []
    hook = c.model.embed.register_forward_hook(lambda m, args, out: fed.append(args[0].numel()))
    run = Run(runner=runner)
    try:
        while sched.has_unfinished():
            plan = sched.schedule()
            if corrupt is not None:
                corrupt(plan, runner)
            fed.clear()
            out = runner.execute(plan, all_rows=True)
            seqlens_q = plan.seqlens_q.tolist()
            # One model call holding exactly Σ seqlen_q rows: nothing recomputes a prefix.
            assert fed == [sum(seqlens_q)] and out.num_rows_computed == sum(seqlens_q) == plan.num_rows
            assert out.expert_counts.sum(1).tolist() == [plan.num_rows * cfg.num_experts_per_tok] * len(c.model.layers)
            positions, owners = plan.positions.tolist(), plan.row_requests.tolist()
            for row, (pos, i) in enumerate(zip(positions, owners)):
                run.logits[(plan.request_ids[i], pos)] = out.logits[row]
            width = plan.block_table_width
            tables = plan.block_tables.tolist()
            for i, rid in enumerate(plan.request_ids):
                run.tables[rid] = tables[i * width : (i + 1) * width]
                run.slots[rid] = plan.state_slots[i]
                first, last = positions[plan.query_start[i]], positions[plan.query_start[i + 1] - 1]
                if plan.is_prefill and first > 0:
                    run.chunks.append((first, last))
            sched.update(plan, run_step(plan, lambda rid, pos: c.seqs[rid][pos]))
    finally:
        hook.remove()
    return run


def _worst(c: Case, run: Run) -> tuple[float, int]:
    worst, compared = 0.0, 0
    for b, (rid, s) in enumerate(c.seqs.items()):
        for pos in range(len(s) - 1):
            assert (rid, pos) in run.logits, f"{rid} position {pos} never ran"
            if pos >= c.exempt_from[rid]:
                continue
            worst = max(worst, float((run.logits[(rid, pos)] - c.reference[b, pos]).abs().max()))
            compared += 1
    return worst, compared


@pytest.mark.parametrize(
    "name, budget",
    [("oracle", 7), ("oracle", 16), ("oracle", 64), ("wide", 5), ("wide", 23), ("nocand", 11), ("nocand", 32)],
)
def test_engine_equals_model(name, budget):
    _engine_equals_model(case(name), budget)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name, budget", [("oracle", 7), ("wide", 5), ("nocand", 32)])
def test_engine_equals_model_on_cuda(name, budget):
    torch.backends.cuda.matmul.allow_tf32 = False
    _engine_equals_model(case(name, "cuda"), budget)


def _engine_equals_model(c: Case, budget: int) -> None:
    name = next(n for (n, _), v in _CASES.items() if v is c)
    run = drive(c, budget)
    total = sum(len(s) - 1 for s in c.seqs.values())
    worst, compared = _worst(c, run)
    print(
        f"\n{name} budget {budget}: max |Δ| {worst:.3g} over {compared}/{total} positions, "
        f"{sum(c.replayed)} replayed near-boundary roundings, chunks {run.chunks}"
    )
    assert 1 - compared / total <= tol.MAX_EXEMPT_FRACTION, "too many oracle near ties: reseed"
    assert worst <= tol.PREFIX_ATOL
    if budget < 64:  # the budget really cut prompts inside a ratio-2 group and across a block
        assert any(first % 2 for first, _ in run.chunks)
        assert any(first // BLOCK != last // BLOCK for first, last in run.chunks)


def reference_in_mode(c: Case) -> torch.Tensor:
    """The full forward's logits [B, S, V] over the fed sequences (right-padded), in batch-invariant mode."""
    fed = [s[:-1] for s in c.seqs.values()]
    ids = torch.zeros(len(fed), max(map(len, fed)), dtype=torch.long)
    for b, s in enumerate(fed):
        ids[b, : len(s)] = torch.tensor(s)
    with torch.no_grad(), batch_invariant():
        return c.model(ids)


@pytest.mark.parametrize("name, budget", [("oracle", 7), ("oracle", 64), ("wide", 5), ("nocand", 11)])
def test_engine_equals_model_exactly_in_batch_invariant_mode(name, budget):
    """In batch-invariant mode the cached engine's logits equal the full forward's under ``==`` at every
    position of every request: no traced flips, no exempt near ties (model/batch_invariant.py)."""
    c = case(name)
    reference = reference_in_mode(c)
    run = drive(c, budget, batch_invariant=True)
    for b, (rid, s) in enumerate(c.seqs.items()):
        for pos in range(len(s) - 1):
            assert torch.equal(run.logits[(rid, pos)], reference[b, pos]), f"{rid} position {pos}"


def test_pool_entries_equal_the_reference_rounding():
    c = case("oracle")
    run = drive(c, 7)
    cfg = c.model.cfg
    ring = run.runner.cache.layout.ring_size
    for b, (rid, s) in enumerate(c.seqs.items()):  # each ring holds its request's last ring_size positions
        positions = torch.arange(max(0, len(s) - 1 - ring), len(s) - 1)
        for layer in range(cfg.num_hidden_layers):
            window = run.runner.cache.read_window(layer, torch.tensor([run.slots[rid]]))[0]
            assert torch.equal(window[positions % ring], c.calls[(layer, "fp8")].after[b, positions])
    for layer in cfg.kv_source_layer_ids:
        ratio = cfg.ratio(layer)
        for b, rid in enumerate(c.seqs):
            count = (len(c.seqs[rid]) - 1) // ratio
            kv, keys = run.runner.cache.read_entries(layer, torch.tensor([run.tables[rid]]), count)
            assert torch.equal(kv[0], c.calls[(layer, "kv4")].after[b, :count])
            assert torch.equal(keys[0], c.calls[(layer, "idx4k")].after[b, :count])


def test_corrupting_one_block_changes_later_logits_of_its_request_only():
    c = case("oracle")
    clean = drive(c, 16, batch_invariant=True)
    g = torch.Generator().manual_seed(0)
    victim, done = "r2", []

    def corrupt(plan, runner):
        if plan.is_prefill or done:
            return
        block = clean.tables[victim][0]
        cache = runner.cache
        for layer in c.model.cfg.kv_source_layer_ids:  # new FP4 codes, same scales: finite values
            for pool, half in zip(cache.entries(layer), (cache.layout.head_dim // 2, cache.layout.index_head_dim // 2)):
                pool[block, :, :half] = torch.randint(
                    0, 256, pool[block, :, :half].shape, generator=g, dtype=torch.uint8
                )
        done.append(block)

    broken = drive(c, 16, corrupt, batch_invariant=True)
    assert done
    start = len(c.seqs[victim]) - MAX_TOKENS
    moved = max(
        float((broken.logits[(victim, p)] - clean.logits[(victim, p)]).abs().max())
        for p in range(start, start + MAX_TOKENS - 1)
    )
    assert moved >= tol.SENSITIVITY_MIN_MOVE
    # Other requests see none of it, bit for bit: the victim's new routing changes the MoE's per-expert
    # row counts, which in batch-invariant mode cannot move another row's result.
    others = [
        key for key, logits in clean.logits.items() if key[0] != victim and not torch.equal(broken.logits[key], logits)
    ]
    print(f"\ncorrupted block {done[0]}: victim moved {moved:.3g}")
    assert others == []


def test_a_placeholder_step_runs_nothing():
    c = case("oracle")
    runner = ModelRunner(c.model, EngineConfig(block_size=BLOCK, max_model_len=64, max_num_seqs=2).worker_config())
    plan = Scheduler(
        scheduler_config(block_size=BLOCK, num_blocks=8, num_state_slots=3, window_size=8, compress_ratios=[2, 1])
    ).schedule()
    assert plan.is_placeholder
    out = runner.execute(plan)
    assert out.logits.shape == (0, c.model.cfg.vocab_size) and out.num_rows_computed == 0
    assert not out.expert_counts.any()


def test_a_fork_continues_from_copied_blocks_and_slot():
    """Fork after prefill: the child shares full blocks, gets the partial block and the state slot
    copied (plan.block_copies / state_copies, done before the forward), and decodes like its parent."""
    c = case("oracle")
    parent = "r2"  # 45 prompt tokens: 2 full 16-token blocks and a partial one
    seq = c.seqs[parent]
    ratios = sorted({c.model.cfg.ratio(layer) for layer in c.model.cfg.kv_source_layer_ids}, reverse=True)
    # Batch-invariant mode: the child's rows equal the parent's and the full forward's under ==.
    config = EngineConfig(
        block_size=BLOCK, num_blocks=32, num_state_slots=3, max_num_seqs=2, max_model_len=128, batch_invariant=True
    )
    runner = ModelRunner(c.model, config.worker_config())
    sched = Scheduler(
        SchedulerConfig(
            block_size=BLOCK,
            num_blocks=32,
            num_state_slots=3,
            max_num_seqs=2,
            max_num_batched_tokens=64,
            max_model_len=128,
            window_size=c.model.cfg.sliding_window,
            compress_ratios=ratios,
        )
    )
    sched.add_request(parent, seq[:-MAX_TOKENS], max_tokens=MAX_TOKENS, ignore_eos=True)
    logits: dict[tuple[str, int], torch.Tensor] = {}
    copies = []
    while sched.has_unfinished():
        plan = sched.schedule()
        copies += [*plan.block_copies, *plan.state_copies]
        out = runner.execute(plan, all_rows=True)
        for row, (pos, i) in enumerate(zip(plan.positions.tolist(), plan.row_requests.tolist())):
            logits[(plan.request_ids[i], pos)] = out.logits[row]
        sched.update(plan, run_step(plan, lambda rid, pos: seq[pos]))
        if plan.is_prefill and sched.request("child") is None:
            sched.fork(parent, "child", max_tokens=MAX_TOKENS - 1, ignore_eos=True)
    assert len(copies) == 2  # the partial block and the state slot
    b = list(c.seqs).index(parent)
    start = len(seq) - MAX_TOKENS
    child = [p for rid, p in logits if rid == "child"]
    assert child and min(child) == start
    reference = reference_in_mode(c)
    for p in child:
        assert torch.equal(logits[("child", p)], reference[b, p])
        assert torch.equal(logits[("child", p)], logits[(parent, p)])


def test_a_plan_for_another_ring_size_is_refused():
    c = case("oracle")
    runner = ModelRunner(c.model, EngineConfig(block_size=BLOCK, max_model_len=64, max_num_seqs=2).worker_config())
    sched = Scheduler(
        scheduler_config(
            block_size=BLOCK, num_blocks=8, num_state_slots=3, window_size=8, nextn=7, compress_ratios=[2, 1]
        )
    )
    sched.add_request("a", list(range(3, 40)), max_tokens=2)
    with pytest.raises(ValueError, match="not position mod 14"):
        runner.execute(sched.schedule())
