use std::collections::HashSet;

use super::test_support::{config, result_for, step_with_updates as step};
use super::*;
use crate::config::TEST_LIMITS;
use crate::step::StepResult;

#[test]
fn kitchen_cut_prompt_ends_the_step() {
    let mut c = config(4, 64);
    c.max_num_batched_tokens = 8;
    let mut s = Scheduler::new(c).unwrap();
    for (id, n) in [("A", 6), ("B", 5), ("C", 4)] {
        s.add_request(id.into(), vec![5; n], StopRules::new(4), true, false, 0, String::new()).unwrap();
    }
    let (plan, _) = step(&mut s);
    assert_eq!((plan.request_ids.clone(), plan.seqlens_q.clone()), (vec!["A".into(), "B".into()], vec![6, 2]));
    let (plan, _) = step(&mut s);
    assert_eq!((plan.request_ids.clone(), plan.seqlens_q.clone()), (vec!["B".into(), "C".into()], vec![3, 4]));
    let (plan, _) = step(&mut s);
    assert_eq!(plan.kind, StepKind::Decode);
    assert_eq!(plan.num_rows(), 3);
}

#[test]
fn a_cut_prompt_holding_most_of_the_cache_still_finishes() {
    // 32 of 33 blocks (97% > the 90% prefill gate) are the prompt's own from its first chunk.
    let mut c = config(128, 34);
    c.max_num_batched_tokens = 2048;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("P".into(), vec![5; 4096], StopRules::new(4), true, false, 0, String::new()).unwrap();
    let (plan, _) = step(&mut s);
    assert_eq!((plan.kind, plan.seqlens_q.clone()), (StepKind::Prefill, vec![2048]));
    assert!(s.blocks.usage() > s.config.prefill_max_cache_usage);
    let (plan, _) = step(&mut s);
    assert_eq!((plan.kind, plan.seqlens_q.clone()), (StepKind::Prefill, vec![2048]));
    let (plan, _) = step(&mut s);
    assert_eq!((plan.kind, plan.num_rows()), (StepKind::Decode, 1));
}

#[test]
fn abort_between_chunks_returns_all_blocks() {
    let mut c = config(128, 400);
    c.compress_ratios = vec![2, 1];
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("P".into(), vec![5; 50_000], StopRules::new(4), true, false, 0, String::new()).unwrap();
    let (plan, outputs) = step(&mut s);
    assert_eq!(plan.seqlens_q, vec![32_768]);
    assert!(outputs.is_empty());
    assert_eq!(s.stats().num_free_blocks, 399 - 391);
    let output = s.abort("P").unwrap();
    assert_eq!(output.finish_reason, Some(FinishReason::Abort));
    assert_eq!(s.stats().num_free_blocks, 399);
    assert_eq!(s.stats().num_free_state_slots, 7);
    assert!(s.abort("P").is_none());
}

#[test]
fn empty_free_list_alone_does_not_preempt() {
    let mut s = Scheduler::new(config(4, 3)).unwrap();
    for id in ["X", "Y"] {
        s.add_request(id.into(), vec![5; 3], StopRules::new(8), true, false, 0, String::new()).unwrap();
    }
    step(&mut s);
    assert_eq!(s.stats().num_free_blocks, 0);
    let (plan, _) = step(&mut s);
    assert!(plan.outputs.is_empty());
    assert_eq!(plan.num_requests(), 2);
}

#[test]
fn a_second_in_flight_step_counts_the_first_as_accepted() {
    let mut s = Scheduler::new(config(4, 16)).unwrap();
    s.add_request("R".into(), vec![5; 3], StopRules::new(8), true, false, 0, String::new()).unwrap();
    step(&mut s);
    let first = s.schedule(&mut SingleRank);
    let second = s.schedule(&mut SingleRank);
    assert_eq!((first.positions.clone(), second.positions.clone()), (vec![3], vec![4]));
    assert_eq!(second.inputs_pending, vec![1]);
    assert!(s.update(&second, &result_for(&second)).is_err());
    s.update(&first, &result_for(&first)).unwrap();
    s.update(&second, &result_for(&second)).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(s.request("R").unwrap().num_computed_tokens, 5);
}

struct OtherRanksNeverReady;

