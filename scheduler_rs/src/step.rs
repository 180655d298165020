//! The contracts between the scheduler and the worker: `StepPlan` (what to run this step, as flat
//! arrays ready to become tensors) and `StepResult` (what the step produced), plus the per-request
//! `RequestUpdate` and the CUDA graph sizes.

use crate::request::FinishReason;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// Prompt chunks; every chunk's rows are new positions of one request.
    Prefill,
    /// One newest token plus its drafts per request.
    Decode,
    /// Decode rows (requests `0..num_decode_requests`), then prompt chunks (mixed scheduling).
    Mixed,
}

/// Paged compressed-entry writes of one compress ratio.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EntryWrites {
    /// Tokens per compressed entry (1 or 2 in V4.1); a block holds `block_size / ratio` entries.
    pub ratio: u32,
    /// Rows that complete an entry: `(position + 1) % ratio == 0`.
    pub rows: Vec<i32>,
    /// Where each of those entries goes: `block_id * entries_per_block + entry % entries_per_block`.
    pub slots: Vec<i32>,
}

/// One step for the worker. Per-request arrays have `num_requests` entries in plan order; per-row
/// arrays have `num_rows` entries, the rows of request i contiguous at `query_start[i]..`.
#[derive(Debug, Clone)]
pub struct StepPlan {
    /// Consecutive from 0; `update` must receive plans in this order.
    pub step_id: u64,
    pub kind: StepKind,
    /// True when this rank has no rows but runs the step so every rank joins every collective: the
    /// worker runs one fake row that routes nowhere, at block 0 and state slot 0.
    pub is_placeholder: bool,
    pub request_ids: Vec<String>,
    /// Requests `0..num_decode_requests` are decode rows (the newest token plus drafts); the rest are
    /// prompt chunks. All of a decode step's, none of a prefill step's.
    pub num_decode_requests: u32,
    /// New positions computed per request.
    pub seqlens_q: Vec<i32>,
    /// Positions visible per request after this step (cached + new), counting in-flight steps as
    /// fully accepted.
    pub seqlens_k: Vec<i32>,
    /// Prefix sums of `seqlens_q`; `num_requests + 1` entries.
    pub query_start: Vec<i32>,
    pub state_slots: Vec<i32>,
    /// `num_requests × block_table_width`, row-major, padded with block 0.
    pub block_tables: Vec<i32>,
    pub block_table_width: u32,
    /// 1 where a request's input tokens or positions depend on a step still in flight (async
    /// scheduling): the worker copies that step's sampled tokens in and fixes seqlen_k.
    pub inputs_pending: Vec<i32>,
    /// Input token per row (under `inputs_pending`, the newest known token stands in).
    pub input_ids: Vec<i32>,
    pub positions: Vec<i32>,
    /// `position mod ring_size`: the row's slot in every layer's window ring of its state slot.
    pub ring_slots: Vec<i32>,
    /// Request index (into the per-request arrays) of each row.
    pub row_requests: Vec<i32>,
    /// Compressed-entry writes, one per configured compress ratio.
    pub entry_writes: Vec<EntryWrites>,
    /// Rows that go through the head and the sampler, in request order.
    pub sample_rows: Vec<i32>,
    /// Sampled rows per request: 0 for a prompt chunk that is not the last, 1 for a last chunk,
    /// 1 + drafts in decode.
    pub num_sample_rows: Vec<i32>,
    /// Per request: 1 where the worker proposes drafts after this step, 0 where no draft it proposed
    /// could be verified next (speculative decoding; 0 throughout without it). See
    /// `Scheduler::drafts_can_pay`.
    pub propose_drafts: Vec<i32>,
    /// The CUDA graph this step fits (decode only): the smallest captured size ≥ rows.
    pub graph_size: Option<u32>,
    /// Placeholder rows the worker appends (to fill the graph, or the one row of a placeholder step).
    pub num_padding_rows: u32,
    /// (source, destination) block copies to do before the forward (fork's partial last block).
    pub block_copies: Vec<(u32, u32)>,
    /// (source, destination) state-slot copies to do before the forward (fork).
    pub state_copies: Vec<(u32, u32)>,
    /// Final outputs decided while scheduling (preemption in `stop` mode).
    pub outputs: Vec<RequestUpdate>,
    /// (slab handle, incarnation) of each request, so results reach the same incarnation only.
    pub(crate) handles: Vec<(usize, u64)>,
}

