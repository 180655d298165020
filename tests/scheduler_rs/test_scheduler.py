"""The walkthrough's worked examples, replayed through the scheduler."""

import pytest

from scheduler_rs import EngineType, FinishReason, PreemptionMode, Scheduler, StepResult
from tests.scheduler_rs.configs import scheduler_config

from .fake_worker import run_step

EOS = 1


def step(scheduler, token_at=lambda request_id, pos: 100 + pos, **kwargs):
    plan = scheduler.schedule()
    outputs = scheduler.update(plan, run_step(plan, token_at, **kwargs))
    scheduler.check_invariants()
    return plan, outputs


def test_kitchen_step_table():
    # Pass 0: A = 6 tokens, B = 5, C = 4, an 8-token prefill budget; A generates "and", "slept",
    # ".", then the end token.
    scheduler = Scheduler(scheduler_config(block_size=4, num_blocks=64, num_state_slots=8, max_num_batched_tokens=8))
    for request_id, n in (("A", 6), ("B", 5), ("C", 4)):
        scheduler.add_request(request_id, list(range(10, 10 + n)), max_tokens=16, eos_token_id=EOS)
    a_output = {6: 50, 7: 51, 8: 52, 9: EOS}  # position -> token: "and", "slept", ".", end

    def token_at(request_id, pos):
        return a_output[pos] if request_id == "A" else 60 + pos

    table = []
    for _ in range(6):
        plan, outputs = step(scheduler, token_at)
        table.append(
            (plan.kind, plan.request_ids, plan.seqlens_q.tolist(), {o.request_id: o.token_ids for o in outputs})
        )
    assert table == [
        ("prefill", ["A", "B"], [6, 2], {"A": [50]}),
        ("prefill", ["B", "C"], [3, 4], {"B": [65], "C": [64]}),
        ("decode", ["A", "B", "C"], [1, 1, 1], {"A": [51], "B": [66], "C": [65]}),
        ("decode", ["A", "B", "C"], [1, 1, 1], {"A": [52], "B": [67], "C": [66]}),
        ("decode", ["A", "B", "C"], [1, 1, 1], {"A": [EOS], "B": [68], "C": [67]}),
        ("decode", ["B", "C"], [1, 1], {"B": [69], "C": [68]}),
    ]
    # Step 1 cut B after 2 tokens, so its second chunk starts at position 2.
    assert scheduler.request("B").num_computed_tokens == 5 + 4


def test_kitchen_a_finishes_with_stop_and_frees_everything():
    scheduler = Scheduler(scheduler_config(block_size=4, num_blocks=64, num_state_slots=8, max_num_batched_tokens=8))
    scheduler.add_request("A", list(range(10, 16)), max_tokens=16, eos_token_id=EOS)
    finals = []
    for pos_token in (50, 51, 52, EOS):
        _, outputs = step(scheduler, lambda request_id, pos, t=pos_token: t)
        finals += [o for o in outputs if o.finished]
    assert [(o.request_id, o.finish_reason, o.stop_token_id, o.num_output_tokens) for o in finals] == [
        ("A", FinishReason.STOP, EOS, 4)
    ]
    stats = scheduler.stats()
    assert (stats.num_free_blocks, stats.num_free_state_slots) == (stats.num_total_blocks, stats.num_total_state_slots)


def test_prompt_engine_fills_the_step_like_normal_when_the_budget_is_spent():
    config = scheduler_config(
        engine_type=EngineType.PROMPT, block_size=4, num_blocks=64, num_state_slots=8, max_num_batched_tokens=8
    )
    scheduler = Scheduler(config)
    for request_id, n in (("A", 6), ("B", 5), ("C", 4)):
        scheduler.add_request(request_id, list(range(10, 10 + n)), max_tokens=4)
    kinds = [step(scheduler)[0] for _ in range(3)]
    assert [(p.kind, p.request_ids) for p in kinds] == [
        ("prefill", ["A", "B"]),
        ("prefill", ["B", "C"]),
        ("prefill", []),
    ]
    assert kinds[2].is_placeholder  # a PROMPT engine never decodes


