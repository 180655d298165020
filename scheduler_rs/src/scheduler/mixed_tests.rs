//! Mixed steps (decode rows, then prompt chunks in the budget left) and the queue's one order.

use super::test_support::{config as support_config, result_for, step};
use super::*;
use crate::config::{PreemptionMode, Scheduling};

fn config(block_size: u32, num_blocks: u32, budget: u32) -> SchedulerConfig {
    let mut config = support_config(block_size, num_blocks);
    config.max_num_seqs = 4;
    config.max_num_batched_tokens = budget;
    config.scheduling = Scheduling::Mixed;
    config
}

fn add(s: &mut Scheduler, id: &str, len: usize, max_tokens: u32, priority: i32) {
    s.add_request(id.into(), vec![5; len], StopRules::new(max_tokens), true, false, priority, String::new()).unwrap();
}

fn rows(plan: &StepPlan) -> Vec<(String, i32)> {
    plan.request_ids.iter().cloned().zip(plan.seqlens_q.iter().copied()).collect()
}

fn pairs(list: &[(&str, i32)]) -> Vec<(String, i32)> {
    list.iter().map(|&(id, n)| (id.to_string(), n)).collect()
}

#[test]
fn the_budget_goes_to_decode_rows_first_then_to_prompt_chunks() {
    let mut s = Scheduler::new(config(4, 64, 16)).unwrap();
    add(&mut s, "A", 3, 20, 0);
    add(&mut s, "B", 3, 20, 0);
    let plan = step(&mut s);
    assert_eq!((plan.kind, plan.num_decode_requests, rows(&plan)), (StepKind::Prefill, 0, pairs(&[("A", 3), ("B", 3)])));
    let plan = step(&mut s);
    assert_eq!((plan.kind, plan.num_decode_requests, plan.graph_size), (StepKind::Decode, 2, Some(2)));
    add(&mut s, "C", 40, 4, 0);
    add(&mut s, "D", 5, 4, 0);
    // 2 decode rows leave 14 tokens: C's chunks of 14, 14, then its last 12 with D's 2 of 5.
    for (c, d) in [(14, 0), (14, 0), (12, 2)] {
        let plan = step(&mut s);
        let mut want = vec![("A", 1), ("B", 1), ("C", c)];
        if d > 0 {
            want.push(("D", d));
        }
        assert_eq!((plan.kind, plan.num_decode_requests, rows(&plan)), (StepKind::Mixed, 2, pairs(&want)));
        assert_eq!(plan.graph_size, None);
        assert_eq!(plan.num_rows(), 2 + c as usize + d as usize);
        assert_eq!(plan.num_sample_rows[2], i32::from(c == 12));
    }
    // C decodes now; D's last 3 prompt tokens share the step with the three decode rows.
    let plan = step(&mut s);
    assert_eq!(rows(&plan), pairs(&[("A", 1), ("B", 1), ("C", 1), ("D", 3)]));
    let plan = step(&mut s);
    assert_eq!((plan.kind, plan.num_rows()), (StepKind::Decode, 4));
}

#[test]
fn decode_rows_with_drafts_count_against_the_budget() {
    let mut c = config(4, 64, 12);
    c.nextn = 2;
    let mut s = Scheduler::new(c).unwrap();
    add(&mut s, "A", 3, 20, 0);
    step(&mut s);
    add(&mut s, "P", 20, 4, 0);
    let plan = step(&mut s);
    // A's newest token and 2 draft rows, then P's chunk in the 9 tokens left.
    assert_eq!(rows(&plan), pairs(&[("A", 3), ("P", 9)]));
    assert_eq!(plan.num_sample_rows.as_slice(), &[3, 0]);
}

#[test]
fn a_budget_below_the_decode_rows_is_refused() {
    let mut c = config(4, 64, 11);
    c.nextn = 2; // 4 requests × 3 rows = 12 decode rows
    let err = Scheduler::new(c.clone()).err().expect("refused");
    assert!(format!("{err:?}").contains("max_num_batched_tokens 11"));
    c.scheduling = Scheduling::Separate;
    assert!(Scheduler::new(c).is_ok());
}

#[test]
fn the_queue_is_ordered_by_priority_then_arrival() {
    let mut s = Scheduler::new(config(4, 64, 64)).unwrap();
    add(&mut s, "late-low", 3, 4, 1);
    add(&mut s, "first", 3, 4, 0);
    add(&mut s, "urgent", 3, 4, -5);
    add(&mut s, "second", 3, 4, 0);
    let plan = step(&mut s);
    assert_eq!(plan.request_ids, vec!["urgent", "first", "second", "late-low"]);
}

/// Three 8-token prompts fill 6 usable blocks (2 each); each next decode row needs a third block, so
/// one request is preempted (recompute: its 2 blocks come back at once) to serve the other two.
fn preempted_among(priorities: [(&str, i32); 3]) -> Vec<String> {
    let mut c = config(4, 7, 64);
    c.preemption_mode = PreemptionMode::Recompute;
    let mut s = Scheduler::new(c).unwrap();
    for (id, priority) in priorities {
        add(&mut s, id, 8, 10, priority);
    }
    step(&mut s);
    assert_eq!(s.stats().num_free_blocks, 0);
    let plan = step(&mut s);
    assert_eq!(plan.num_requests(), 2);
    priorities.iter().map(|p| p.0).filter(|id| s.request(id).unwrap().num_preemptions > 0).map(String::from).collect()
}