impl StepPlan {
    pub fn num_requests(&self) -> usize {
        self.request_ids.len()
    }

    pub fn num_rows(&self) -> usize {
        self.positions.len()
    }

    /// Whether request `i` of the plan is a prompt chunk (not decode rows).
    pub fn is_prompt_chunk(&self, i: usize) -> bool {
        i >= self.num_decode_requests as usize
    }
}

/// What a step produced, per request of its plan, in plan order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepResult {
    /// Tokens produced per request: 0 for a prompt chunk that is not the last, otherwise the
    /// accepted drafts plus one sampled token (1 ≤ n ≤ sampled rows).
    pub num_tokens: Vec<u32>,
    /// The produced tokens, concatenated in plan order.
    pub token_ids: Vec<u32>,
    /// New drafts per request for its next step (empty when there is no draft model).
    pub num_draft_tokens: Vec<u32>,
    pub draft_token_ids: Vec<u32>,
    /// Per draft (aligned with `draft_token_ids`), the draft's chance of being accepted together with
    /// every earlier draft of its request, in [0, 1] (the confidence head's σ, multiplied along the
    /// request); empty when the worker gives none (varlen then counts every draft as certain).
    pub draft_confidences: Vec<f64>,
    /// Request indices that cannot go on (every token masked): they end with `error`.
    pub errors: Vec<u32>,
}

/// The tokens one request gained in a step, and its end if it ended. (The engine folds these into its
/// `RequestOutput`, which holds a request's whole output.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestUpdate {
    pub request_id: String,
    pub token_ids: Vec<u32>,
    pub finish_reason: Option<FinishReason>,
    /// The end or stop token that ended the request, if one did.
    pub stop_token_id: Option<u32>,
    pub num_prompt_tokens: u32,
    /// Output tokens so far, including `token_ids`.
    pub num_output_tokens: u32,
    /// Positions the request's latest admission took from the prefix cache instead of computing them.
    pub num_cached_tokens: u32,
}

/// CUDA graph sizes: powers of two up to `interval`, then multiples of it up to `max_rows`; the
/// largest is always `max_rows`, so every step fits one.
pub fn graph_sizes(max_rows: u32, interval: u32) -> Vec<u32> {
    let interval = interval.max(1);
    let mut sizes = Vec::new();
    let mut p = 1;
    while p <= interval && p <= max_rows {
        sizes.push(p);
        p *= 2;
    }
    let mut m = 2 * interval;
    while m <= max_rows {
        sizes.push(m);
        m += interval;
    }
    if sizes.last() != Some(&max_rows) && max_rows > 0 {
        sizes.push(max_rows);
    }
    sizes.dedup();
    sizes
}

/// The smallest size that holds `num_rows`, if any.
pub fn select_graph_size(sizes: &[u32], num_rows: u32) -> Option<u32> {
    let i = sizes.partition_point(|&s| s < num_rows);
    sizes.get(i).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walkthrough_graph_sizes() {
        assert_eq!(graph_sizes(24, 8), vec![1, 2, 4, 8, 16, 24]);
        let big = graph_sizes(384, 8);
        assert_eq!(&big[..6], &[1, 2, 4, 8, 16, 24]);
        assert_eq!(big.len(), 3 + 48);
        assert_eq!(*big.last().unwrap(), 384);
        assert_eq!(select_graph_size(&big, 37), Some(40));
        assert_eq!(select_graph_size(&big, 24), Some(24));
        assert_eq!(select_graph_size(&big, 385), None);
    }

    #[test]
    fn sizes_below_the_interval_end_at_the_maximum() {
        assert_eq!(graph_sizes(6, 8), vec![1, 2, 4, 6]);
        assert_eq!(graph_sizes(1, 8), vec![1]);
        assert_eq!(graph_sizes(20, 8), vec![1, 2, 4, 8, 16, 20]);
    }
}