impl Collective for OtherRanksNeverReady {
    fn vote(&mut self, value: bool, op: VoteOp) -> bool {
        match op {
            VoteOp::All => false,
            VoteOp::Any => value,
        }
    }
}

#[test]
fn all_points_come_every_seventy_decode_steps() {
    let mut c = SchedulerConfig::new(8, TEST_LIMITS);
    c.compress_ratios = vec![1];
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("R".into(), vec![5; 3], StopRules::new(8), true, false, 0, String::new()).unwrap();
    // ALL points fail (another rank is not ready); the ANY point at decode step 100 passes.
    let mut first_prefill = None;
    for i in 0..150 {
        let plan = s.schedule(&mut OtherRanksNeverReady);
        s.update(&plan, &result_for(&plan)).unwrap();
        if plan.kind == StepKind::Prefill {
            first_prefill = Some(i);
            break;
        }
    }
    assert_eq!(first_prefill, Some(100));
}

/// Decode results for speculation: request i accepts `accepted[i]` of its drafts and proposes
/// `nextn` new ones with the given per-request confidences (already multiplied along the request).
fn spec_result(plan: &StepPlan, accepted: &[u32], nextn: u32, confidences: &[Vec<f64>]) -> StepResult {
    let mut result = StepResult::default();
    for i in 0..plan.num_requests() {
        let rows = plan.num_sample_rows[i] as u32;
        let n = if plan.is_prompt_chunk(i) { rows } else { 1 + accepted[i].min(rows - 1) };
        result.num_tokens.push(n);
        result.token_ids.extend((0..n).map(|j| 100 + j));
        if rows > 0 {
            result.num_draft_tokens.push(nextn);
            result.draft_token_ids.extend((0..nextn).map(|j| 200 + j));
            result.draft_confidences.extend_from_slice(&confidences[i]);
        } else {
            result.num_draft_tokens.push(0);
        }
    }
    result
}

fn varlen_scheduler(nextn: u32) -> Scheduler {
    let mut c = config(4, 64);
    c.nextn = nextn;
    c.spec_varlen = true;
    Scheduler::new(c).unwrap()
}

#[test]
fn varlen_gives_the_walkthrough_rows_w_w_x_w() {
    // W, X, Y and Z with 3 drafts each and the walkthrough's confidences and cost curve: 8 rows,
    // W checks 3 drafts, X 1, Y and Z none.
    let wxyz = vec![vec![0.95, 0.90, 0.80], vec![0.85, 0.60, 0.30], vec![0.50, 0.20, 0.10], vec![0.30, 0.10, 0.05]];
    let mut s = varlen_scheduler(3);
    s.set_step_cost(vec![(4, 8.1), (8, 8.6), (16, 12.0)], 0.4, true).unwrap();
    for id in ["W", "X", "Y", "Z"] {
        s.add_request(id.into(), vec![5; 3], StopRules::new(20), true, false, 0, String::new()).unwrap();
    }
    let prefill = s.schedule(&mut SingleRank);
    s.update(&prefill, &spec_result(&prefill, &[0; 4], 3, &wxyz)).unwrap();
    let plan = s.schedule(&mut SingleRank);
    assert_eq!(plan.kind, StepKind::Decode);
    let rows: Vec<(String, i32)> = plan.request_ids.iter().cloned().zip(plan.seqlens_q.iter().copied()).collect();
    let rows: HashMap<String, i32> = rows.into_iter().collect();
    assert_eq!((rows["W"], rows["X"], rows["Y"], rows["Z"]), (4, 2, 1, 1));
    assert_eq!(plan.num_rows(), 8);
    assert_eq!((plan.graph_size, plan.num_padding_rows), (Some(8), 0));
    // W's rows are its newest token and its 3 drafts; Y's only its newest token.
    let w = plan.request_ids.iter().position(|r| r == "W").unwrap();
    let start = plan.query_start[w] as usize;
    assert_eq!(&plan.input_ids[start..start + 4], &[100, 200, 201, 202]);
    // A cheaper 16-row graph: every draft is checked.
    s.set_step_cost(vec![(4, 8.1), (8, 8.6), (16, 10.4)], 0.4, true).unwrap();
    s.update(&plan, &spec_result(&plan, &[3, 1, 0, 0], 3, &wxyz)).unwrap();
    s.check_invariants().unwrap();
    let plan = s.schedule(&mut SingleRank);
    assert_eq!(plan.seqlens_q, vec![4, 4, 4, 4]);
    assert_eq!(plan.graph_size, Some(16));
}