def test_decode_engine_refuses_prompts():
    scheduler = Scheduler(scheduler_config(engine_type=EngineType.DECODE))
    with pytest.raises(ValueError, match="P/D handoff"):
        scheduler.add_request("x", [1, 2], max_tokens=1)


def test_drawer_fork_shares_full_blocks_and_copies_the_partial_one():
    scheduler = Scheduler(scheduler_config(block_size=4, num_blocks=16, num_state_slots=4, window_size=3))
    scheduler.add_request("A", list(range(10, 16)), max_tokens=8)
    step(scheduler)  # prefill: positions 0-5 in two blocks
    parent = scheduler.request("A")
    assert len(parent.block_table) == 2 and parent.num_computed_tokens == 6
    scheduler.fork("A", "A2", max_tokens=8)
    child = scheduler.request("A2")
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] != parent.block_table[1]
    assert scheduler.block_ref_count(parent.block_table[0]) == 2
    plan, _ = step(scheduler)
    assert plan.block_copies == [(parent.block_table[1], child.block_table[1])]
    assert plan.state_copies == [(parent.state_slot, child.state_slot)]
    # The child prefills the one token without KV (position 6) and samples position 7.
    assert (plan.kind, plan.request_ids, plan.positions.tolist()) == ("prefill", ["A2"], [6])
    # A decodes positions 6 and 7 in its second block; position 8 takes a new block.
    step(scheduler)
    step(scheduler)
    assert len(scheduler.request("A").block_table) == 2
    plan, _ = step(scheduler)
    assert plan.positions.tolist()[plan.request_ids.index("A")] == 8
    assert len(scheduler.request("A").block_table) == 3
    scheduler.abort("A")
    assert scheduler.block_ref_count(child.block_table[0]) == 1  # the child still holds it


def test_fifty_thousand_token_prompt_aborted_between_chunks_returns_every_block():
    scheduler = Scheduler(scheduler_config(num_blocks=400, num_state_slots=4))
    scheduler.add_request("P", [5] * 50_000, max_tokens=16)
    plan, outputs = step(scheduler)
    assert plan.seqlens_q.tolist() == [32_768] and outputs == []
    stats = scheduler.stats()
    assert stats.num_total_blocks - stats.num_free_blocks == 391
    assert stats.num_total_state_slots - stats.num_free_state_slots == 1
    assert scheduler.request("P").status == "waiting"
    final = scheduler.abort("P")
    assert final.finish_reason == FinishReason.ABORT and final.token_ids == []
    scheduler.check_invariants()
    stats = scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks == 399
    assert stats.num_free_state_slots == stats.num_total_state_slots
    assert scheduler.abort("P") is None  # idempotent


def test_abort_a_running_request_yields_a_final_output():
    scheduler = Scheduler(scheduler_config(block_size=4, num_blocks=16, num_state_slots=4))
    scheduler.add_request("R", [3, 4, 5], max_tokens=8)
    step(scheduler)
    step(scheduler)
    final = scheduler.abort("R")
    assert (final.finish_reason, final.num_output_tokens) == (FinishReason.ABORT, 2)
    assert scheduler.stats().num_free_blocks == scheduler.stats().num_total_blocks


def _grow(target_outputs: dict[str, int]) -> Scheduler:
    """Requests with one-token prompts reaching the given output counts together, in a pool of
    one-token blocks sized so the free list is empty at the end."""
    num_held = sum(target_outputs.values())  # each holds num_computed = outputs blocks
    scheduler = Scheduler(
        scheduler_config(
            block_size=1, compress_ratios=[1], num_blocks=num_held + 1, num_state_slots=8, prefill_max_cache_usage=1.0
        )
    )
    longest = max(target_outputs, key=target_outputs.get)
    a_total = target_outputs[longest]
    # A request added when the longest has k outputs ends with k - 1 + its own count offset.
    start_at = {request_id: a_total - n + 1 for request_id, n in target_outputs.items() if request_id != longest}
    scheduler.add_request(longest, [3], max_tokens=10_000, ignore_eos=True)
    while True:
        state = scheduler.request(longest)
        produced = len(state.token_ids) - 1 if state else 0
        for request_id, k in list(start_at.items()):
            if produced == k:
                scheduler.add_request(request_id, [3], max_tokens=10_000, ignore_eos=True)
                del start_at[request_id]
        if produced == a_total:
            break
        plan, _ = step(scheduler)
        assert plan.outputs == []
    return scheduler


