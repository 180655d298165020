//! Fork: a child request sharing its parent's full blocks (walkthrough Pass 1, the drawers).

use super::Scheduler;
use crate::errors::SchedulerError;
use crate::request::{Request, Status, StopRules};

impl Scheduler {
    /// Adds `child_id` as a copy of a request that has no step in flight: it shares the parent's
    /// full blocks by reference count, gets a copy of the partial last block and of the state slot
    /// (done by the worker before the next step), and waits to prefill the tokens without KV.
    pub fn fork(&mut self, parent_id: &str, child_id: String, stop: StopRules) -> Result<(), SchedulerError> {
        let &parent_handle = self
            .ids
            .get(parent_id)
            .ok_or_else(|| SchedulerError::UnknownRequest(parent_id.to_string()))?;
        if self.ids.contains_key(&child_id) {
            return Err(SchedulerError::DuplicateRequest(child_id));
        }
        let parent = self.req(parent_handle);
        if self.in_flight(parent) {
            return Err(SchedulerError::InvalidState(format!(
                "cannot fork request {parent_id} while a step that includes it is in flight"
            )));
        }
        let (Some(parent_slot), false) = (parent.state_slot, parent.block_table.is_empty()) else {
            return Err(SchedulerError::InvalidState(format!(
                "cannot fork request {parent_id} before its prefill has started"
            )));
        };
        let block_size = self.config.block_size;
        let num_full = (parent.num_computed_tokens / block_size) as usize;
        let has_partial = !parent.num_computed_tokens.is_multiple_of(block_size);
        let num_needed = Request::blocks_for(parent.len(), block_size) as usize;
        let num_new = num_needed - num_full;
        if self.num_available_blocks() < num_new as u32 || self.slots.num_free() == 0 {
            return Err(SchedulerError::InvalidState(format!(
                "not enough free blocks or state slots to fork {parent_id}"
            )));
        }
        let partial_source = has_partial.then(|| parent.block_table[num_full]);
        let mut child = parent.clone();
        child.request_id = child_id;
        child.stop = stop;
        child.status = Status::Waiting;
        child.clear_drafts();
        child.last_step_id = None;
        child.num_inflight_tokens = 0;
        child.arrival = self.next_arrival;
        self.next_arrival += 1;
        child.block_table.truncate(num_full);
        child.num_cached_blocks = child.num_cached_blocks.min(num_full as u32);
        child.snapshot_at.clear();
        child.snapshot_if_free = None;
        for &block in &child.block_table {
            self.blocks.incref(block).expect("parent holds its blocks");
        }
        let fresh = self.take_blocks(num_new as u32).expect("checked available blocks");
        if let Some(source) = partial_source {
            self.pending_block_copies.push((source, fresh[0]));
        }
        child.block_table.extend(fresh);
        let child_slot = self.slots.allocate().expect("checked free slots");
        child.state_slot = Some(child_slot);
        self.pending_state_copies.push((parent_slot, child_slot));
        let handle = self.insert(child);
        self.enqueue(handle);
        Ok(())
    }
}
