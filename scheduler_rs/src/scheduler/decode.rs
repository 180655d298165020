//! Decode scheduling and preemption (walkthrough Pass 3, "When memory runs out").

use std::collections::{HashMap, HashSet};

use super::{Scheduled, Scheduler};
use crate::config::PreemptionMode;
use crate::request::{FinishReason, Request, Status};
use crate::step::RequestUpdate;

/// The most decode steps varlen's back-off skips a request's proposal for (`pace_proposals`): at most one
/// proposal in 17 steps is spent on a draft that never passes, and a draft that starts passing again is
/// looked at within 16 steps.
pub const MAX_PROPOSALS_SKIPPED: u32 = 16;

impl Scheduler {
    /// Decode: running requests in the one order (`queue_order`): rows are served from the front
    /// (the highest priority, earliest arrival first), and when the row being served needs blocks that
    /// are not free, the request at the BACK is preempted: the lowest priority, latest arrival.
    /// (DeepInfer preempts the longest output instead.) Unlike DeepInfer, a row that needs no new
    /// block never causes a preemption. Returns the scheduled rows (in the order), the final outputs
    /// of stopped victims, and whether anything was preempted.
    pub(super) fn schedule_decode(&mut self) -> (Vec<Scheduled>, Vec<RequestUpdate>, bool) {
        let block_size = self.config.block_size;
        let mut order = std::mem::take(&mut self.running);
        order.sort_by_cached_key(|&h| self.order_of(h));
        let rows = self.decode_rows(&order);
        let (mut next, mut end) = (0, order.len());
        let mut served = HashSet::new();
        let mut outputs = Vec::new();
        let mut recomputed = Vec::new();
        // Blocks of this step's victims that come back when their in-flight step is updated.
        let mut num_coming = 0;
        while next < end {
            let handle = order[next];
            let req = self.req(handle);
            let needed = Request::blocks_for(req.next_position() + rows[&handle], block_size);
            let extra = needed.saturating_sub(req.block_table.len() as u32);
            while extra > self.num_available_blocks() + num_coming && next < end {
                end -= 1;
                num_coming += self.preempt(order[end], &mut outputs, &mut recomputed);
            }
            if next == end {
                break; // the row's own request was the last victim
            }
            if extra <= self.num_available_blocks() {
                let blocks = self.take_blocks(extra).expect("checked available blocks");
                self.req_mut(handle).block_table.extend(blocks);
                served.insert(handle);
            } else {
                num_coming -= extra; // served next step, once the victims' step is updated
            }
            next += 1;
        }
        let preempted = end < order.len();
        order.truncate(end);
        self.running = order;
        for &handle in &recomputed {
            self.enqueue(handle);
        }
        let chosen = self
            .running
            .iter()
            .filter(|h| served.contains(h))
            .map(|&handle| Scheduled {
                handle,
                num_rows: rows[&handle],
                num_sample_rows: rows[&handle],
                prompt: false,
            })
            .collect();
        (chosen, outputs, preempted)
    }

    /// Rows per running request: 1 + the drafts it verifies. Fixed: `nextn` (pad rows stand in for
    /// drafts not proposed yet). Varlen: the prefix of its proposed drafts that `MtpVarlen` picks over
    /// the whole batch (ranked by confidence; a draft without a confidence counts as certain), or all
    /// of them while there is no step-cost curve or the batch exceeds the curve's largest size.
    fn decode_rows(&self, order: &[usize]) -> HashMap<usize, u32> {
        let nextn = self.config.nextn as usize;
        if !self.config.spec_varlen {
            return order.iter().map(|&h| (h, 1 + nextn as u32)).collect();
        }
        let confidences: Vec<Vec<f64>> = order
            .iter()
            .map(|&h| {
                let req = self.req(h);
                let n = req.draft_tokens.len().min(nextn);
                (0..n).map(|j| req.draft_confidences.get(j).copied().unwrap_or(1.0)).collect()
            })
            .collect();
        let num_drafts = match self.varlen.as_ref().map(|v| v.choose(&confidences)) {
            Some(Ok(choice)) => choice.num_drafts,
            _ => confidences.iter().map(|c| c.len() as u32).collect(),
        };
        order.iter().zip(num_drafts).map(|(&h, n)| (h, 1 + n)).collect()
    }