def test_preemption_takes_the_latest_arrival_when_a_row_needs_a_block():
    # Pass 3's pool: outputs A 3,000, B 1,200, C 400, D 50 and no free block. DeepInfer preempts the longest
    # output (A); the one order (docs/architecture.md) preempts the lowest priority, then the latest arrival (D).
    scheduler = _grow({"A": 3000, "B": 1200, "C": 400, "D": 50})
    assert {request_id: len(scheduler.request(request_id).token_ids) - 1 for request_id in "ABCD"} == {
        "A": 3000,
        "B": 1200,
        "C": 400,
        "D": 50,
    }
    assert scheduler.stats().num_free_blocks == 0
    plan = scheduler.schedule()
    assert [(o.request_id, o.finish_reason) for o in plan.outputs] == [("D", FinishReason.PREEMPTED)]
    assert plan.request_ids == ["A", "B", "C"]
    scheduler.update(plan, run_step(plan, lambda request_id, pos: 9))
    scheduler.check_invariants()


def test_no_preemption_when_the_free_list_is_empty_but_no_row_needs_a_block():
    # DeepInfer preempts whenever the free list is empty; ours only when a row needs a block.
    scheduler = Scheduler(scheduler_config(block_size=4, num_blocks=3, num_state_slots=4))
    scheduler.add_request("X", [3, 4, 5], max_tokens=8)
    scheduler.add_request("Y", [3, 4, 5], max_tokens=8)
    step(scheduler)
    assert scheduler.stats().num_free_blocks == 0
    plan, _ = step(scheduler)  # both write position 3, inside their first block
    assert plan.outputs == [] and plan.request_ids == ["X", "Y"]
    plan, _ = step(scheduler)  # now both need a second block: Y (the later arrival) goes, X gets its block
    assert [(o.request_id, o.finish_reason) for o in plan.outputs] == [("Y", FinishReason.PREEMPTED)]
    assert plan.request_ids == ["X"]


def test_recompute_preemption_prefills_the_victim_again():
    config = scheduler_config(block_size=4, num_blocks=3, num_state_slots=4, preemption_mode=PreemptionMode.RECOMPUTE)
    scheduler = Scheduler(config)
    scheduler.add_request("X", [3, 4, 5], max_tokens=3)
    scheduler.add_request("Y", [3, 4, 5], max_tokens=3)
    step(scheduler)
    step(scheduler)
    plan, _ = step(scheduler)
    assert plan.outputs == [] and plan.request_ids == ["X"]
    state = scheduler.request("Y")
    assert (state.status, state.num_computed_tokens, state.num_preemptions) == ("waiting", 0, 1)
    assert len(state.token_ids) == 5  # prompt plus two outputs, recomputed as one prompt


def test_grammar_requests_always_stop():
    config = scheduler_config(block_size=4, num_blocks=3, num_state_slots=4, preemption_mode=PreemptionMode.RECOMPUTE)
    scheduler = Scheduler(config)
    scheduler.add_request("X", [3, 4, 5], max_tokens=3)
    scheduler.add_request("Y", [3, 4, 5], max_tokens=3, constrained=True)
    step(scheduler)
    step(scheduler)
    plan, _ = step(scheduler)
    assert [(o.request_id, o.finish_reason) for o in plan.outputs] == [("Y", FinishReason.PREEMPTED)]


