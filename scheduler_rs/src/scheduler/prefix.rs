//! Prefix caching in the scheduler (docs/architecture.md, "Prefix caching"): admission resumes a request
//! after the deepest snapshot whose blocks are all cached; computed full blocks enter the cache; state
//! snapshots are taken at the end of each prompt, at its last full block (always for resent prompts, for
//! others only where the chunk cut costs no step), at the end of each finished request, and where a
//! request's cached blocks run deeper than any snapshot (the point where prompts were seen to diverge).

use super::Scheduler;
use crate::errors::SchedulerError;
use crate::prefix_cache::KvEvents;
use crate::request::Request;
use crate::snapshots::{Dropped, Snapshot};

impl Scheduler {
    /// Gives a waiting request its hash chain's root and its full-block hashes (`block_hash.py`), its image
    /// spans (first position, positions) and whether it may resume from the cache (`lookup`); before its
    /// prefill starts.
    pub fn set_block_hashes(
        &mut self,
        request_id: &str,
        root: u64,
        block_hashes: Vec<u64>,
        image_spans: Vec<(u32, u32)>,
        lookup: bool,
    ) -> Result<(), SchedulerError> {
        let handle = self.handle(request_id)?;
        let req = self.req_mut(handle);
        if !req.block_table.is_empty() {
            return Err(SchedulerError::InvalidState(format!(
                "request {request_id}: block hashes are set before its prefill starts"
            )));
        }
        req.prefix_root = Some(root);
        req.block_hashes = block_hashes;
        req.image_spans = image_spans;
        req.prefix_lookup = lookup;
        Ok(())
    }

    /// Appends the hashes of the blocks the request's output filled since the last call.
    pub fn add_block_hashes(&mut self, request_id: &str, block_hashes: &[u64]) -> Result<(), SchedulerError> {
        let handle = self.handle(request_id)?;
        self.req_mut(handle).block_hashes.extend_from_slice(block_hashes);
        Ok(())
    }

    /// The blocks that entered and left the prefix cache since the last call.
    pub fn take_kv_events(&mut self) -> KvEvents {
        self.cache.take_events()
    }

    /// Drops every snapshot and the cache's hold on every cached block (requests keep their blocks).
    pub fn clear_prefix_cache(&mut self) {
        for dropped in self.snapshots.clear() {
            self.release_snapshot(dropped);
        }
        self.cache.clear(&mut self.blocks);
    }

    /// Gives back what a dropped snapshot held. Its save copies not yet run are cancelled first: its tail
    /// block may go to a request at once, whose writes a later copy into it would clobber. (A restore
    /// already planned from it reads before the step's forward, so before any new holder writes.)
    fn release_snapshot(&mut self, dropped: Dropped) {
        let slot = dropped.worker_slot;
        self.pending_state_copies.retain(|&(_, dst)| dst != slot);
        self.next_plan_state_copies.retain(|&(_, dst)| dst != slot);
        if let Some(block) = dropped.tail_block {
            self.pending_block_copies.retain(|&(_, dst)| dst != block);
            self.next_plan_block_copies.retain(|&(_, dst)| dst != block);
            self.free_block(block);
        }
    }

    fn handle(&self, request_id: &str) -> Result<usize, SchedulerError> {
        self.ids.get(request_id).copied().ok_or_else(|| SchedulerError::UnknownRequest(request_id.to_string()))
    }

    /// Free blocks, plus cached blocks no request holds and snapshots' tail blocks (both evicted on demand).
    pub(crate) fn num_available_blocks(&self) -> u32 {
        self.blocks.num_free() + self.cache.num_evictable() + self.snapshots.num_tail_blocks(&self.blocks)
    }

    /// The fraction of blocks not available, in [0, 1].
    pub(super) fn block_usage(&self) -> f64 {
        let total = self.blocks.num_total();
        if total == 0 {
            return 0.0;
        }
        (total - self.num_available_blocks()) as f64 / total as f64
    }

