"""The static decode step (the code a CUDA graph captures) equals the eager cached runner.

Two runners with their own pools execute the same plans from the real scheduler: prefill chunks
and then ≥ 20 decode steps for five requests of different lengths (ratio-2 groups close on every
other step, at different steps for different requests; the batch shrinks as requests finish, so
the steps run padded to graph sizes 8, 4, 2 and 1). After every decode step the static step's
logits equal ModelRunner's and both runners' pools hold the same bytes outside the null block 0 and
the null slot 0. Configs (tests/model/deepseek_v41/oracle_configs.py): "oracle" has a ratio-2 and
a ratio-1 source, Reindex layers and candidates; "nocand" two ratio-2 sources and no candidates.

Speculative decoding's verify steps (``nextn`` > 0): the fake worker (``verify_result``) accepts and
proposes varying numbers of drafts, so a step's requests have 1 … 1 + nextn rows each, mixed; the
rings wrap and ratio-2 groups close and straddle inside a request's rows.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from model.batch_invariant import batch_invariant
from scheduler_rs import Scheduler, SchedulerConfig, StepPlan, StepResult
from services.engine.config import EngineConfig
from services.worker.runners.decode_step_graphs import DecodeStepGraphs
from services.worker.runners.model_runner import ModelRunner
from services.worker.runners.reference_runner import RunnerOutput
from services.worker.runners.static_decode_step import StaticDecodeStep
from services.worker.state.cache_engine import CacheEngine
from tests import tolerances as tol
from tests.scheduler_rs.fake_worker import run_step
from tests.services.worker.runners.test_model_runner import BLOCK, case

PROMPTS = (9, 14, 20, 27, 33)
MAX_TOKENS = (24, 21, 23, 22, 20)
MAX_SEQS = 8  # graph sizes 1, 2, 4, 8: five requests run padded to 8
MAX_LEN = 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def setup(
    name: str,
    device: str = "cpu",
    attention: str = "reference",
    use_graphs: bool = False,
    prompts: tuple[int, ...] = PROMPTS,
    max_tokens: tuple[int, ...] = MAX_TOKENS,
    max_seqs: int = MAX_SEQS,
    model=None,
    backend: str | None = None,
    with_taps: bool = False,
    batch_invariant: bool = False,
    nextn: int = 0,
):
    """(scheduler, eager ModelRunner, DecodeStepGraphs on its own pools, token_at, config) for one request per
    prompt; ``model`` (default: the case's), ``backend``, ``with_taps``, ``batch_invariant`` (the config's)
    and ``nextn`` (drafts verified per step at most: the ring's size) go to both ModelRunners ("kernels"
    converts the model in place: pass a copy)."""
    model = model if model is not None else case(name, device).model
    cfg = model.cfg
    ratios = sorted({cfg.ratio(layer) for layer in cfg.kv_source_layer_ids}, reverse=True)
    num_blocks = max_seqs * (MAX_LEN // BLOCK) + 1
    config = EngineConfig(
        block_size=BLOCK,
        num_blocks=num_blocks,
        num_state_slots=max_seqs + 1,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=64,
        max_model_len=MAX_LEN,
        batch_invariant=batch_invariant,
    ).worker_config()
    sched = Scheduler(
        SchedulerConfig(
            block_size=BLOCK,
            num_blocks=num_blocks,
            num_state_slots=max_seqs + 1,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=64,
            max_model_len=MAX_LEN,
            window_size=cfg.sliding_window,
            compress_ratios=ratios,
            nextn=nextn,
            spec_varlen=nextn > 0,
        )
    )  # no cost curve: every proposed draft verified
    g = torch.Generator().manual_seed(7)
    seqs = {
        f"r{i}": torch.randint(3, cfg.vocab_size, (n + m + nextn,), generator=g).tolist()  # drafts overshoot
        for i, (n, m) in enumerate(zip(prompts, max_tokens))
    }
    for (rid, s), n, m in zip(seqs.items(), prompts, max_tokens):
        sched.add_request(rid, s[:n], max_tokens=m, ignore_eos=True)
    eager = ModelRunner(model, config, backend=backend, with_taps=with_taps, nextn=nextn)
    static = DecodeStepGraphs(
        ModelRunner(model, config, backend=backend, with_taps=with_taps, nextn=nextn),
        config,
        use_graphs=use_graphs,
        attention=attention,
    )
    return sched, eager, static, lambda rid, pos: seqs[rid][pos], config


def pool_differences(ca: CacheEngine, cb: CacheEngine) -> tuple[int, float, bool]:
    """(quantized elements that differ: window rings, entries; max |Δ| of the fp32 partial groups;
    Engram histories equal), except the null block 0 and slot 0 (placeholder rows' scratch)."""
    lay = ca.layout
    flips = sum(int((ca.ring(layer)[1:] != cb.ring(layer)[1:]).any(-1).sum()) for layer in range(lay.num_layers))
    partial = 0.0
    for s in lay.sources:
        flips += sum(int((x[1:] != y[1:]).any(-1).sum()) for x, y in zip(ca.entries(s.layer), cb.entries(s.layer)))
        if s.partial_rows:
            partial = max(partial, float((ca.partial(s.layer)[1:] - cb.partial(s.layer)[1:]).abs().max()))
    return flips, partial, torch.equal(ca.engram_history()[1:], cb.engram_history()[1:])


def verify_result(plan: StepPlan, token_at, step: int, nextn: int) -> StepResult:
    """The fake worker of a verify step: request i of the plan accepts (i + step) mod (drafts + 1) of
    the drafts it verifies and proposes (i + 2·step) mod (nextn + 1) new ones, so rows per request vary
    over 1 … 1 + nextn, within a step and across steps (an input row's token does not matter here)."""
    num_tokens, token_ids, num_drafts, draft_ids = [], [], [], []
    seqlens_k, sampled = plan.seqlens_k.tolist(), plan.num_sample_rows.tolist()
    for i, request_id in enumerate(plan.request_ids):
        if plan.is_prefill:
            n, first = sampled[i], seqlens_k[i]
        else:
            n, first = 1 + (i + step) % sampled[i], seqlens_k[i] - sampled[i] + 1
        num_tokens.append(n)
        token_ids.extend(token_at(request_id, first + j) for j in range(n))
        d = (i + 2 * step) % (nextn + 1)
        num_drafts.append(d)
        draft_ids.extend(3 + (13 * j + step) % 200 for j in range(d))
    return StepResult(num_tokens, token_ids, num_drafts, draft_ids)


@dataclass
class VerifyRows:
    """What the verify steps of a run covered."""

    rows_per_request: set[int] = field(default_factory=set)  # every request's row count seen
    mixed_steps: int = 0  # steps with requests of one row and requests of several
    closes_inside: int = 0  # ratio-2 groups closed by a request's later row (both members in the step)
    wrapped_inside: int = 0  # requests whose rows this step span a ring wrap (position mod ring restarts)


def verify_rows(plan: StepPlan, ring_size: int, seen: VerifyRows) -> None:
    starts, positions = plan.query_start.tolist(), plan.positions.tolist()
    closing = set(plan.entry_writes(2)[0].tolist()) if 2 in plan.entry_ratios else set()
    counts = [b - a for a, b in zip(starts, starts[1:])]
    seen.rows_per_request.update(counts)
    seen.mixed_steps += min(counts) == 1 < max(counts)
    for a, b in zip(starts, starts[1:]):
        seen.closes_inside += len(closing & set(range(a + 1, b)))
        seen.wrapped_inside += any(positions[r] % ring_size == 0 for r in range(a + 1, b))


@dataclass
class Summary:
    sizes: list[int] = field(default_factory=list)  # graph size of each decode step
    worst: float = 0.0  # max |Δ| of the logits over steps without a bin flip
    worst_flipped: float = 0.0  # … over steps with one
    flipped_steps: int = 0
    verify: VerifyRows = field(default_factory=VerifyRows)  # with nextn


def compare_runs(
    name: str,
    device: str = "cpu",
    attention: str = "reference",
    use_graphs: bool = False,
    exact: bool = False,
    with_taps: bool = False,
    model=None,
    invariant: bool = False,
    nextn: int = 0,
) -> Summary:
    """Eager and static runners through one whole run of the same plans.

    ``exact``: never reset: logits, counts and pools must stay bit-identical over the whole run; the
    static step runs at G = the plan's rows (no padding), or with ``invariant`` (both runners in the
    batch-invariant mode, where the row count cannot move a bit) at the plan's graph size.
    Otherwise (graph sizes; on the "triton" path the kernels' attention order): each step starts from the eager
    runner's pools, so fp32 noise (~1e-6: other GEMM row counts, another softmax order) cannot
    compound; where it moves a value on an FP8/FP4 rounding edge into the next bin (a quantized
    element differing in the pools) that step's logits may move up to SENSITIVITY_MIN_MOVE (what a
    real error at least moves), every other step's stay within PREFIX_ATOL. ``nextn``: verify steps
    (``verify_result``); the scheduler's pool and queue invariants are checked after every step.
    """
    sched, eager, static, token_at, _ = setup(
        name, device, attention, use_graphs, with_taps=with_taps, model=model, batch_invariant=invariant, nextn=nextn
    )
    out, closes, step_index = Summary(), set(), 0
    while sched.has_unfinished():
        plan = sched.schedule()
        if not exact:
            static.runner.cache.blocks.copy_(eager.cache.blocks)
            static.runner.cache.slots.copy_(eager.cache.slots)
        want = eager.execute(plan, all_rows=True)
        if exact and not invariant and StaticDecodeStep.fits(plan):
            step = static.step(plan.num_rows)
            step.fill(plan)
            logits, counts, taps = step.run()
            got = RunnerOutput(logits, counts.cpu(), plan.num_rows, taps)
        else:
            got = static.execute(plan, all_rows=True)
        if with_taps:  # the DSpark target features the speculator reads (speculative decoding on graphs)
            assert got.taps is not None and torch.equal(got.taps, want.taps), f"taps differ at {plan}"
        flips, partial, engram_equal = pool_differences(eager.cache, static.runner.cache)
        assert engram_equal and partial <= tol.FLIP_BOUNDARY_TOL
        if exact:
            assert flips == 0 and partial == 0 and torch.equal(got.logits, want.logits), f"not bit-identical at {plan}"
        if StaticDecodeStep.fits(plan):
            out.sizes.append(plan.graph_size)
            closes.add(tuple(sorted(plan.entry_writes(2)[0].tolist())) if 2 in plan.entry_ratios else ())
            assert got.logits.shape == want.logits.shape == (plan.num_rows, eager.cfg.vocab_size)
            assert torch.equal(got.expert_counts, want.expert_counts), f"expert counts differ at {plan}"
            assert got.num_rows_computed == plan.num_rows
            delta = float((got.logits - want.logits.to(got.logits.device)).abs().max())
            if flips:
                out.flipped_steps += 1
                out.worst_flipped = max(out.worst_flipped, delta)
            else:
                out.worst = max(out.worst, delta)
        if nextn:
            if StaticDecodeStep.fits(plan):
                verify_rows(plan, eager.cache.layout.ring_size, out.verify)
            sched.update(plan, verify_result(plan, token_at, step_index, nextn))
            sched.check_invariants()
        else:
            sched.update(plan, run_step(plan, token_at))
        step_index += 1
    stats = sched.stats()  # the pools conserve: every block and slot back
    assert (stats.num_free_blocks, stats.num_free_state_slots) == (stats.num_total_blocks, stats.num_total_state_slots)
    if nextn:  # the verify-step cases the brief names, each seen
        v = out.verify
        assert (
            v.rows_per_request == set(range(1, nextn + 2)) and v.mixed_steps and v.closes_inside and v.wrapped_inside
        ), v
    else:
        assert len(out.sizes) >= 20 and {8, 4, 2, 1} <= set(out.sizes), out.sizes
    assert len(closes) > 2  # ratio-2 groups close on some steps and not others, for different rows
    assert out.worst <= tol.PREFIX_ATOL, f"static vs eager logits: max |Δ| {out.worst:.3g} without a bin flip"
    assert out.worst_flipped < tol.SENSITIVITY_MIN_MOVE, f"a bin flip moved the logits {out.worst_flipped:.3g}"
    assert out.flipped_steps <= len(out.sizes) // 4, f"{out.flipped_steps} of {len(out.sizes)} steps flipped a bin"
    return out


@pytest.mark.parametrize("name", ["oracle", "nocand"])
def test_static_step_equals_model_runner(name):
    out = compare_runs(name)
    print(
        f"\n{name}: {len(out.sizes)} decode steps at graph sizes {sorted(set(out.sizes))}: max |Δ| {out.worst:.3g}, "
        f"{out.worst_flipped:.3g} on the {out.flipped_steps} steps with a bin flip"
    )


def test_static_step_is_bit_identical_at_equal_row_counts():
    """Ring, compressor, partial groups, Engram history, indexer, selection and attention (its undo-RoPE
    included: ``static_attend`` runs TorchAttention's ops) are the eager step's bit for bit: only GEMM row
    counts differ in the runs above."""
    # The DSpark target features too (speculative decoding's decode steps without drafts replay graphs): the
    # case has no draft, so its copy taps three of its own layers.
    model = copy.deepcopy(case("oracle").model)
    model.cfg = dataclasses.replace(model.cfg, dspark_target_layer_ids=(2, 5, 7))
    compare_runs("oracle", exact=True, with_taps=True, model=model)


def test_static_step_equals_model_runner_exactly_in_batch_invariant_mode():
    """The mode's promise (docs/batch-invariance.md): the static step padded to graph sizes 8, 4, 2 and 1
    gives the eager step's logits, counts and pools bit for bit over the whole run, never reset. A decode
    row's attention output is undone from RoPE at a nonzero angle in every layer, so an undo-RoPE that
    rounds otherwise than the eager step's (the kernel reference's cos/sin pairs against the model's
    ``torch.polar`` product: 1 ulp) fails here from the first decode step."""
    compare_runs("oracle", exact=True, invariant=True)


@pytest.mark.parametrize("invariant", [False, True], ids=["unpadded", "graph-size"])
def test_verify_steps_are_bit_identical(invariant):
    """Speculative decoding's verify steps in the static step: 1 … 4 rows per request, mixed, ring wraps and
    ratio-2 groups closing inside a request's rows; logits, counts, taps and pools == the eager step's over
    the whole run, at the plan's rows and padded to its graph size (batch-invariant mode)."""
    model = copy.deepcopy(case("oracle").model)
    model.cfg = dataclasses.replace(model.cfg, dspark_target_layer_ids=(2, 5, 7))
    out = compare_runs("oracle", exact=True, with_taps=True, model=model, nextn=3, invariant=invariant)
    print(f"\n{len(out.sizes)} verify steps at graph sizes {sorted(set(out.sizes))}: {out.verify}")


def _decode_plan(name: str) -> tuple[StepPlan, ModelRunner]:
    """The first decode plan of the five requests (graph size 8, three padding rows), after prefill."""
    sched, eager, _, token_at, _ = setup(name)
    while True:
        plan = sched.schedule()
        if StaticDecodeStep.fits(plan):
            return plan, eager
        eager.execute(plan)
        sched.update(plan, run_step(plan, token_at))


def test_padding_rows_change_nothing():
    """The same plan at 5 rows and padded to 8: same logits, same counts, same pools; the padded run
    writes nothing outside the plan's blocks and slots but the null block 0 and slot 0."""
    plan, runner = _decode_plan("oracle")
    assert plan.num_rows == 5 and plan.graph_size == 8 and plan.num_padding_rows == 3
    cache = runner.cache
    blocks, slots = cache.blocks.clone(), cache.slots.clone()
    results = {}
    for size in (5, 8):
        cache.blocks.copy_(blocks)
        cache.slots.copy_(slots)
        step = StaticDecodeStep(runner.model, cache, size, MAX_LEN // BLOCK, attention="reference")
        step.fill(plan)
        with batch_invariant():  # the padded GEMM row count cannot move a bit (docs/batch-invariance.md)
            logits, counts, _ = step.run()
        after = CacheEngine(runner.cfg, BLOCK, 1, 1, cache.layout.ring_size)
        after.blocks, after.slots = cache.blocks.clone(), cache.slots.clone()
        results[size] = (logits[:5].clone(), counts.clone(), after)
    (l5, c5, p5), (l8, c8, p8) = results[5], results[8]
    assert torch.equal(l5, l8)
    assert torch.equal(c5, c8) and int(c8.sum()) == 5 * runner.cfg.num_experts_per_tok * runner.cfg.num_hidden_layers
    assert pool_differences(p5, p8) == (0, 0.0, True)
    used = set(plan.block_tables.tolist()) - {0}
    others = [b for b in range(1, blocks.shape[0]) if b not in used]
    assert torch.equal(p8.blocks[others], blocks[others])
    used = set(plan.state_slots.tolist())
    others = [s for s in range(1, slots.shape[0]) if s not in used]
    assert torch.equal(p8.slots[others], slots[others])


def test_plans_it_does_not_fit_run_eagerly():
    sched, eager, static, token_at, _ = setup("oracle")
    plan = sched.schedule()
    assert plan.is_prefill and not StaticDecodeStep.fits(plan)
    got = static.execute(plan)
    assert static.num_eager == 1 and got.logits.shape[0] == plan.sample_rows.__len__()
    with pytest.raises(ValueError, match="not a decode plan"):
        static.step(8).fill(plan)


def step_kernels_interpreted():
    from types import SimpleNamespace

    from kernels.interpret import load_interpreted

    return SimpleNamespace(
        **{
            name: load_interpreted(name)
            for name in ("decode_attention", "compressor", "indexer", "window_write", "indexer_quant", "entry_slots")
        },
        interpreted=True,
    )


@pytest.mark.parametrize("name", ["oracle", "nocand"])
def test_triton_path_interpreted_equals_reference(name):
    """The "triton" path's glue on CPU: compressor, indexer and attention kernels interpreted, one
    decode plan padded 5 → 8 (ratio-2 groups closing for some rows), from the same pools as the
    "reference" path: same logits (fp32 noise), counts, selections and pools but bin flips."""
    from kernels.interpret import interpreter

    plan, runner = _decode_plan(name)
    cache = runner.cache
    blocks, slots = cache.blocks.clone(), cache.slots.clone()
    kernels, results = step_kernels_interpreted(), {}
    for attention in ("reference", "triton"):
        cache.blocks.copy_(blocks)
        cache.slots.copy_(slots)
        step = StaticDecodeStep(runner.model, cache, 8, MAX_LEN // BLOCK, attention=attention, kernels=kernels)
        step.fill(plan)
        with interpreter():
            logits, counts, _ = step.run()
        after = CacheEngine(runner.cfg, BLOCK, 1, 1, cache.layout.ring_size)
        after.blocks, after.slots = cache.blocks.clone(), cache.slots.clone()
        results[attention] = (logits[:5].clone(), counts.clone(), after, step.backend.sparse.selected[:5].clone())
    (lr, cr, pr, sr), (lt, ct, pt, st) = results["reference"], results["triton"]
    flips, partial, engram_equal = pool_differences(pr, pt)
    delta = float((lr - lt).abs().max())
    print(f"\n{name}: triton (interpreted) vs reference: max |Δ| logits {delta:.3g}, {flips} pool bin flips")
    assert torch.equal(cr, ct) and engram_equal and flips <= 4
    # A bin flip (fp32 noise at an FP4 edge: tests/kernels/test_compressor.py) moves later layers' inputs.
    assert partial <= (tol.SENSITIVITY_MIN_MOVE if flips else tol.FLIP_BOUNDARY_TOL)
    assert torch.equal(sr, st) or flips, "selections differ without a key bin flip"
    assert delta <= (tol.SENSITIVITY_MIN_MOVE if flips else tol.PREFIX_ATOL)


class _Forgetful(dict):
    """An AttentionStep turn cache that keeps nothing: every layer computes its own RoPE turns (as before
    the cache)."""

    def __setitem__(self, key, value) -> None:
        pass


def test_rope_turns_once_per_frequency_set_change_no_bit(monkeypatch):
    """Fewer glue launches: a step computes the RoPE turns once per frequency set (2 in the oracle
    case: main and compress base), not once per layer; its logits, counts and pools (null block and slot
    included) are == to every layer computing its own, in the batch-invariant mode, padded 5 → 8."""
    import services.worker.attention.step as attention_step

    plan, runner = _decode_plan("oracle")
    cache, layers = runner.cache, runner.model.layers
    blocks, slots = cache.blocks.clone(), cache.slots.clone()
    computed: list[int] = []
    turns = attention_step.rope_turns
    monkeypatch.setattr(attention_step, "rope_turns", lambda angles: computed.append(1) or turns(angles))
    results = {}
    for per_layer in (True, False):
        cache.blocks.copy_(blocks)
        cache.slots.copy_(slots)
        step = StaticDecodeStep(runner.model, cache, 8, MAX_LEN // BLOCK, attention="reference")
        step.fill(plan)
        if per_layer:
            monkeypatch.setattr(step.step, "reset", lambda s=step.step: setattr(s, "_turns", _Forgetful()))
        computed.clear()
        with batch_invariant():
            logits, counts, _ = step.run()
        results[per_layer] = (logits.clone(), counts.clone(), cache.blocks.clone(), cache.slots.clone(), len(computed))
    (l0, c0, b0, s0, n0), (l1, c1, b1, s1, n1) = results[True], results[False]
    assert torch.equal(l0, l1) and torch.equal(c0, c1) and torch.equal(b0, b1) and torch.equal(s0, s1)
    assert n0 == len(layers) and n1 == len({block.attn.rope_key for block in layers}) == 2


@pytest.mark.slow  # two interpreted kernel-backend steps: about 50 s on one core
def test_glue_folded_into_kernels_changes_no_bit(monkeypatch):
    """Fewer glue launches, on the GPU step's code (kernel backend, "triton" attention, every
    kernel interpreted, padded 5 → 8): RoPE reading its pairs in place, the index weights' scale inside the
    indexer kernel and the MoE combine writing the dead rows' zeros give logits, counts and pools == to
    their torch forms (the pairs copied, torch's ``w * scale``, ``torch.where`` after the combine); and the
    launches folded into neighbours (the activations quantised inside the FP8 GEMMs, the router's split
    finished by its last program, the MoE layout in the router's launch) == to their own launches
    (``quantize_act`` first, the finishing kernel, ``moe_layout``)."""
    import functools

    import model.deepseek_v41.rope as rope
    import services.worker.attention.graph_backend as graph
    import services.worker.kernel_model.fp8_linear as fp8_linear
    from kernels.interpret import interpreter, load_interpreted
    from services.worker.kernel_model.kernel_set import KernelSet

    plan, torch_runner = _decode_plan("oracle")
    kernels = KernelSet(*(load_interpreted(name) for name in KernelSet.NAMES), interpreted=True)
    model = copy.deepcopy(case("oracle").model)
    config = EngineConfig(
        block_size=BLOCK,
        num_blocks=torch_runner.cache.blocks.shape[0],
        num_state_slots=torch_runner.cache.slots.shape[0],  # the torch runner's whole slot pool, snapshots included
        max_num_seqs=8,
        max_model_len=MAX_LEN,
        enable_prefix_caching=False,
    ).worker_config()
    combine_experts = kernels.moe_grouped_gemm.moe_experts

    def torch_forms() -> None:
        def experts_then_where(*args, live=None, width=None, **kw):
            out = combine_experts(*args, **kw)[:, :width]
            return out if live is None else torch.where(live.unsqueeze(-1), out, 0.0)

        monkeypatch.setattr(rope, "_views_as_complex", lambda pairs: False)
        monkeypatch.setattr(
            graph, "index_weights", lambda idx, x: ((idx.weights_proj(x) * idx.weight_scale).float(), 1.0)
        )
        monkeypatch.setattr(kernels.moe_grouped_gemm, "moe_experts", experts_then_where)
        monkeypatch.setattr(fp8_linear, "IN_GEMM_MAX_ROWS", 0)
        monkeypatch.setattr(kernels.moe_grouped_gemm, "IN_GEMM_MAX_ROWS", 0)
        monkeypatch.setattr(
            kernels.moe_router, "moe_router", functools.partial(kernels.moe_router.moe_router, one_launch=False)
        )
        monkeypatch.delattr(kernels.moe_router, "moe_router_layout")  # the layout's own launch

    quantized = []
    quantize_act = kernels.quant_fp8.quantize_act
    monkeypatch.setattr(kernels.quant_fp8, "quantize_act", lambda x: quantized.append(x.shape) or quantize_act(x))
    results = []
    with interpreter():
        runner = ModelRunner(model, config, backend="kernels", kernels=kernels)
        static = DecodeStepGraphs(runner, config, use_graphs=False, attention="triton", kernels=kernels)
        for before in (False, True):
            if before:
                torch_forms()
            runner.cache.blocks.copy_(torch_runner.cache.blocks)
            runner.cache.slots.copy_(torch_runner.cache.slots)
            step = static.step(plan.graph_size)
            step.fill(plan)
            logits, counts, _ = step.run()
            results.append((logits.clone(), counts.clone(), runner.cache.blocks.clone(), runner.cache.slots.clone()))
            if not before:
                assert quantized == []  # every linear's 8 rows quantised inside its GEMM
    assert quantized  # ... and by quantize_act in the torch forms' run
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert torch.isfinite(results[0][0][:5]).all()