    /// Whether drafts proposed for a decode batch of `num_requests` requests can be verified: always,
    /// except with varlen and a step-cost curve on which even drafts sure to pass (confidence 1) do
    /// not raise the expected tokens per millisecond at that batch size. Then `MtpVarlen` verifies
    /// none whatever the draft's confidences (each is ≤ 1, so every prefix's expected tokens are ≤
    /// those of certain drafts, and its choice needs a strictly higher rate), and the worker skips
    /// the draft (`StepPlan::propose_drafts`). A batch past the curve verifies every draft, and a
    /// guessed curve (`set_step_cost(.., measured = false)`) never stops the draft: true.
    pub(crate) fn drafts_can_pay(&self, num_requests: usize) -> bool {
        let nextn = self.config.nextn as usize;
        if nextn == 0 || !self.config.spec_varlen || !self.step_cost_measured || num_requests == 0 {
            return nextn > 0;
        }
        match self.varlen.as_ref().map(|v| v.choose(&vec![vec![1.0; nextn]; num_requests])) {
            Some(Ok(choice)) => choice.num_rows > num_requests as u32,
            _ => true,
        }
    }

    /// Varlen's back-off for a draft whose proposals go unverified. A proposal of which the plan verifies
    /// no draft (its confidences too low for the step-cost curve, or a batch where drafts cannot pay)
    /// cost a draft run for nothing; after the n-th such proposal in a row the draft skips the request
    /// for the next min(2^(n−1), `MAX_PROPOSALS_SKIPPED`) decode steps, then proposes again to look. One
    /// verified draft resets it. A skipped request still writes its draft context (the worker writes
    /// the context of every emitted position), so the next proposal starts from a full window. Greedy
    /// and deterministic-mode tokens do not depend on it (they do not depend on the drafts verified).
    /// Fixed mode verifies every draft and never skips. `propose_drafts` is the plan's, one per request.
    pub(super) fn pace_proposals(&mut self, chosen: &[Scheduled], propose_drafts: &mut [i32]) {
        if !self.config.spec_varlen || self.config.nextn == 0 {
            return;
        }
        for (s, propose) in chosen.iter().zip(propose_drafts.iter_mut()) {
            let req = self.req_mut(s.handle);
            if req.drafts_fresh {
                req.drafts_fresh = false;
                if s.num_rows > 1 {
                    req.num_unverified_proposals = 0;
                    req.num_proposals_to_skip = 0;
                } else {
                    req.num_unverified_proposals += 1;
                    // 2^(n−1), saturating where the shift leaves u32's range.
                    let doubled = 1u32.checked_shl(req.num_unverified_proposals - 1).unwrap_or(u32::MAX);
                    req.num_proposals_to_skip = doubled.min(MAX_PROPOSALS_SKIPPED);
                }
            }
            if req.num_proposals_to_skip > 0 {
                req.num_proposals_to_skip -= 1;
                *propose = 0;
            }
        }
    }

    /// Preempts a running request; returns how many of its blocks come back only later.
    fn preempt(&mut self, handle: usize, outputs: &mut Vec<RequestUpdate>, recomputed: &mut Vec<usize>) -> u32 {
        let req = self.req(handle);
        match self.config.effective_preemption_mode(req.constrained) {
            PreemptionMode::Stop => {
                let (output, num_deferred) = self.remove(handle, FinishReason::Preempted, None);
                outputs.push(output);
                num_deferred
            }
            PreemptionMode::Recompute => {
                let incarnation = self.next_incarnation;
                self.next_incarnation += 1;
                let req = self.req_mut(handle);
                let blocks = std::mem::take(&mut req.block_table);
                let slot = req.state_slot.take();
                let last_step = req.last_step_id;
                req.num_computed_tokens = 0;
                req.num_inflight_tokens = 0;
                req.clear_drafts();
                req.status = Status::Waiting;
                req.num_preemptions += 1;
                req.num_cached_blocks = 0;
                req.snapshot_at.clear();
                req.snapshot_if_free = None;
                req.incarnation = incarnation;
                req.last_step_id = None;
                recomputed.push(handle);
                self.release(blocks, slot, last_step)
            }
        }
    }
}