    /// Drops one holder of a block; a cached block left to the cache alone becomes evictable.
    pub(super) fn free_block(&mut self, block: u32) {
        self.blocks.free(block).expect("a held block");
        self.cache.released(block, &self.blocks);
    }

    /// Allocates `n` blocks, evicting while too few are free: cached blocks (least recently released
    /// first, with the snapshots that need them), then snapshots holding tail blocks (least recently used
    /// first). None (nothing allocated) when even eviction leaves too few. A restore planned in this step
    /// from an evicted snapshot is safe: its copies run before the step's forward writes the block.
    pub(super) fn take_blocks(&mut self, n: u32) -> Option<Vec<u32>> {
        if n > self.num_available_blocks() {
            return None;
        }
        while self.blocks.num_free() < n {
            if let Some(hash) = self.cache.evict_one(&mut self.blocks) {
                for dropped in self.snapshots.drop_dependents(hash) {
                    self.release_snapshot(dropped);
                }
            } else {
                let dropped = self.snapshots.evict_tail_block(&self.blocks).expect("counted tail blocks");
                self.release_snapshot(dropped);
            }
        }
        self.blocks.allocate_many(n)
    }

    /// Gives a new (or recomputed) request its blocks and state slot; false (nothing taken) when they do
    /// not fit. With a hit, its cached blocks are shared, the snapshot is copied into its slot (and the
    /// snapshot's tail block into its first own block) before the step's forward, and its prefill
    /// starts at the snapshot's boundary.
    pub(super) fn admit(&mut self, handle: usize) -> bool {
        let block_size = self.config.block_size;
        let (num_cached, hit) = self.resume_point(handle);
        let req = self.req(handle);
        let len = req.len();
        let caching = self.config.enable_prefix_caching && req.prefix_root.is_some();
        let lookup = caching && req.prefix_lookup;
        let boundary = hit.map_or(0, |(_, b)| b);
        let depth = (boundary / block_size) as usize;
        let shared: Vec<u32> =
            req.block_hashes[..depth].iter().map(|&h| self.cache.get(h).expect("a hit's blocks are cached")).collect();
        let num_fresh = Request::blocks_for(len, block_size) - depth as u32;
        let num_shared_evictable = shared.iter().filter(|&&b| self.blocks.ref_count(b) == 1).count() as u32;
        // The hit's snapshot (its tail block, its worker slot) stays: it is pinned until the plan is out, and
        // its own tail block is not counted as available.
        let restore = hit.map(|(id, _)| (self.snapshots.get(id).tail_block, self.snapshots.worker_slot(id)));
        let own_tail = restore.is_some_and(|(tail, _)| tail.is_some_and(|b| self.blocks.ref_count(b) == 1)) as u32;
        if num_fresh + num_shared_evictable + own_tail > self.num_available_blocks() || self.slots.num_free() == 0 {
            return false;
        }
        let divergence = num_cached as u32 * block_size;
        let sibling = self.sibling_divergence(handle);
        let last_full_block = (len - 1) / block_size * block_size;
        // A prompt that shares its first block with cached blocks or another live prompt, or resumes from a
        // snapshot, is resent traffic (a conversation's later turn, agents or chats sharing a system prompt):
        // its own successor will most likely resend it, so its last full block is worth a step; unless it
        // resumed at an earlier prompt's or request's end, extending that sequence token for token, so that its
        // own end will serve its successor too. Any other prompt snapshots there only where that costs no step
        // (`snapshot_if_free`).
        let seen = num_cached > 0 || hit.is_some() || (caching && self.shares_first_block(handle));
        let extends = hit.is_some_and(|(id, _)| self.snapshots.get(id).at_end);
        let resent = seen && !extends;
        let wanted = |b: u32| caching && b > boundary && b < len;
        let mut snapshot_at: Vec<u32> = [Some(divergence), Some(sibling), resent.then_some(last_full_block)]
            .into_iter()
            .flatten()
            .filter(|&b| wanted(b))
            .collect();
        snapshot_at.sort_unstable();
        snapshot_at.dedup();
        let snapshot_if_free = (!resent && wanted(last_full_block)).then_some(last_full_block);
        if let Some((id, _)) = hit {
            self.snapshots.touch(id);
            self.snapshots.pin(id);
        }
        for &block in &shared {
            self.cache.acquire(block, &mut self.blocks);
        }
        let fresh = self.take_blocks(num_fresh).expect("checked available blocks");
        let slot = self.slots.allocate().expect("checked free slots");
        if let Some((tail_block, worker_slot)) = restore {
            if let Some(tail_block) = tail_block {
                self.pending_block_copies.push((tail_block, fresh[0]));
            }
            self.pending_state_copies.push((worker_slot, slot));
        }
        if lookup {
            self.prefix_cache_queries += len as u64;
            self.prefix_cache_hits += boundary as u64;
        }
        let req = self.req_mut(handle);
        req.block_table = shared;
        req.block_table.extend(fresh);
        req.state_slot = Some(slot);
        req.num_computed_tokens = boundary;
        req.num_cached_blocks = depth as u32;
        req.num_cached_tokens = boundary;
        req.snapshot_at = snapshot_at;
        req.snapshot_if_free = snapshot_if_free;
        true
    }

