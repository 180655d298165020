//! Mixed steps: decode rows first, then prompt chunks in the token budget left (docs/architecture.md,
//! "Mixed steps").

use super::{Scheduled, Scheduler};
use crate::step::{RequestUpdate, StepKind};

impl Scheduler {
    /// A mixed step: every running request's decode rows first, then prompt chunks in the budget
    /// those rows leave. No vote: the step's shape needs no agreement between data-parallel ranks
    /// (each runs its own rows, or a placeholder, through the same collectives). A step that
    /// preempted starts no new prompt, so a victim's blocks are not handed straight to a newcomer.
    /// The step's kind follows its rows: `Decode` without prompt chunks (so it replays a CUDA graph),
    /// `Prefill` without decode rows, `Mixed` with both.
    pub(super) fn schedule_mixed(&mut self) -> (StepKind, Vec<Scheduled>, Vec<RequestUpdate>) {
        let (mut chosen, outputs, preempted) = self.schedule_decode();
        let num_decode = chosen.len();
        let num_decode_rows: u32 = chosen.iter().map(|s| s.num_rows).sum();
        let budget = self.config.max_num_batched_tokens.saturating_sub(num_decode_rows);
        chosen.extend(self.schedule_prefill(budget, !preempted));
        let kind = match (num_decode, chosen.len() - num_decode) {
            (_, 0) => StepKind::Decode,
            (0, _) => StepKind::Prefill,
            _ => StepKind::Mixed,
        };
        (kind, chosen, outputs)
    }
}
