//! Prefill scheduling and the NORMAL engine's vote (walkthrough Pass 2 Thread 1).

use std::collections::HashSet;

use super::{Collective, Scheduled, Scheduler, VoteOp};
use crate::config::EngineType;
use crate::request::Status;

impl Scheduler {
    /// NORMAL engines: ALL points every `prefill_attempt_interval` decode steps, ANY points every
    /// `prefill_any_attempt_interval`; a second ANY vote catches "wanted, but nobody scheduled".
    /// The first step after the group was idle (`mark_group_idle`) is an ANY point: no rank has a
    /// decode to protect, so a lone rank's new prompt starts at once instead of waiting out placeholder
    /// steps. Every rank saw the same work-left vote, so every rank takes the same kind of vote.
    /// Returns the prefill batch (possibly empty, when only other ranks scheduled), or `None` for a
    /// decode step.
    pub(super) fn vote_for_prefill(&mut self, collective: &mut dyn Collective) -> Option<Vec<Scheduled>> {
        let after_idle = std::mem::take(&mut self.group_idle);
        let op = if after_idle {
            VoteOp::Any
        } else if self.decode_step.is_multiple_of(self.config.prefill_attempt_interval as u64) {
            VoteOp::All
        } else if self.decode_step.is_multiple_of(self.config.prefill_any_attempt_interval as u64) {
            VoteOp::Any
        } else {
            return None;
        };
        if !collective.vote(self.wants_prefill(), op) {
            return None;
        }
        // Nothing is allocated unless something is scheduled, so a failed second vote undoes nothing.
        let chosen = self.schedule_prefill(self.config.max_num_batched_tokens, true);
        collective.vote(!chosen.is_empty(), VoteOp::Any).then_some(chosen)
    }

    /// Records that the group's work-left vote found no rank with work (every rank skipped the step):
    /// the next `schedule()` votes at an ANY point. Idempotent; the next `schedule()` clears it.
    pub fn mark_group_idle(&mut self) {
        self.group_idle = true;
    }

    /// Prompt chunks for this step, from the waiting queue in its order (`queue_order`): each chunk
    /// is the prompt's rest cut to the `budget` left. `admit_new`: a prompt that holds no blocks may
    /// start; once one cannot (not allowed, no room, or, in mixed steps, the cache above
    /// `prefill_max_cache_usage`), no later one starts either, so the order holds, but prompts already
    /// holding their blocks (cut ones) still go on.
    pub(super) fn schedule_prefill(&mut self, mut budget: u32, mut admit_new: bool) -> Vec<Scheduled> {
        let mut num_seqs = self.running.len() as u32;
        let mut chosen = Vec::new();
        let mut finished_prefill = HashSet::new();
        let mut pending = self.pending_snapshots();
        for i in 0..self.waiting.len() {
            let handle = self.waiting[i];
            let req = self.req(handle);
            // The multimodal gate: a request whose inputs (image embeddings) have not arrived is
            // skipped, keeping its place, so it never holds up the ready requests behind it.
            if !req.schedulable {
                continue;
            }
            if num_seqs + 1 > self.config.max_num_seqs || budget == 0 {
                break;
            }
            let remaining = req.num_uncomputed_prompt_tokens();
            if remaining == 0 {
                continue;
            }
            if req.block_table.is_empty() {
                // A prompt sharing a prefix that another's prefill is about to snapshot waits for it, keeping
                // its place (shared_prefill.rs).
                if self.awaits_snapshot(handle, &pending) {
                    continue;
                }
                // A new prompt reserves all its blocks and its state slot on its first chunk, so
                // it never stalls halfway for lack of blocks; with a prefix-cache hit it starts after
                // the hit.
                let gated = self.config.mixed() && self.block_usage() > self.config.prefill_max_cache_usage;
                admit_new = admit_new && !gated && self.admit(handle);
                if !admit_new {
                    continue;
                }
            }
            let remaining = self.req(handle).num_uncomputed_prompt_tokens();
            let chunk = self.chunk_rows(handle, remaining.min(budget));
            budget -= chunk;
            num_seqs += 1;
            let is_last = chunk == remaining;
            let end = self.req(handle).next_position() + chunk;
            pending.extend(self.req(handle).snapshot_at.iter().map(|&at| (handle, at)));
            self.after_chunk(handle, end, is_last);
            chosen.push(Scheduled { handle, num_rows: chunk, num_sample_rows: is_last as u32, prompt: true });
            if is_last {
                finished_prefill.insert(handle);
            } else if self.config.engine_type == EngineType::Normal && budget == 0 {
                // A prompt cut by the budget ends a NORMAL step; it keeps its place. (One cut at a snapshot
                // boundary leaves budget for the prompts behind it.)
                break;
            }
        }
        if !finished_prefill.is_empty() {
            self.waiting.retain(|h| !finished_prefill.contains(h));
            for s in &chosen {
                if finished_prefill.contains(&s.handle) {
                    self.req_mut(s.handle).status = Status::Running;
                    self.running.push(s.handle);
                }
            }
        }
        chosen
    }
}