    /// The request's cached full blocks (0 without prefix caching) and the deepest snapshot it may resume
    /// from now, (id, boundary) (`Snapshots::find`; None where it may not look up).
    fn resume_point(&self, handle: usize) -> (usize, Option<(u32, u32)>) {
        let req = self.req(handle);
        let Some(root) = req.prefix_root.filter(|_| self.config.enable_prefix_caching) else { return (0, None) };
        let num_cached = self.cache.num_cached(&req.block_hashes);
        if !req.prefix_lookup {
            return (num_cached, None);
        }
        let step = self.next_step_id - 1;
        let block_size = self.config.block_size;
        let hashes = &req.block_hashes;
        let hit = self.snapshots.find(root, hashes, num_cached, &req.tokens, req.len() - 1, block_size, step, |s, e| {
            !req.overlaps_image(s, e)
        });
        (num_cached, hit)
    }

    /// Where the request would resume if admitted now: its snapshot hit's boundary, or 0.
    pub(super) fn resume_boundary(&self, handle: usize) -> u32 {
        self.resume_point(handle).1.map_or(0, |(_, boundary)| boundary)
    }

    /// Whether another live request's prompt has the same first full block (same hash, so same root).
    fn shares_first_block(&self, handle: usize) -> bool {
        let Some(&first) = self.req(handle).block_hashes.first() else { return false };
        self.slab
            .iter()
            .enumerate()
            .any(|(h, r)| h != handle && r.as_ref().is_some_and(|r| r.block_hashes.first() == Some(&first)))
    }

    /// The rows of a prompt chunk starting at the request's next position, at most `limit`: cut at its
    /// next `snapshot_at`, so that boundary ends a step; cut at its `snapshot_if_free` only when the prompt
    /// needs another step anyway (the chunk, uncut, would not reach its end), so the cut adds no step.
    pub(super) fn chunk_rows(&self, handle: usize, limit: u32) -> u32 {
        let req = self.req(handle);
        let next = req.next_position();
        let rows = match req.snapshot_at.iter().find(|&&at| at > next) {
            Some(&at) => limit.min(at - next),
            None => limit,
        };
        match req.snapshot_if_free {
            Some(at) if at > next && at - next < rows && rows < req.num_uncomputed_prompt_tokens() => at - next,
            _ => rows,
        }
    }

    /// A prompt chunk ending at `end` was scheduled: at one of the request's `snapshot_at` or at the end of
    /// its prompt (`is_last`), its state is snapshotted by the next plan, before that step's forward.
    pub(super) fn after_chunk(&mut self, handle: usize, end: u32, is_last: bool) {
        let req = self.req_mut(handle);
        let at_boundary = req.snapshot_at.contains(&end) || req.snapshot_if_free == Some(end);
        req.snapshot_at.retain(|&at| at > end);
        req.snapshot_if_free = req.snapshot_if_free.filter(|&at| at > end);
        if at_boundary || is_last {
            self.save(handle, end, false, is_last);
        }
    }

