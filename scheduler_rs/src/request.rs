//! A request as the scheduler sees it: its tokens, how much of them has KV, what is in flight, its
//! block table and state slot, its status and its stop rules.

use std::fmt;

use crate::queue_order::QueueOrder;

/// Why a request ended. The one enum that Rust, the Python stub, the protos and the HTTP API share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// The end token (unless ignored) or a stop token id.
    Stop,
    /// `max_tokens` or the model's maximum length.
    Length,
    /// Aborted by the client or the server.
    Abort,
    /// Stopped to free blocks for others (preemption mode `stop`).
    Preempted,
    /// The request cannot go on (for example every token was masked).
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Preempted => "preempted",
            FinishReason::Error => "error",
        }
    }
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// In the waiting queue: prompt (or a recompute) not fully prefilled yet.
    Waiting,
    /// Prefill done; decoding.
    Running,
    Finished(FinishReason),
}

/// When a request stops, checked on every appended token in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopRules {
    /// At most this many output tokens.
    pub max_tokens: u32,
    /// The end token; ends the request unless `ignore_eos`.
    pub eos_token_id: Option<u32>,
    pub ignore_eos: bool,
    /// Any of these ends the request with `stop`.
    pub stop_token_ids: Vec<u32>,
}

impl StopRules {
    pub fn new(max_tokens: u32) -> Self {
        StopRules { max_tokens, eos_token_id: None, ignore_eos: false, stop_token_ids: Vec::new() }
    }

    /// The finish reason and the matched stop token, if `token` (the `num_output_tokens`-th output)
    /// ends the request.
    pub fn check(&self, token: u32, num_output_tokens: u32) -> Option<(FinishReason, Option<u32>)> {
        if !self.ignore_eos && self.eos_token_id == Some(token) {
            return Some((FinishReason::Stop, Some(token)));
        }
        if self.stop_token_ids.contains(&token) {
            return Some((FinishReason::Stop, Some(token)));
        }
        if num_output_tokens >= self.max_tokens {
            return Some((FinishReason::Length, None));
        }
        None
    }
}

#[derive(Debug, Clone)]
pub struct Request {
    /// The request's unique id, made by the gateway and used unchanged by every layer and rank.
    pub request_id: String,
    /// Prompt followed by the accepted output tokens.
    pub tokens: Vec<u32>,
    pub num_prompt_tokens: u32,
    /// Tokens whose KV is written and valid. In decode this is `tokens.len() - 1`: the newest token
    /// has no KV until the next step runs it.
    pub num_computed_tokens: u32,
    /// Positions that in-flight steps (planned, not yet updated) count as computed, assuming every
    /// row is accepted. The next plan starts at `num_computed_tokens + num_inflight_tokens`.
    pub num_inflight_tokens: u32,
    /// Proposed tokens to verify after the newest token, from the last updated step.
    pub draft_tokens: Vec<u32>,
    /// Each draft's chance of passing with all before it (`StepResult::draft_confidences`); empty when
    /// the worker gave none.
    pub draft_confidences: Vec<f64>,
    /// The drafts above came from the last updated step and no plan has ranked them yet.
    pub drafts_fresh: bool,
    /// Consecutive proposals of which varlen verified no draft (one it verifies resets it).
    pub num_unverified_proposals: u32,
    /// Decode steps left in which the draft skips this request (`Scheduler::pace_proposals`).
    pub num_proposals_to_skip: u32,
    /// Paged blocks, in position order. Covers every position a planned step may write.
    pub block_table: Vec<u32>,
    pub state_slot: Option<u32>,
    pub status: Status,
    pub stop: StopRules,
    /// False until its inputs are ready (the multimodal gate); a waiting request that is not
    /// schedulable is skipped by prefill scheduling and keeps its place in the queue.
    pub schedulable: bool,
    /// Grammar-constrained: a grammar's state cannot be replayed, so preemption always stops it.
    pub constrained: bool,
    /// Id of the newest step that includes this request, if any.
    pub last_step_id: Option<u64>,
    /// Order of arrival (`QueueOrder::arrival`).
    pub arrival: u64,
    /// Lower is served first (`QueueOrder::priority`); 0 by default.
    pub priority: i32,
    /// Who the request is served for (an API key's id, or a client of an open API): the queue is fair
    /// across tenants (`QueueOrder::share`). "" by default: one tenant for every request not given one.
    pub tenant: String,
    /// The tenant's slot in the scheduler's `TenantShares`, set when the request goes live.
    pub tenant_slot: usize,
    pub num_preemptions: u32,
    /// Unique per admission or recompute; a step's results apply only to the incarnation it planned.
    pub incarnation: u64,
    /// Prefix caching: the hashes of the request's full blocks known so far (its prompt's at admission,
    /// then each block its output fills); empty when the engine gave none (the request shares nothing).
    pub block_hashes: Vec<u64>,
    /// The root of the request's hash chain (`block_hash.root_hash`: the model and salt); None when the engine
    /// gave none (the request shares nothing).
    pub prefix_root: Option<u64>,
    /// Image spans (first position, positions) of the prompt: a snapshot's tail never covers one.
    pub image_spans: Vec<(u32, u32)>,
    /// May resume from the prefix cache (false: every position is computed, e.g. for prompt logprobs).
    pub prefix_lookup: bool,
    /// Blocks `0..num_cached_blocks` of the block table have been offered to the prefix cache.
    pub num_cached_blocks: u32,
    /// Positions the last admission took from the prefix cache (not computed).
    pub num_cached_tokens: u32,
    /// Boundaries (ascending) where this request's prefill ends a chunk and snapshots its state: the end
    /// of the cached blocks where they are deeper than any snapshot (where prompts were seen to diverge),
    /// and, for a resent prompt (`Scheduler::admit` says which), its last full block (where a re-rendered
    /// chat history diverges from this prompt).
    pub snapshot_at: Vec<u32>,
    /// Any other prompt's last full block: its chunk is cut and snapshotted there only when the prompt needs
    /// another step anyway, so the snapshot costs no step (None: none, or passed).
    pub snapshot_if_free: Option<u32>,
}

