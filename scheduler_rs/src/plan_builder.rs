//! Builds a `StepPlan`'s flat arrays, one scheduled request at a time.

use crate::config::SchedulerConfig;
use crate::request::Request;
use crate::step::{graph_sizes, select_graph_size, EntryWrites, StepKind, StepPlan};

pub(crate) struct PlanBuilder<'a> {
    config: &'a SchedulerConfig,
    plan: StepPlan,
    tables: Vec<&'a [u32]>,
}

impl<'a> PlanBuilder<'a> {
    pub fn new(config: &'a SchedulerConfig, step_id: u64, kind: StepKind) -> Self {
        let entry_writes = config
            .compress_ratios
            .iter()
            .map(|&ratio| EntryWrites { ratio, ..Default::default() })
            .collect();
        PlanBuilder {
            config,
            tables: Vec::new(),
            plan: StepPlan {
                step_id,
                kind,
                is_placeholder: false,
                request_ids: Vec::new(),
                num_decode_requests: 0,
                seqlens_q: Vec::new(),
                seqlens_k: Vec::new(),
                query_start: vec![0],
                state_slots: Vec::new(),
                block_tables: Vec::new(),
                block_table_width: 0,
                inputs_pending: Vec::new(),
                input_ids: Vec::new(),
                positions: Vec::new(),
                ring_slots: Vec::new(),
                row_requests: Vec::new(),
                entry_writes,
                sample_rows: Vec::new(),
                num_sample_rows: Vec::new(),
                propose_drafts: Vec::new(),
                graph_size: None,
                num_padding_rows: 0,
                block_copies: Vec::new(),
                state_copies: Vec::new(),
                outputs: Vec::new(),
                handles: Vec::new(),
            },
        }
    }

    /// Adds `input_ids.len()` rows for `req`, starting at its next position. The last
    /// `num_sample_rows` rows are sampled. `prompt`: a prompt chunk, whose inputs are known tokens
    /// even while its previous chunk is in flight. Call before the request's in-flight count moves.
    pub fn add(
        &mut self,
        handle: (usize, u64),
        req: &'a Request,
        input_ids: &[u32],
        num_sample_rows: u32,
        prompt: bool,
    ) {
        let block_size = self.config.block_size;
        let ring_size = self.config.ring_size();
        let index = self.plan.request_ids.len() as i32;
        let first_row = self.plan.positions.len() as i32;
        let start = req.next_position();
        let seqlen_q = input_ids.len() as u32;
        let table = req.block_table.as_slice();
        debug_assert!(Request::blocks_for(start + seqlen_q, block_size) as usize <= table.len());

        self.plan.handles.push(handle);
        self.plan.request_ids.push(req.request_id.clone());
        self.plan.seqlens_q.push(seqlen_q as i32);
        self.plan.seqlens_k.push((start + seqlen_q) as i32);
        self.plan.query_start.push(first_row + seqlen_q as i32);
        self.plan.state_slots.push(req.state_slot.unwrap_or(0) as i32);
        self.plan.inputs_pending.push((!prompt && req.num_inflight_tokens > 0) as i32);
        self.plan.num_sample_rows.push(num_sample_rows as i32);
        self.plan.propose_drafts.push(i32::from(self.config.nextn > 0));
        self.tables.push(table);

        for (offset, &token) in input_ids.iter().enumerate() {
            let position = start + offset as u32;
            let row = first_row + offset as i32;
            self.plan.input_ids.push(token as i32);
            self.plan.positions.push(position as i32);
            self.plan.ring_slots.push((position % ring_size) as i32);
            self.plan.row_requests.push(index);
            for writes in &mut self.plan.entry_writes {
                let ratio = writes.ratio;
                if !(position + 1).is_multiple_of(ratio) {
                    continue;
                }
                let entries_per_block = block_size / ratio;
                let entry = position / ratio;
                let block = table[(entry / entries_per_block) as usize];
                writes.rows.push(row);
                writes.slots.push((block * entries_per_block + entry % entries_per_block) as i32);
            }
        }
        let sample_start = first_row + (seqlen_q - num_sample_rows) as i32;
        self.plan.sample_rows.extend(sample_start..first_row + seqlen_q as i32);
    }

    pub fn finish(mut self) -> StepPlan {
        let width = self.tables.iter().map(|t| t.len()).max().unwrap_or(0);
        self.plan.block_table_width = width as u32;
        self.plan.block_tables = Vec::with_capacity(width * self.tables.len());
        for table in &self.tables {
            self.plan.block_tables.extend(table.iter().map(|&b| b as i32));
            self.plan.block_tables.extend(std::iter::repeat_n(0, width - table.len()));
        }
        let num_rows = self.plan.positions.len() as u32;
        if num_rows == 0 {
            self.plan.is_placeholder = true;
            self.plan.num_padding_rows = 1;
        }
        if self.plan.kind == StepKind::Decode {
            let sizes = graph_sizes(self.config.max_decode_rows(), self.config.cuda_graph_interval);
            let size = select_graph_size(&sizes, num_rows.max(1));
            self.plan.graph_size = size;
            if let Some(size) = size {
                self.plan.num_padding_rows = size - num_rows;
            }
        }
        self.plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TEST_LIMITS;
    use crate::request::StopRules;

    #[test]
    fn decode_row_writes_the_walkthrough_entries() {
        // r1's first decode row at position 16,389: a C2 entry 8,194 in table entry 128 at offset 2,
        // and a C1 entry 16,389 in table entry 128 at offset 5.
        let config = SchedulerConfig::new(1, TEST_LIMITS);
        let mut req = Request::new("r1".into(), vec![7; 16_390], StopRules::new(10), 0);
        req.num_computed_tokens = 16_389;
        req.block_table = (1..=129).collect();
        req.state_slot = Some(3);
        let mut builder = PlanBuilder::new(&config, 0, StepKind::Decode);
        builder.add((0, 0), &req, &[7], 1, false);
        let plan = builder.finish();
        assert_eq!(plan.positions, vec![16_389]);
        assert_eq!(plan.ring_slots, vec![16_389 % 134]);
        assert_eq!(plan.ring_slots, vec![41]);
        let c2 = &plan.entry_writes[0];
        assert_eq!((c2.ratio, c2.rows.clone()), (2, vec![0]));
        assert_eq!(c2.slots, vec![129 * 64 + 2]);
        let c1 = &plan.entry_writes[1];
        assert_eq!(c1.slots, vec![129 * 128 + 5]);
        assert_eq!(plan.graph_size, Some(1));
        assert_eq!(plan.num_padding_rows, 0);
        assert_eq!(plan.sample_rows, vec![0]);
    }

    #[test]
    fn empty_plan_is_a_placeholder() {
        let config = SchedulerConfig::new(1, TEST_LIMITS);
        let plan = PlanBuilder::new(&config, 0, StepKind::Prefill).finish();
        assert!(plan.is_placeholder);
        assert_eq!(plan.num_padding_rows, 1);
        assert_eq!(plan.query_start, vec![0]);
    }
}
