//! What the scheduler's unit tests share: a small configuration, a worker's result for a plan, and one step.

use super::*;
use crate::config::TEST_LIMITS;
use crate::step::StepResult;

/// One rank, `block_size`-token blocks, a pool of `num_blocks`, 8 state slots, no compression.
pub(super) fn config(block_size: u32, num_blocks: u32) -> SchedulerConfig {
    let mut config = SchedulerConfig::new(1, TEST_LIMITS);
    config.block_size = block_size;
    config.num_blocks = num_blocks;
    config.num_state_slots = 8;
    config.compress_ratios = vec![1];
    config
}

/// One token per sampled row of a prompt chunk, one per decode request: `100 + seqlen_k`.
pub(super) fn result_for(plan: &StepPlan) -> StepResult {
    let mut result = StepResult::default();
    for i in 0..plan.num_requests() {
        let n = if plan.is_prompt_chunk(i) { plan.num_sample_rows[i] as u32 } else { 1 };
        result.num_tokens.push(n);
        if n == 1 {
            result.token_ids.push(100 + plan.seqlens_k[i] as u32);
        }
    }
    result
}

/// Plans a step, applies `result_for` it, checks every invariant; the plan and the updates.
pub(super) fn step_with_updates(s: &mut Scheduler) -> (StepPlan, Vec<RequestUpdate>) {
    let plan = s.schedule(&mut SingleRank);
    let outputs = s.update(&plan, &result_for(&plan)).unwrap();
    s.check_invariants().unwrap();
    (plan, outputs)
}

/// `step_with_updates`' plan alone.
pub(super) fn step(s: &mut Scheduler) -> StepPlan {
    step_with_updates(s).0
}