impl Request {
    pub fn new(request_id: String, prompt: Vec<u32>, stop: StopRules, arrival: u64) -> Self {
        let num_prompt_tokens = prompt.len() as u32;
        Request {
            request_id,
            tokens: prompt,
            num_prompt_tokens,
            num_computed_tokens: 0,
            num_inflight_tokens: 0,
            draft_tokens: Vec::new(),
            draft_confidences: Vec::new(),
            drafts_fresh: false,
            num_unverified_proposals: 0,
            num_proposals_to_skip: 0,
            block_table: Vec::new(),
            state_slot: None,
            status: Status::Waiting,
            stop,
            schedulable: true,
            constrained: false,
            last_step_id: None,
            arrival,
            priority: 0,
            tenant: String::new(),
            tenant_slot: 0,
            num_preemptions: 0,
            incarnation: 0,
            block_hashes: Vec::new(),
            prefix_root: None,
            image_spans: Vec::new(),
            prefix_lookup: true,
            num_cached_blocks: 0,
            num_cached_tokens: 0,
            snapshot_at: Vec::new(),
            snapshot_if_free: None,
        }
    }

    /// The request's place in the waiting queue and in preemption (`queue_order`), given its
    /// tenant's `share`.
    pub fn order(&self, share: u64) -> QueueOrder {
        QueueOrder { share, priority: self.priority, arrival: self.arrival }
    }

    pub fn len(&self) -> u32 {
        self.tokens.len() as u32
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn num_output_tokens(&self) -> u32 {
        self.len() - self.num_prompt_tokens
    }

    /// The first position the next plan computes.
    pub fn next_position(&self) -> u32 {
        self.num_computed_tokens + self.num_inflight_tokens
    }

    /// Tokens still to prefill beyond what is computed or in flight.
    pub fn num_uncomputed_prompt_tokens(&self) -> u32 {
        self.len().saturating_sub(self.next_position())
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.status, Status::Finished(_))
    }

    /// Drops the drafts and their back-off: a request that restarts (recompute, fork) proposes afresh.
    pub fn clear_drafts(&mut self) {
        self.draft_tokens.clear();
        self.draft_confidences.clear();
        self.drafts_fresh = false;
        self.num_unverified_proposals = 0;
        self.num_proposals_to_skip = 0;
    }

    /// Whether positions `start..end` overlap an image span.
    pub fn overlaps_image(&self, start: u32, end: u32) -> bool {
        self.image_spans.iter().any(|&(s, n)| s < end && s + n > start)
    }

    /// Blocks needed to hold positions `0..num_positions`.
    pub fn blocks_for(num_positions: u32, block_size: u32) -> u32 {
        num_positions.div_ceil(block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_rules_in_priority_order() {
        let mut rules = StopRules::new(3);
        rules.eos_token_id = Some(1);
        rules.stop_token_ids = vec![9];
        assert_eq!(rules.check(5, 1), None);
        assert_eq!(rules.check(1, 1), Some((FinishReason::Stop, Some(1))));
        assert_eq!(rules.check(9, 1), Some((FinishReason::Stop, Some(9))));
        assert_eq!(rules.check(5, 3), Some((FinishReason::Length, None)));
        rules.ignore_eos = true;
        assert_eq!(rules.check(1, 1), None);
    }

    #[test]
    fn positions_count_in_flight_tokens() {
        let mut req = Request::new("r".into(), vec![1; 10], StopRules::new(4), 0);
        req.num_computed_tokens = 4;
        req.num_inflight_tokens = 3;
        assert_eq!(req.next_position(), 7);
        assert_eq!(req.num_uncomputed_prompt_tokens(), 3);
        assert_eq!(Request::blocks_for(129, 128), 2);
        assert_eq!(Request::blocks_for(50_000, 128), 391);
    }
}
