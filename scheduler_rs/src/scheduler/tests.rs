use super::*;
use crate::config::TEST_LIMITS;
use crate::step::StepResult;

fn config(block_size: u32, num_blocks: u32) -> SchedulerConfig {
    let mut config = SchedulerConfig::new(1, TEST_LIMITS);
    config.block_size = block_size;
    config.num_blocks = num_blocks;
    config.num_state_slots = 8;
    config.compress_ratios = vec![1];
    config
}

/// One token per sampled row: `100 + position`.
fn result_for(plan: &StepPlan) -> StepResult {
    let mut result = StepResult::default();
    for i in 0..plan.num_requests() {
        let n = match plan.kind {
            StepKind::Prefill => plan.num_sample_rows[i] as u32,
            StepKind::Decode => 1,
        };
        result.num_tokens.push(n);
        if n == 1 {
            result.token_ids.push(100 + plan.seqlens_k[i] as u32);
        }
    }
    result
}

fn step(s: &mut Scheduler) -> (StepPlan, Vec<RequestUpdate>) {
    let plan = s.schedule(&mut SingleRank);
    let outputs = s.update(&plan, &result_for(&plan)).unwrap();
    s.check_invariants().unwrap();
    (plan, outputs)
}

#[test]
fn kitchen_cut_prompt_ends_the_step() {
    let mut c = config(4, 64);
    c.max_num_batched_tokens = 8;
    let mut s = Scheduler::new(c).unwrap();
    for (id, n) in [("A", 6), ("B", 5), ("C", 4)] {
        s.add_request(id.into(), vec![5; n], StopRules::new(4), true, false).unwrap();
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
    s.add_request("P".into(), vec![5; 4096], StopRules::new(4), true, false).unwrap();
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
    s.add_request("P".into(), vec![5; 50_000], StopRules::new(4), true, false).unwrap();
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
        s.add_request(id.into(), vec![5; 3], StopRules::new(8), true, false).unwrap();
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
    s.add_request("R".into(), vec![5; 3], StopRules::new(8), true, false).unwrap();
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
    s.add_request("R".into(), vec![5; 3], StopRules::new(8), true, false).unwrap();
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