#[test]
fn varlen_without_a_curve_checks_the_proposed_drafts_only() {
    let mut s = varlen_scheduler(3);
    s.add_request("A".into(), vec![5; 3], StopRules::new(20), true, false, 0, String::new()).unwrap();
    s.add_request("B".into(), vec![5; 3], StopRules::new(20), true, false, 0, String::new()).unwrap();
    let prefill = s.schedule(&mut SingleRank);
    let mut result = spec_result(&prefill, &[0, 0], 3, &[vec![0.5; 3], vec![0.5; 3]]);
    // B proposed one draft only, and no confidences came (varlen counts its draft as certain).
    result.num_draft_tokens = vec![3, 1];
    result.draft_token_ids.truncate(4);
    result.draft_confidences.clear();
    s.update(&prefill, &result).unwrap();
    let plan = s.schedule(&mut SingleRank);
    assert_eq!(plan.seqlens_q, vec![4, 2]);
}

#[test]
fn drafts_are_proposed_only_where_varlen_could_verify_them() {
    // Without a curve every draft is verified: propose. A curve proportional to rows (a step of
    // R rows costs R ms) makes even certain drafts pay nothing (N + k tokens in N + k ms against N
    // in N): no draft could be verified, so none is proposed; a flat curve makes them pay again.
    let mut s = varlen_scheduler(3);
    for id in ["A", "B"] {
        s.add_request(id.into(), vec![5; 3], StopRules::new(20), true, false, 0, String::new()).unwrap();
    }
    let prefill = s.schedule(&mut SingleRank);
    assert_eq!(prefill.propose_drafts, vec![1, 1]);
    s.update(&prefill, &spec_result(&prefill, &[0, 0], 3, &[vec![0.5; 3], vec![0.5; 3]])).unwrap();
    let proportional: Vec<(u32, f64)> = (1..=8).map(|rows| (rows, rows as f64)).collect();
    // A guessed curve (the meter's reading of one measured size) never stops the draft.
    s.set_step_cost(proportional.clone(), 0.0, false).unwrap();
    assert!(s.drafts_can_pay(2));
    s.set_step_cost(proportional, 0.0, true).unwrap();
    let plan = s.schedule(&mut SingleRank);
    assert_eq!(plan.propose_drafts, vec![0, 0]);
    assert_eq!(plan.seqlens_q, vec![1, 1], "varlen verifies none of the drafts already proposed, either");
    // The worker proposed nothing after that step.
    let mut result = spec_result(&plan, &[0, 0], 0, &[vec![], vec![]]);
    result.num_draft_tokens = vec![0, 0];
    s.update(&plan, &result).unwrap();
    s.set_step_cost((1..=8).map(|rows| (rows, 10.0 + 0.01 * rows as f64)).collect(), 0.0, true).unwrap();
    let plan = s.schedule(&mut SingleRank);
    assert_eq!((plan.propose_drafts.clone(), plan.seqlens_q.clone()), (vec![1, 1], vec![1, 1]));
    s.check_invariants().unwrap();
    // Fixed mode and no speculation: always, and never.
    let mut c = config(4, 64);
    c.nextn = 3;
    let mut fixed = Scheduler::new(c).unwrap();
    fixed.add_request("A".into(), vec![5; 3], StopRules::new(20), true, false, 0, String::new()).unwrap();
    assert_eq!(fixed.schedule(&mut SingleRank).propose_drafts, vec![1]);
    let mut off = Scheduler::new(config(4, 64)).unwrap();
    off.add_request("A".into(), vec![5; 3], StopRules::new(20), true, false, 0, String::new()).unwrap();
    assert_eq!(off.schedule(&mut SingleRank).propose_drafts, vec![0]);
}