    /// Offers the request's computed full blocks with known hashes to the cache.
    pub(super) fn register_blocks(&mut self, handle: usize) {
        if !self.config.enable_prefix_caching {
            return;
        }
        let block_size = self.config.block_size;
        let req = self.req(handle);
        let upto = ((req.num_computed_tokens / block_size) as usize).min(req.block_hashes.len()).min(req.block_table.len());
        let first = req.num_cached_blocks as usize;
        if upto <= first {
            return;
        }
        let pairs: Vec<(u64, u32)> = (first..upto).map(|i| (req.block_hashes[i], req.block_table[i])).collect();
        for (hash, block) in pairs {
            self.cache.insert(hash, block, &mut self.blocks);
        }
        self.req_mut(handle).num_cached_blocks = upto as u32;
    }

    /// A request ends (stop or length) with step `step_id`: its state after its computed positions is
    /// snapshotted, so its conversation's next turn resumes after the answer. With drafts the state is
    /// clean only when no later step of the request is in flight (that step's accepted rows would have
    /// written the draft ring the snapshot needs): otherwise no snapshot.
    pub(super) fn save_at_finish(&mut self, handle: usize, step_id: u64) {
        let req = self.req(handle);
        if self.config.nextn > 0 && req.last_step_id != Some(step_id) {
            return;
        }
        self.save(handle, req.num_computed_tokens, true, true);
    }

    /// Snapshots the request's state after `boundary` computed positions. `at_finish`: the request
    /// ends now, so its slot is copied by the next plan (after any step of it in flight, whose writes
    /// land beyond the boundary or outside the windows read from it) and its partial block passes to
    /// the snapshot; otherwise the request goes on and the next plan copies the partial block too.
    /// `at_end`: the boundary is the prompt's end or the request's (`Snapshot::at_end`).
    fn save(&mut self, handle: usize, boundary: u32, at_finish: bool, at_end: bool) {
        if !self.config.enable_prefix_caching || self.config.num_state_snapshots == 0 {
            return;
        }
        let block_size = self.config.block_size;
        let req = self.req(handle);
        let depth = (boundary / block_size) as usize;
        let Some(slot) = req.state_slot else { return };
        let Some(root) = req.prefix_root else { return };
        if boundary == 0 || depth > req.block_hashes.len() || boundary > req.len() {
            return;
        }
        let tail_start = depth as u32 * block_size;
        if boundary > tail_start && req.overlaps_image(tail_start, boundary) {
            return;
        }
        let chain = req.block_hashes[..depth].to_vec();
        let tail = req.tokens[tail_start as usize..boundary as usize].to_vec();
        let key = chain.last().copied().unwrap_or(root);
        if let Some(id) = self.snapshots.find_exact(key, depth, &tail) {
            self.snapshots.touch(id);
            if at_end {
                self.snapshots.mark_at_end(id);
            }
            return;
        }
        let partial = (!tail.is_empty()).then(|| req.block_table[depth]);
        let tail_block = match partial {
            None => None,
            Some(block) if at_finish => {
                self.blocks.incref(block).expect("the request holds its blocks");
                Some(block)
            }
            Some(block) => {
                let Some(copy) = self.take_blocks(1) else { return };
                self.next_plan_block_copies.push((block, copy[0]));
                Some(copy[0])
            }
        };
        let ready_step = self.next_step_id;
        match self.snapshots.insert(Snapshot { key, chain, tail, tail_block, ready_step, at_end }) {
            Some((id, evicted)) => {
                if let Some(dropped) = evicted {
                    self.release_snapshot(dropped);
                }
                let copy = (slot, self.snapshots.worker_slot(id));
                if at_finish {
                    self.pending_state_copies.push(copy);
                } else {
                    self.next_plan_state_copies.push(copy);
                }
            }
            None => {
                if let Some(block) = tail_block {
                    if !at_finish {
                        self.next_plan_block_copies.pop();
                    }
                    self.free_block(block);
                }
            }
        }
    }
}
