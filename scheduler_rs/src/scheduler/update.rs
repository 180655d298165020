//! Applying a step's results: commits, stop rules, returned draft blocks, deferred frees.

use std::collections::HashSet;

use super::Scheduler;
use crate::errors::SchedulerError;
use crate::request::{FinishReason, Request};
use crate::step::{RequestUpdate, StepPlan, StepResult};

impl Scheduler {
    // ---- results --------------------------------------------------------------------------

    /// Applies a step's results: commits computed positions and accepted tokens, checks stop
    /// rules, returns the unneeded draft blocks, and releases what waited for this step.
    pub fn update(&mut self, plan: &StepPlan, result: &StepResult) -> Result<Vec<RequestUpdate>, SchedulerError> {
        if plan.step_id != self.num_steps_updated {
            return Err(SchedulerError::InvalidState(format!(
                "steps must be updated in the order they were planned: expected step {}, got {}",
                self.num_steps_updated, plan.step_id
            )));
        }
        crate::invariants::validate_result(plan, result, &self.config)?;
        self.num_steps_updated += 1;
        let errors: HashSet<u32> = result.errors.iter().copied().collect();
        let mut outputs = Vec::new();
        let mut finished = HashSet::new();
        let mut token_offset = 0;
        let mut draft_offset = 0;
        let has_confidences = !result.draft_confidences.is_empty();
        for (i, &(handle, incarnation)) in plan.handles.iter().enumerate() {
            let num_tokens = result.num_tokens[i] as usize;
            let tokens = &result.token_ids[token_offset..token_offset + num_tokens];
            token_offset += num_tokens;
            let drafts = match result.num_draft_tokens.get(i) {
                Some(&n) => {
                    draft_offset += n as usize;
                    Some(draft_offset - n as usize..draft_offset)
                }
                None => None,
            };
            // Results of a finished, aborted or recomputed incarnation are dropped.
            let live = self.slab[handle].as_ref().is_some_and(|r| r.incarnation == incarnation);
            if !live {
                continue;
            }
            let max_model_len = self.config.max_model_len;
            let req = self.req_mut(handle);
            req.num_inflight_tokens -= plan.seqlens_q[i] as u32;
            let prompt = plan.is_prompt_chunk(i);
            req.num_computed_tokens += if prompt { plan.seqlens_q[i] as u32 } else { num_tokens as u32 };
            if let Some(drafts) = drafts {
                req.draft_tokens.clear();
                req.draft_tokens.extend_from_slice(&result.draft_token_ids[drafts.clone()]);
                req.draft_confidences.clear();
                req.drafts_fresh = !drafts.is_empty();
                if has_confidences {
                    req.draft_confidences.extend_from_slice(&result.draft_confidences[drafts]);
                }
            }
            let mut end = None;
            let mut new_tokens = Vec::with_capacity(tokens.len());
            for &token in tokens {
                req.tokens.push(token);
                new_tokens.push(token);
                end = req.stop.check(token, req.num_output_tokens());
                if end.is_none() && req.len() >= max_model_len {
                    end = Some((FinishReason::Length, None));
                }
                if end.is_some() {
                    break;
                }
            }
            if end.is_none() && errors.contains(&(i as u32)) {
                end = Some((FinishReason::Error, None));
            }
            let (num_prompt_tokens, num_output_tokens) = (req.num_prompt_tokens, req.num_output_tokens());
            let num_cached_tokens = req.num_cached_tokens;
            let request_id = req.request_id.clone();
            self.register_blocks(handle);
            match end {
                Some((reason, stop_token_id)) => {
                    finished.insert(handle);
                    if matches!(reason, FinishReason::Stop | FinishReason::Length) {
                        self.save_at_finish(handle, plan.step_id);
                    }
                    let (mut output, _) = self.remove(handle, reason, stop_token_id);
                    output.token_ids = new_tokens;
                    outputs.push(output);
                }
                None => {
                    if !prompt {
                        self.trim_blocks(handle);
                    }
                    if !new_tokens.is_empty() {
                        outputs.push(RequestUpdate {
                            request_id,
                            token_ids: new_tokens,
                            finish_reason: None,
                            stop_token_id: None,
                            num_prompt_tokens,
                            num_output_tokens,
                            num_cached_tokens,
                        });
                    }
                }
            }
        }
        if !finished.is_empty() {
            self.running.retain(|h| !finished.contains(h));
            self.waiting.retain(|h| !finished.contains(h));
        }
        self.release_deferred();
        Ok(outputs)
    }

    /// Returns blocks reserved for drafts that were rejected: keep what the tokens and any
    /// in-flight rows need.
    fn trim_blocks(&mut self, handle: usize) {
        let block_size = self.config.block_size;
        let req = self.req(handle);
        let keep = Request::blocks_for(req.len().max(req.next_position()), block_size) as usize;
        if req.block_table.len() <= keep {
            return;
        }
        let last_step = req.last_step_id;
        let extra = self.req_mut(handle).block_table.split_off(keep);
        self.release(extra, None, last_step);
    }

    fn release_deferred(&mut self) {
        let updated = self.num_steps_updated;
        let (ready, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.deferred).into_iter().partition(|d| d.release_after < updated);
        self.deferred = waiting;
        for d in ready {
            self.release(d.blocks, d.state_slot, None);
        }
    }
}