#[test]
fn varlen_rows_return_their_blocks_and_conserve_the_pools() {
    // Blocks of 4 tokens: rows that go unverified or get rejected never keep a block past the update.
    let mut s = varlen_scheduler(5);
    s.set_step_cost(vec![(1, 1.0), (2, 1.05), (4, 1.1), (8, 3.0), (12, 5.0)], 0.0, true).unwrap();
    for id in ["A", "B"] {
        s.add_request(id.into(), vec![5; 3], StopRules::new(30), true, false, 0, String::new()).unwrap();
    }
    let confidences = vec![vec![0.9, 0.8, 0.7, 0.6, 0.5], vec![0.4, 0.2, 0.1, 0.05, 0.01]];
    let mut plan = s.schedule(&mut SingleRank);
    let mut seen_rows = HashSet::new();
    for step in 0..12 {
        let accepted = [step % 3, 1];
        s.update(&plan, &spec_result(&plan, &accepted, 5, &confidences)).unwrap();
        s.check_invariants().unwrap();
        for id in ["A", "B"] {
            if let Some(req) = s.request(id) {
                let needed = Request::blocks_for(req.len().max(req.next_position()), 4) as usize;
                assert!(req.block_table.len() <= needed, "{id} keeps a block past what its tokens need");
            }
        }
        if !s.has_unfinished() {
            break;
        }
        plan = s.schedule(&mut SingleRank);
        seen_rows.extend(plan.seqlens_q.iter().copied());
    }
    assert!(seen_rows.len() > 1, "varlen gave every request the same rows: {seen_rows:?}");
    assert!(!seen_rows.contains(&6), "a 6-row request would mean the costly drafts were checked");
}

#[test]
fn a_step_cost_curve_needs_varlen_and_sane_numbers() {
    let mut s = Scheduler::new(config(4, 16)).unwrap();
    assert!(s.set_step_cost(vec![(1, 1.0)], 0.0, true).is_err());
    let mut s = varlen_scheduler(2);
    assert!(s.set_step_cost(vec![(1, f64::NAN)], 0.0, true).is_err());
    assert!(s.set_step_cost(vec![(1, 1.0)], -1.0, true).is_err());
    let mut c = config(4, 16);
    c.spec_varlen = true;
    assert!(Scheduler::new(c).is_err(), "varlen without drafts is refused");
}

#[test]
fn bad_draft_confidences_are_refused_before_anything_changes() {
    let mut s = varlen_scheduler(2);
    s.add_request("A".into(), vec![5; 3], StopRules::new(20), true, false, 0, String::new()).unwrap();
    let plan = s.schedule(&mut SingleRank);
    let mut result = spec_result(&plan, &[0], 2, &[vec![0.5, 1.5]]);
    assert!(s.update(&plan, &result).is_err());
    result.draft_confidences = vec![0.5];
    assert!(s.update(&plan, &result).is_err());
    result.draft_confidences = vec![0.5, 0.25];
    s.update(&plan, &result).unwrap();
}

/// Two ranks' votes when only this rank ever has work (ALL is false, ANY is this rank's value),
/// recording each vote's op.
struct LoneRank {
    ops: Vec<VoteOp>,
}

impl Collective for LoneRank {
    fn vote(&mut self, value: bool, op: VoteOp) -> bool {
        self.ops.push(op);
        OtherRanksNeverReady.vote(value, op)
    }
}

#[test]
fn a_lone_prompt_on_an_idle_group_prefills_at_once() {
    let mut c = SchedulerConfig::new(8, TEST_LIMITS);
    c.compress_ratios = vec![1];
    let mut s = Scheduler::new(c).unwrap();
    let mut votes = LoneRank { ops: Vec::new() };
    // A first request runs to completion; decode_step rests between vote points (the served case: after
    // a short request it rests at that request's number of decode steps).
    s.add_request("R".into(), vec![5; 3], StopRules::new(3), true, false, 0, String::new()).unwrap();
    s.mark_group_idle();
    let mut kinds = Vec::new();
    while s.has_unfinished() {
        let plan = s.schedule(&mut votes);
        s.update(&plan, &result_for(&plan)).unwrap();
        s.check_invariants().unwrap();
        kinds.push(plan.kind);
    }
    assert_eq!(kinds, vec![StepKind::Prefill, StepKind::Decode, StepKind::Decode]);
    assert_eq!(s.stats().decode_step, 2);
    // Without the mark, decode step 2 is no vote point: a lone prompt would decode (wait) here.
    // The group votes that no rank has work, then a lone prompt arrives: its step is an ANY point.
    s.mark_group_idle();
    s.add_request("S".into(), vec![6; 3], StopRules::new(8), true, false, 0, String::new()).unwrap();
    votes.ops.clear();
    let plan = s.schedule(&mut votes);
    assert_eq!((plan.kind, votes.ops.clone()), (StepKind::Prefill, vec![VoteOp::Any, VoteOp::Any]));
    s.update(&plan, &result_for(&plan)).unwrap();
    // The mark is used once: with S decoding the group is busy, and decode_step 0 is an ALL point that
    // the other rank fails, so the next prompt waits while S decodes (DeepInfer's schedule).
    s.add_request("U".into(), vec![8; 3], StopRules::new(2), true, false, 0, String::new()).unwrap();
    votes.ops.clear();
    let plan = s.schedule(&mut votes);
    assert_eq!((plan.kind, votes.ops.clone()), (StepKind::Decode, vec![VoteOp::All]));
    s.update(&plan, &result_for(&plan)).unwrap();
    s.check_invariants().unwrap();
}