def test_several_ranks_wait_seventy_placeholder_steps_for_an_unready_head():
    # The other rank always wants prefill but never schedules anything itself.
    def vote(value, op):
        return value if op == "all" else value or False

    scheduler = Scheduler(scheduler_config(num_ranks=8, block_size=4, num_blocks=16, num_state_slots=4), vote)
    scheduler.add_request("r1", [3, 4, 5], max_tokens=4, schedulable=False)
    kinds = []
    for i in range(71):
        if i == 3:
            scheduler.set_schedulable("r1")  # the multimodal result arrives after the ALL point
        plan, _ = step(scheduler)
        kinds.append((plan.kind, plan.is_placeholder))
    assert kinds[:70] == [("decode", True)] * 70
    assert kinds[70] == ("prefill", False)


def test_one_rank_prefills_at_the_next_step():
    scheduler = Scheduler(scheduler_config(block_size=4, num_blocks=16, num_state_slots=4))
    scheduler.add_request("r1", [3, 4, 5], max_tokens=8)
    step(scheduler)
    step(scheduler)
    scheduler.add_request("r2", [3, 4, 5], max_tokens=8)
    plan, _ = step(scheduler)
    assert (plan.kind, plan.request_ids) == ("prefill", ["r2"])


def test_an_unschedulable_head_is_skipped_and_keeps_its_place():
    scheduler = Scheduler(scheduler_config(block_size=4, num_blocks=16, num_state_slots=4))
    scheduler.add_request("img", [3, 4], max_tokens=2, schedulable=False)
    scheduler.add_request("txt", [3, 4], max_tokens=2)
    plan, _ = step(scheduler)
    assert (plan.kind, plan.request_ids) == ("prefill", ["txt"]) and scheduler.stats().num_waiting == 1
    plan, _ = step(scheduler)
    assert (plan.kind, plan.request_ids) == ("decode", ["txt"])  # img still waits, holding nothing
    assert scheduler.request("img").block_table == [] and scheduler.stats().num_waiting == 1
    scheduler.set_schedulable("img")
    plan, _ = step(scheduler)
    assert (plan.kind, plan.request_ids) == ("prefill", ["img"])


def test_only_unschedulable_requests_waiting_is_no_prefill():
    scheduler = Scheduler(scheduler_config(block_size=4, num_blocks=16, num_state_slots=4))
    scheduler.add_request("img", [3, 4], max_tokens=2, schedulable=False)
    scheduler.add_request("img2", [3, 4, 5], max_tokens=2, schedulable=False)
    plan, _ = step(scheduler)
    assert plan.is_placeholder and scheduler.stats().num_waiting == 2


def test_ring_of_134_and_position_2004():
    config = scheduler_config(nextn=5, num_blocks=64, num_state_slots=4)
    assert config.ring_size == 134
    scheduler = Scheduler(config)
    scheduler.add_request("R", [3] * 2004, max_tokens=8)
    step(scheduler)
    plan = scheduler.schedule()
    assert plan.positions.tolist()[0] == 2004
    assert plan.ring_slots.tolist() == [p % 134 for p in range(2004, 2010)]
    assert plan.ring_slots.tolist()[0] == 128


def test_speculative_bookkeeping_commits_accepted_drafts_and_returns_blocks():
    # Pass 3 "The verifier rejects draft 3 of 5": 6 rows, 2 drafts accepted plus the sampled token.
    config = scheduler_config(block_size=4, nextn=5, num_blocks=32, num_state_slots=4)
    scheduler = Scheduler(config)
    scheduler.add_request("R", [3] * 7, max_tokens=50)
    step(scheduler, nextn=5)  # prefill 0..6, first token at 7
    state = scheduler.request("R")
    assert (state.num_computed_tokens, len(state.token_ids), state.draft_token_ids) == (7, 8, [7] * 5)
    plan = scheduler.schedule()
    assert plan.positions.tolist() == list(range(7, 13))
    assert scheduler.request("R").num_inflight_tokens == 6
    assert len(scheduler.request("R").block_table) == 4  # positions up to 12
    scheduler.update(plan, run_step(plan, lambda request_id, pos: 40, num_accepted=lambda request_id, d: 2, nextn=5))
    scheduler.check_invariants()
    state = scheduler.request("R")
    assert (state.num_computed_tokens, len(state.token_ids), state.num_inflight_tokens) == (10, 11, 0)
    assert len(state.block_table) == 3  # the draft-only block went back


