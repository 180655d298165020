//! Checks on what crosses the scheduler's boundary (step results) and on its pools.

use std::collections::HashMap;

use crate::block_manager::BlockManager;
use crate::config::SchedulerConfig;
use crate::errors::SchedulerError;
use crate::step::{StepPlan, StepResult};

/// A result must have one entry per planned request, token counts within the sampled rows, and
/// in-vocabulary ids. Checked before anything is applied, so a bad result changes nothing.
pub fn validate_result(plan: &StepPlan, result: &StepResult, config: &SchedulerConfig) -> Result<(), SchedulerError> {
    let bad = |m: String| Err(SchedulerError::InvalidResult(format!("step {}: {m}", plan.step_id)));
    let num_requests = plan.num_requests();
    if result.num_tokens.len() != num_requests {
        return bad(format!("{} token counts for {num_requests} requests", result.num_tokens.len()));
    }
    let total: usize = result.num_tokens.iter().map(|&n| n as usize).sum();
    if total != result.token_ids.len() {
        return bad(format!("token counts sum to {total} but {} token ids", result.token_ids.len()));
    }
    for (i, &n) in result.num_tokens.iter().enumerate() {
        let sampled = plan.num_sample_rows[i] as u32;
        let errored = result.errors.contains(&(i as u32));
        let ok = if plan.is_prompt_chunk(i) {
            n == sampled || (errored && n == 0)
        } else {
            (1..=sampled).contains(&n) || (errored && n == 0)
        };
        if !ok {
            return bad(format!(
                "request {} produced {n} tokens from {sampled} sampled rows",
                plan.request_ids[i]
            ));
        }
    }
    if let Some(&e) = result.errors.iter().find(|&&e| e as usize >= num_requests) {
        return bad(format!("error index {e} is out of range"));
    }
    if result.num_draft_tokens.is_empty() && !result.draft_confidences.is_empty() {
        return bad("draft confidences without draft counts".into());
    }
    if !result.num_draft_tokens.is_empty() {
        if result.num_draft_tokens.len() != num_requests {
            return bad(format!("{} draft counts for {num_requests} requests", result.num_draft_tokens.len()));
        }
        if let Some(&n) = result.num_draft_tokens.iter().find(|&&n| n > config.nextn) {
            return bad(format!("{n} drafts exceed nextn {}", config.nextn));
        }
        let num_drafts: usize = result.num_draft_tokens.iter().map(|&n| n as usize).sum();
        if num_drafts != result.draft_token_ids.len() {
            return bad(format!("draft counts sum to {num_drafts} but {} draft ids", result.draft_token_ids.len()));
        }
        if !result.draft_confidences.is_empty() && result.draft_confidences.len() != num_drafts {
            return bad(format!("{} draft confidences for {num_drafts} drafts", result.draft_confidences.len()));
        }
        if let Some(c) = result.draft_confidences.iter().find(|c| !(0.0..=1.0).contains(*c)) {
            return bad(format!("draft confidence {c} is not in [0, 1]"));
        }
    }
    if let Some(vocab_size) = config.vocab_size {
        if let Some(&t) = result.token_ids.iter().chain(&result.draft_token_ids).find(|&&t| t >= vocab_size) {
            return bad(format!("token id {t} is outside the vocabulary of {vocab_size}"));
        }
    }
    Ok(())
}

/// Conservation (free + held = total) and reference counts (each held id is named by exactly as
/// many holders as its count) for both pools.
pub fn check_pools<'a>(
    blocks: &BlockManager,
    slots: &BlockManager,
    requests: impl Iterator<Item = (&'a [u32], Option<u32>)>,
    deferred: impl Iterator<Item = (&'a [u32], Option<u32>)>,
) -> Result<(), String> {
    let mut block_holders: HashMap<u32, u32> = HashMap::new();
    let mut slot_holders: HashMap<u32, u32> = HashMap::new();
    for (table, slot) in requests.chain(deferred) {
        for &block in table {
            *block_holders.entry(block).or_default() += 1;
        }
        if let Some(slot) = slot {
            *slot_holders.entry(slot).or_default() += 1;
        }
    }
    for (name, pool, holders) in [("block", blocks, &block_holders), ("state slot", slots, &slot_holders)] {
        let num_held = pool.num_total() - pool.num_free();
        if holders.len() as u32 != num_held {
            return Err(format!(
                "{name} pool: {} held by requests but {num_held} not free (free {} of {})",
                holders.len(),
                pool.num_free(),
                pool.num_total()
            ));
        }
        if holders.contains_key(&0) {
            return Err(format!("{name} 0 is held"));
        }
        for (&id, &count) in holders {
            if pool.ref_count(id) != count {
                return Err(format!("{name} {id}: reference count {} but {count} holders", pool.ref_count(id)));
            }
        }
    }
    let mut free: Vec<u32> = blocks.free_ids();
    free.sort_unstable();
    if free.windows(2).any(|w| w[0] == w[1]) {
        return Err("a block is on the free list twice".into());
    }
    Ok(())
}