#[test]
fn preemption_takes_the_lowest_priority_then_the_latest_arrival() {
    assert_eq!(preempted_among([("a", 0), ("b", 0), ("c", 0)]), vec!["c"]);
    assert_eq!(preempted_among([("a", 3), ("b", 0), ("c", 0)]), vec!["a"]);
    assert_eq!(preempted_among([("a", 0), ("b", 1), ("c", -1)]), vec!["b"]);
}

#[test]
fn a_step_that_preempts_starts_no_new_prompt() {
    // 4 usable blocks: two 8-token prompts hold them all. The first decode row needs a block: the
    // second request is preempted (2 blocks back), the row takes one. The free block would fit the
    // 3-token newcomer, but this step starts nothing, and the next keeps the order: the victim
    // (the earlier arrival) needs 3 blocks, so the newcomer behind it waits too.
    let mut c = config(4, 5, 64);
    c.preemption_mode = PreemptionMode::Recompute;
    let mut s = Scheduler::new(c).unwrap();
    add(&mut s, "keep", 8, 10, 0);
    add(&mut s, "victim", 8, 10, 0);
    step(&mut s);
    add(&mut s, "new", 3, 10, 0);
    let plan = step(&mut s);
    assert_eq!((plan.kind, rows(&plan)), (StepKind::Decode, pairs(&[("keep", 1)])));
    assert_eq!(s.stats().num_free_blocks, 1);
    let plan = step(&mut s);
    assert_eq!(rows(&plan), pairs(&[("keep", 1)]));
    let waiting: Vec<&str> = s.waiting.iter().map(|&h| s.req(h).request_id.as_str()).collect();
    assert_eq!(waiting, vec!["victim", "new"]);
}

#[test]
fn aborting_a_prompt_between_its_chunks_returns_every_block() {
    let mut s = Scheduler::new(config(4, 64, 8)).unwrap();
    add(&mut s, "A", 3, 20, 0);
    step(&mut s);
    add(&mut s, "P", 30, 4, 0);
    let plan = step(&mut s);
    assert_eq!(rows(&plan), pairs(&[("A", 1), ("P", 7)]));
    assert_eq!(s.stats().num_free_blocks, 63 - 1 - 8);
    assert_eq!(s.abort("P").unwrap().finish_reason, Some(FinishReason::Abort));
    s.check_invariants().unwrap();
    assert_eq!(s.stats().num_free_blocks, 63 - 1);
    let plan = step(&mut s);
    assert_eq!((plan.kind, rows(&plan)), (StepKind::Decode, pairs(&[("A", 1)])));
}

#[test]
fn a_chunk_in_flight_is_counted_and_its_next_chunk_needs_no_pending_input() {
    let mut s = Scheduler::new(config(4, 64, 8)).unwrap();
    add(&mut s, "A", 3, 20, 0);
    step(&mut s);
    add(&mut s, "P", 15, 4, 0);
    let first = s.schedule(&mut SingleRank);
    let second = s.schedule(&mut SingleRank);
    assert_eq!(rows(&first), pairs(&[("A", 1), ("P", 7)]));
    assert_eq!(rows(&second), pairs(&[("A", 1), ("P", 7)]));
    // A's input is the token the first step samples; P's second chunk is prompt tokens 7..14.
    assert_eq!(second.inputs_pending.as_slice(), &[1, 0]);
    assert_eq!(second.positions[0], 4);
    assert_eq!(second.positions[1..].to_vec(), (7..14).collect::<Vec<i32>>());
    s.update(&first, &result_for(&first)).unwrap();
    s.check_invariants().unwrap();
    // A third step while the second is in flight: P's last token, sampled, and A's next row.
    let third = s.schedule(&mut SingleRank);
    assert_eq!(rows(&third), pairs(&[("A", 1), ("P", 1)]));
    assert_eq!(third.num_sample_rows.as_slice(), &[1, 1]);
    s.update(&second, &result_for(&second)).unwrap();
    // P's first decode row waits on the step that samples its first token (still in flight).
    let fourth = s.schedule(&mut SingleRank);
    assert_eq!((fourth.kind, rows(&fourth)), (StepKind::Decode, pairs(&[("A", 1), ("P", 1)])));
    assert_eq!(fourth.inputs_pending.as_slice(), &[1, 1]);
    s.update(&third, &result_for(&third)).unwrap();
    s.update(&fourth, &result_for(&fourth)).unwrap();
    s.check_invariants().unwrap();
    let p = s.request("P").unwrap();
    assert_eq!((p.num_computed_tokens, p.len()), (16, 17));
}

#[test]
fn separate_scheduling_keeps_prompt_steps_apart() {
    let mut c = config(4, 64, 16);
    c.scheduling = Scheduling::Separate;
    let mut s = Scheduler::new(c).unwrap();
    add(&mut s, "A", 3, 20, 0);
    step(&mut s);
    add(&mut s, "C", 40, 4, 0);
    let kinds: Vec<StepKind> = (0..4).map(|_| step(&mut s).kind).collect();
    assert_eq!(kinds, vec![StepKind::Prefill, StepKind::Prefill, StepKind::Prefill, StepKind::Decode]);
}

#[test]
fn a_prompt_engine_runs_separate_steps_whatever_the_setting() {
    let mut c = config(4, 64, 16);
    c.engine_type = EngineType::Prompt;
    let mut s = Scheduler::new(c).unwrap();
    add(&mut s, "A", 20, 4, 0);
    add(&mut s, "B", 6, 4, 0);
    let plan = s.schedule(&mut SingleRank);
    assert_eq!((plan.kind, plan.num_decode_requests, rows(&plan)), (StepKind::Prefill, 0, pairs(&[("A", 16)])));
}