def test_async_plans_count_in_flight_rows_and_defer_frees():
    scheduler = Scheduler(scheduler_config(block_size=4, num_blocks=32, num_state_slots=4))
    scheduler.add_request("R", [3, 4, 5], max_tokens=3, eos_token_id=EOS)
    step(scheduler)
    first = scheduler.schedule()
    second = scheduler.schedule()  # planned before the first is updated
    assert first.positions.tolist() == [3] and second.positions.tolist() == [4]
    assert second.inputs_pending.tolist() == [1]
    with pytest.raises(RuntimeError, match="order"):
        scheduler.update(second, run_step(second, lambda r, p: 9))
    outputs = scheduler.update(first, run_step(first, lambda r, p: EOS))
    assert outputs[0].finish_reason == FinishReason.STOP
    scheduler.check_invariants()
    assert scheduler.stats().num_deferred_blocks == 2  # the second step still touches both blocks
    assert scheduler.update(second, run_step(second, lambda r, p: 9)) == []
    scheduler.check_invariants()
    assert scheduler.stats().num_free_blocks == scheduler.stats().num_total_blocks


def test_graph_padding_for_37_rows():
    scheduler = Scheduler(scheduler_config(block_size=4, num_blocks=256, num_state_slots=64, max_num_seqs=48))
    for i in range(37):
        scheduler.add_request(f"r{i}", [3, 4], max_tokens=8)
    step(scheduler)
    plan = scheduler.schedule()
    assert (plan.num_rows, plan.graph_size, plan.num_padding_rows) == (37, 40, 3)


def test_bad_requests_get_clear_errors():
    scheduler = Scheduler(
        scheduler_config(block_size=4, num_blocks=8, num_state_slots=4, max_model_len=16, vocab_size=100)
    )
    scheduler.add_request("a", [1], max_tokens=1)
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request("a", [1], max_tokens=1)
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request("b", [], max_tokens=1)
    with pytest.raises(ValueError, match="max_model_len 16"):
        scheduler.add_request("c", [1] * 16, max_tokens=1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        scheduler.add_request("d", [1, 100], max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.add_request("e", [1], max_tokens=0)
    with pytest.raises(KeyError):
        scheduler.set_schedulable("nope")
    with pytest.raises(ValueError, match="compress ratio 3"):
        scheduler_config(compress_ratios=[3])
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="token counts"):
        scheduler.update(plan, StepResult([], []))
    scheduler.update(plan, StepResult([1], [5]))  # the bad result changed nothing
    scheduler.check_invariants()


def test_error_rows_end_only_their_request():
    scheduler = Scheduler(scheduler_config(block_size=4, num_blocks=16, num_state_slots=4))
    scheduler.add_request("a", [3, 4], max_tokens=4)
    scheduler.add_request("b", [3, 4], max_tokens=4)
    plan = scheduler.schedule()
    outputs = scheduler.update(plan, run_step(plan, lambda r, p: 5, errors=(0,)))
    assert {(o.request_id, o.finish_reason) for o in outputs} == {("a", FinishReason.ERROR), ("b", None)}
    scheduler.check_invariants()


def test_abort_in_flight_answers_at_once_and_frees_after_the_step():
    scheduler = Scheduler(scheduler_config(block_size=4, num_blocks=16, num_state_slots=4))
    scheduler.add_request("R", [3, 4, 5], max_tokens=8)
    step(scheduler)
    plan = scheduler.schedule()
    final = scheduler.abort("R")
    assert final.finish_reason == FinishReason.ABORT
    scheduler.check_invariants()
    assert scheduler.stats().num_deferred_blocks == 1
    assert scheduler.stats().num_free_state_slots == scheduler.stats().num_total_state_slots - 1
    assert scheduler.update(plan, run_step(plan, lambda r, p: 9)) == []  # its tokens are dropped
    scheduler.check_invariants()
    stats = scheduler.stats()
    assert (stats.num_free_blocks, stats.num_free_state_slots) == (stats.num_total_blocks, stats.num_total_state_slots)