/// A worker's result that proposes `nextn` drafts, each with `confidence`, exactly where the plan asks.
fn proposing_result(plan: &StepPlan, nextn: u32, confidence: f64) -> StepResult {
    let mut result = StepResult::default();
    for i in 0..plan.num_requests() {
        let rows = plan.num_sample_rows[i] as u32;
        let n = if plan.kind == StepKind::Prefill { rows } else { 1 };
        result.num_tokens.push(n);
        result.token_ids.extend((0..n).map(|j| 100 + j));
        let proposed = if rows > 0 && plan.propose_drafts[i] == 1 { nextn } else { 0 };
        result.num_draft_tokens.push(proposed);
        result.draft_token_ids.extend((0..proposed).map(|j| 200 + j));
        result.draft_confidences.extend((0..proposed).map(|_| confidence));
    }
    result
}

#[test]
fn varlen_backs_off_a_draft_it_never_verifies_and_looks_again() {
    // Drafts with confidence 0 add no expected token, so varlen verifies none; after the n-th such
    // proposal in a row the draft skips min(2^(n-1), 16) steps. Decode steps are numbered from 1; the
    // prefill's proposal is the first.
    let mut s = varlen_scheduler(3);
    s.set_step_cost((1..=8).map(|rows| (rows, 10.0 + 0.01 * rows as f64)).collect(), 0.0, true).unwrap();
    s.add_request("A".into(), vec![5; 3], StopRules::new(200), true, false, 0, String::new()).unwrap();
    let prefill = s.schedule(&mut SingleRank);
    s.update(&prefill, &proposing_result(&prefill, 3, 0.0)).unwrap();
    let mut proposing_steps = Vec::new();
    for step in 1..=40 {
        let plan = s.schedule(&mut SingleRank);
        assert_eq!(plan.seqlens_q, vec![1], "no draft of confidence 0 is verified");
        if plan.propose_drafts[0] == 1 {
            proposing_steps.push(step);
        }
        s.update(&plan, &proposing_result(&plan, 3, 0.0)).unwrap();
        s.check_invariants().unwrap();
    }
    assert_eq!(proposing_steps, vec![2, 5, 10, 19, 36]);
    // Drafts it would verify: the next proposal is verified, and from then on it proposes every step.
    let mut confident = Vec::new();
    for _ in 0..20 {
        let plan = s.schedule(&mut SingleRank);
        confident.push((plan.propose_drafts[0], plan.seqlens_q[0]));
        s.update(&plan, &proposing_result(&plan, 3, 1.0)).unwrap();
    }
    let first = confident.iter().position(|&(p, _)| p == 1).expect("it looks again within 16 steps");
    assert!(first < 16);
    assert_eq!(confident[first + 1], (1, 4), "the look found drafts worth verifying: all of them, and it proposes on");
    assert!(confident[first + 1..].iter().all(|&(p, rows)| p == 1 && rows == 4));
}

#[test]
fn fixed_mode_proposes_every_step() {
    let mut c = config(4, 64);
    c.nextn = 3;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("A".into(), vec![5; 3], StopRules::new(50), true, false, 0, String::new()).unwrap();
    for _ in 0..12 {
        let plan = s.schedule(&mut SingleRank);
        assert_eq!(plan.propose_drafts, vec![1]);
        s.update(&plan, &proposing_result(&plan, 3, 0.0)).unwrap();
    }
}
