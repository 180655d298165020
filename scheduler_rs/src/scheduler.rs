//! The scheduler: DeepInfer's step planning (walkthrough Pass 2 Thread 1, Pass 3 Threads 1–2),
//! with its abort leak and its needless preemption fixed.
//!
//! The engine's loop is `schedule()` → run the plan → `update(plan, result)`. Under async
//! scheduling the engine may plan step N+1 before updating step N: a planned step counts its rows as
//! computed (`num_inflight_tokens`) until it is updated, and anything freed while a step that names
//! it is in flight is released only when that step is updated (a deferred free).
//!
//! Pool invariant, checked by `check_invariants` after every step in tests: every held block or
//! state slot is named by exactly as many live block tables (requests plus deferred frees) as its
//! reference count, and free + held = total for both pools.

use std::collections::{HashMap, VecDeque};

use crate::block_manager::BlockManager;
use crate::config::{EngineType, SchedulerConfig};
use crate::plan_builder::PlanBuilder;
use crate::prefix_cache::PrefixCache;
use crate::queue_order::{insertion_point, QueueOrder, TenantShares};
use crate::request::{FinishReason, Request, StopRules};
use crate::snapshots::Snapshots;
use crate::step::{RequestUpdate, StepKind, StepPlan};
use crate::varlen::MtpVarlen;

pub use crate::errors::SchedulerError;

mod decode;
mod fork;
mod mixed;
mod prefill;
mod prefix;
mod shared_prefill;
mod update;
#[cfg(test)]
mod fairness_tests;
#[cfg(test)]
mod mixed_tests;
#[cfg(test)]
mod prefix_tests;
#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VoteOp {
    /// True when every rank votes true.
    All,
    /// True when any rank votes true.
    Any,
}

/// The data-parallel group's all-reduce over one boolean, supplied by the caller.
pub trait Collective {
    fn vote(&mut self, value: bool, op: VoteOp) -> bool;
}

/// A group of one rank needs no communication.
pub struct SingleRank;

impl Collective for SingleRank {
    fn vote(&mut self, value: bool, _op: VoteOp) -> bool {
        value
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerStats {
    pub num_free_blocks: u32,
    pub num_total_blocks: u32,
    pub num_free_state_slots: u32,
    pub num_total_state_slots: u32,
    pub num_waiting: u32,
    pub num_running: u32,
    /// Decode steps since the last prompt step; vote points are multiples of the intervals.
    pub decode_step: u64,
    /// Planned steps not yet updated.
    pub num_steps_in_flight: u64,
    /// Blocks waiting for an in-flight step before they return to the free list.
    pub num_deferred_blocks: u32,
    /// Blocks in the prefix cache (held by requests or not); those no request holds count as free.
    pub num_cached_blocks: u32,
    /// State snapshots held.
    pub num_state_snapshots: u32,
    /// Prompt tokens looked up in the prefix cache (vLLM's `prefix_cache_queries`), since the start.
    pub prefix_cache_queries: u64,
    /// Of those, tokens found (resumed from a snapshot instead of computed).
    pub prefix_cache_hits: u64,
    /// Prompt-chunk rows planned since the start (prompt and recomputed tokens that were computed).
    pub num_prefill_tokens: u64,
}

/// Resources released when the step `release_after` is updated.
#[derive(Debug, Clone)]
struct DeferredFree {
    release_after: u64,
    blocks: Vec<u32>,
    state_slot: Option<u32>,
}

/// A request chosen for this step, before the plan is built.
struct Scheduled {
    handle: usize,
    num_rows: u32,
    num_sample_rows: u32,
    /// A prompt chunk (its rows are prompt or recomputed tokens); false: decode rows.
    prompt: bool,
}

pub struct Scheduler {
    config: SchedulerConfig,
    blocks: BlockManager,
    slots: BlockManager,
    /// Live requests (waiting or running) by handle; finished ones are removed at once.
    slab: Vec<Option<Request>>,
    free_handles: Vec<usize>,
    ids: HashMap<String, usize>,
    waiting: VecDeque<usize>,
    running: Vec<usize>,
    decode_step: u64,
    /// The group's last work-left vote found no rank with work (`mark_group_idle`); the next
    /// NORMAL vote is an ANY point. Cleared by that vote.
    group_idle: bool,
    next_step_id: u64,
    /// Steps `0..num_steps_updated` are updated; later planned ones are in flight.
    num_steps_updated: u64,
    deferred: Vec<DeferredFree>,
    pending_block_copies: Vec<(u32, u32)>,
    pending_state_copies: Vec<(u32, u32)>,
    next_arrival: u64,
    next_incarnation: u64,
    /// Service per tenant with live requests: the first field of the queue's order (`queue_order`).
    shares: TenantShares,
    /// Varlen verification's step-cost curve (`set_step_cost`); None until the engine gives one.
    varlen: Option<MtpVarlen>,
    /// The curve is measured, not a guess (`set_step_cost`).
    step_cost_measured: bool,
    /// Prefix caching's blocks (`prefix_cache`) and state snapshots (`snapshots`).
    cache: PrefixCache,
    snapshots: Snapshots,
    /// Snapshot copies planned while scheduling a step that computes their boundary: they go into the
    /// next plan, before that step's forward, so they copy the state right after the boundary's step.
    next_plan_block_copies: Vec<(u32, u32)>,
    next_plan_state_copies: Vec<(u32, u32)>,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    num_prefill_tokens: u64,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Result<Self, SchedulerError> {
        config.validate().map_err(SchedulerError::InvalidConfig)?;
        let num_snapshots = if config.enable_prefix_caching { config.num_state_snapshots } else { 0 };
        let snapshots = Snapshots::new(num_snapshots, config.num_state_slots);
        Ok(Scheduler {
            blocks: BlockManager::new("block", config.num_blocks),
            slots: BlockManager::new("state slot", config.num_state_slots),
            config,
            slab: Vec::new(),
            free_handles: Vec::new(),
            ids: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            decode_step: 0,
            group_idle: false,
            next_step_id: 0,
            num_steps_updated: 0,
            deferred: Vec::new(),
            pending_block_copies: Vec::new(),
            pending_state_copies: Vec::new(),
            next_arrival: 0,
            next_incarnation: 0,
            shares: TenantShares::default(),
            varlen: None,
            step_cost_measured: false,
            cache: PrefixCache::default(),
            snapshots,
            next_plan_block_copies: Vec::new(),
            next_plan_state_copies: Vec::new(),
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            num_prefill_tokens: 0,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The step-cost curve varlen verification ranks drafts against: (rows, step milliseconds) per
    /// measured graph size, plus the sampler's milliseconds per step. Replaces the previous curve.
    /// `measured`: the curve comes from measurements (or the user), not a guess; only a measured curve
    /// may stop the draft from proposing (`drafts_can_pay`), since a guess that stopped it could never
    /// be corrected by the steps that follow.
    pub fn set_step_cost(
        &mut self,
        step_cost_ms: Vec<(u32, f64)>,
        sampler_ms: f64,
        measured: bool,
    ) -> Result<(), SchedulerError> {
        if !self.config.spec_varlen {
            return Err(SchedulerError::InvalidConfig("a step-cost curve needs spec_varlen".into()));
        }
        self.varlen = Some(MtpVarlen::new(step_cost_ms, sampler_ms).map_err(SchedulerError::InvalidConfig)?);
        self.step_cost_measured = measured;
        Ok(())
    }

    pub fn request(&self, request_id: &str) -> Option<&Request> {
        self.ids.get(request_id).and_then(|&h| self.slab[h].as_ref())
    }

    pub fn has_unfinished(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_free_blocks: self.num_available_blocks(),
            num_total_blocks: self.blocks.num_total(),
            num_free_state_slots: self.slots.num_free(),
            num_total_state_slots: self.slots.num_total(),
            num_waiting: self.waiting.len() as u32,
            num_running: self.running.len() as u32,
            decode_step: self.decode_step,
            num_steps_in_flight: self.next_step_id - self.num_steps_updated,
            num_deferred_blocks: self.deferred.iter().map(|d| d.blocks.len() as u32).sum(),
            num_cached_blocks: self.cache.num_blocks(),
            num_state_snapshots: self.snapshots.num_held(),
            prefix_cache_queries: self.prefix_cache_queries,
            prefix_cache_hits: self.prefix_cache_hits,
            num_prefill_tokens: self.num_prefill_tokens,
        }
    }

    pub fn block_manager(&self) -> &BlockManager {
        &self.blocks
    }

    pub fn state_slot_manager(&self) -> &BlockManager {
        &self.slots
    }

    // ---- requests -------------------------------------------------------------------------

    #[allow(clippy::too_many_arguments)]
    pub fn add_request(
        &mut self,
        request_id: String,
        prompt: Vec<u32>,
        stop: StopRules,
        schedulable: bool,
        constrained: bool,
        priority: i32,
        tenant: String,
    ) -> Result<(), SchedulerError> {
        if self.config.engine_type == EngineType::Decode {
            return Err(SchedulerError::InvalidRequest(
                "a DECODE engine takes requests only through the P/D handoff".into(),
            ));
        }
        if self.ids.contains_key(&request_id) {
            return Err(SchedulerError::DuplicateRequest(request_id));
        }
        self.validate_tokens(&request_id, &prompt, stop.max_tokens)?;
        let mut req = Request::new(request_id.clone(), prompt, stop, self.next_arrival);
        req.schedulable = schedulable;
        req.constrained = constrained;
        req.priority = priority;
        req.tenant = tenant;
        self.next_arrival += 1;
        let handle = self.insert(req);
        self.enqueue(handle);
        Ok(())
    }

    /// A live request's place in the one order (`queue_order`), with its tenant's share now.
    fn order_of(&self, handle: usize) -> QueueOrder {
        let req = self.req(handle);
        req.order(self.shares.share(req.tenant_slot))
    }

    /// Puts a request into the waiting queue at its place in the one order (`queue_order`).
    fn enqueue(&mut self, handle: usize) {
        let key = self.order_of(handle);
        let at = insertion_point(self.waiting.iter().map(|&h| self.order_of(h)), key);
        self.waiting.insert(at, handle);
    }

    /// Re-sorts the waiting queue by the shares as they are now (stable: equals keep their places).
    /// Shares change only when a step is planned, which ends with this.
    fn sort_waiting(&mut self) {
        let mut waiting = std::mem::take(&mut self.waiting);
        waiting.make_contiguous().sort_by_cached_key(|&h| self.order_of(h));
        self.waiting = waiting;
    }

    /// The waiting queue's request ids, front first (`queue_order`).
    pub fn waiting_ids(&self) -> Vec<String> {
        self.waiting.iter().map(|&h| self.req(h).request_id.clone()).collect()
    }

    fn validate_tokens(&self, id: &str, prompt: &[u32], max_tokens: u32) -> Result<(), SchedulerError> {
        let invalid = |msg: String| Err(SchedulerError::InvalidRequest(format!("request {id}: {msg}")));
        if prompt.is_empty() {
            return invalid("the prompt is empty".into());
        }
        if max_tokens == 0 {
            return invalid("max_tokens must be at least 1".into());
        }
        let len = prompt.len() as u64;
        if len >= self.config.max_model_len as u64 {
            return invalid(format!(
                "the prompt has {len} tokens; max_model_len {} leaves no room to generate",
                self.config.max_model_len
            ));
        }
        let needed = Request::blocks_for(len as u32, self.config.block_size);
        if needed > self.blocks.num_total() {
            return invalid(format!(
                "the prompt needs {needed} blocks but the pool has {}",
                self.blocks.num_total()
            ));
        }
        if let Some(vocab_size) = self.config.vocab_size {
            if let Some(pos) = prompt.iter().position(|&t| t >= vocab_size) {
                return invalid(format!(
                    "token id {} at position {pos} is outside the vocabulary of {vocab_size}",
                    prompt[pos]
                ));
            }
        }
        Ok(())
    }

    fn insert(&mut self, mut req: Request) -> usize {
        req.incarnation = self.next_incarnation;
        self.next_incarnation += 1;
        req.tenant_slot = self.shares.join(&req.tenant);
        let id = req.request_id.clone();
        let handle = match self.free_handles.pop() {
            Some(h) => {
                self.slab[h] = Some(req);
                h
            }
            None => {
                self.slab.push(Some(req));
                self.slab.len() - 1
            }
        };
        self.ids.insert(id, handle);
        handle
    }

    fn req(&self, handle: usize) -> &Request {
        self.slab[handle].as_ref().expect("live handle")
    }

    fn req_mut(&mut self, handle: usize) -> &mut Request {
        self.slab[handle].as_mut().expect("live handle")
    }

    pub fn set_schedulable(&mut self, request_id: &str, schedulable: bool) -> Result<(), SchedulerError> {
        let &handle = self
            .ids
            .get(request_id)
            .ok_or_else(|| SchedulerError::UnknownRequest(request_id.to_string()))?;
        self.req_mut(handle).schedulable = schedulable;
        Ok(())
    }

    fn in_flight(&self, req: &Request) -> bool {
        req.last_step_id.is_some_and(|s| s >= self.num_steps_updated)
    }

    /// Gives back a request's blocks and state slot, now or when its in-flight step is updated.
    /// Returns the number of blocks whose release is deferred.
    fn release(&mut self, blocks: Vec<u32>, state_slot: Option<u32>, last_step: Option<u64>) -> u32 {
        match last_step.filter(|&s| s >= self.num_steps_updated) {
            Some(step) => {
                let num_deferred = blocks.len() as u32;
                self.deferred.push(DeferredFree { release_after: step, blocks, state_slot });
                num_deferred
            }
            None => {
                for block in blocks {
                    self.free_block(block);
                }
                if let Some(slot) = state_slot {
                    self.slots.free(slot).expect("a held state slot");
                }
                0
            }
        }
    }

    /// Removes a request from the scheduler and releases its resources exactly once.
    fn remove(&mut self, handle: usize, reason: FinishReason, stop_token_id: Option<u32>) -> (RequestUpdate, u32) {
        let mut req = self.slab[handle].take().expect("live handle");
        self.free_handles.push(handle);
        self.ids.remove(&req.request_id);
        self.shares.leave(req.tenant_slot);
        let blocks = std::mem::take(&mut req.block_table);
        let num_deferred = self.release(blocks, req.state_slot.take(), req.last_step_id);
        let output = RequestUpdate {
            request_id: req.request_id,
            token_ids: Vec::new(),
            finish_reason: Some(reason),
            stop_token_id,
            num_prompt_tokens: req.num_prompt_tokens,
            num_output_tokens: req.tokens.len() as u32 - req.num_prompt_tokens,
            num_cached_tokens: req.num_cached_tokens,
        };
        (output, num_deferred)
    }

    /// Aborts a request in any queue or phase. Returns its final output, or `None` when the id is
    /// unknown or already finished (abort is idempotent).
    pub fn abort(&mut self, request_id: &str) -> Option<RequestUpdate> {
        let handle = *self.ids.get(request_id)?;
        self.waiting.retain(|&h| h != handle);
        self.running.retain(|&h| h != handle);
        Some(self.remove(handle, FinishReason::Abort, None).0)
    }

    // ---- scheduling -----------------------------------------------------------------------

    /// A rank wants prefill when the first schedulable request of its queue (unready ones are
    /// skipped: the multimodal gate) exists and either its cache is at most 90% used or that request
    /// is a cut prompt, which holds all its blocks from its first chunk: its next chunk takes nothing,
    /// and the usage it holds must not keep it from finishing (a prompt whose reservation passed 90%
    /// would otherwise wait forever behind empty decode steps).
    pub fn wants_prefill(&self) -> bool {
        self.waiting.iter().find(|&&h| self.req(h).schedulable).is_some_and(|&h| {
            !self.req(h).block_table.is_empty() || self.block_usage() <= self.config.prefill_max_cache_usage
        })
    }

    /// Plans the next step. `collective` is the group's vote; one rank passes `SingleRank`.
    pub fn schedule(&mut self, collective: &mut dyn Collective) -> StepPlan {
        let step_id = self.next_step_id;
        self.next_step_id += 1;
        // Snapshot saves planned with the previous step come first (they are older than the copies queued
        // since): a restore planned now reads after them, and a slot reused since is written in order.
        self.next_plan_block_copies.append(&mut self.pending_block_copies);
        self.next_plan_state_copies.append(&mut self.pending_state_copies);
        std::mem::swap(&mut self.pending_block_copies, &mut self.next_plan_block_copies);
        std::mem::swap(&mut self.pending_state_copies, &mut self.next_plan_state_copies);
        let (kind, chosen, outputs) = if self.config.mixed() {
            self.schedule_mixed()
        } else {
            self.schedule_separate(collective)
        };
        // Decode steps since the last step with prompt work: the vote points count them (separate
        // steps; every rank of the group took the same kind of step, so every counter agrees).
        if kind == StepKind::Decode {
            self.decode_step += 1;
        } else {
            self.decode_step = 0;
        }
        let num_decode = chosen.iter().take_while(|s| !s.prompt).count();
        let mut plan = self.build_plan(step_id, kind, &chosen);
        plan.num_decode_requests = num_decode as u32;
        if !self.drafts_can_pay(self.running.len().max(chosen.len())) {
            plan.propose_drafts.fill(0);
        }
        self.pace_proposals(&chosen[..num_decode], &mut plan.propose_drafts[..num_decode]);
        plan.outputs = outputs;
        plan.block_copies = std::mem::take(&mut self.pending_block_copies);
        plan.state_copies = std::mem::take(&mut self.pending_state_copies);
        self.snapshots.unpin_all();
        self.shares.start_step();
        self.num_prefill_tokens += chosen.iter().filter(|s| s.prompt).map(|s| s.num_rows as u64).sum::<u64>();
        for s in &chosen {
            let req = self.slab[s.handle].as_mut().expect("live handle");
            req.num_inflight_tokens += s.num_rows;
            req.last_step_id = Some(step_id);
            self.shares.serve(req.tenant_slot, s.num_rows);
        }
        // The shares changed only here, so the queue stays in its order until the next step.
        self.sort_waiting();
        plan
    }

    /// DeepInfer's steps: a PROMPT engine prefills, a DECODE engine decodes, a NORMAL engine's vote
    /// picks one of the two.
    fn schedule_separate(&mut self, collective: &mut dyn Collective) -> (StepKind, Vec<Scheduled>, Vec<RequestUpdate>) {
        let prefill = match self.config.engine_type {
            EngineType::Prompt => Some(self.schedule_prefill(self.config.max_num_batched_tokens, true)),
            EngineType::Decode => None,
            EngineType::Normal => self.vote_for_prefill(collective),
        };
        match prefill {
            Some(chosen) => (StepKind::Prefill, chosen, Vec::new()),
            None => {
                let (chosen, outputs, _) = self.schedule_decode();
                (StepKind::Decode, chosen, outputs)
            }
        }
    }

    fn build_plan(&self, step_id: u64, kind: StepKind, chosen: &[Scheduled]) -> StepPlan {
        let mut builder = PlanBuilder::new(&self.config, step_id, kind);
        let mut inputs = Vec::new();
        for s in chosen {
            let req = self.req(s.handle);
            inputs.clear();
            if s.prompt {
                let start = req.next_position() as usize;
                inputs.extend_from_slice(&req.tokens[start..start + s.num_rows as usize]);
            } else {
                inputs.push(*req.tokens.last().expect("a request has tokens"));
                let num_drafts = s.num_rows as usize - 1;
                inputs.extend(req.draft_tokens.iter().take(num_drafts));
                inputs.resize(s.num_rows as usize, self.config.draft_pad_token_id);
            }
            builder.add((s.handle, req.incarnation), req, &inputs, s.num_sample_rows, s.prompt);
        }
        builder.finish()
    }

    // ---- invariants -----------------------------------------------------------------------

    /// Pool conservation and reference counts; an error names the first broken invariant.
    pub fn check_invariants(&self) -> Result<(), String> {
        let cache_blocks: Vec<u32> = self.cache.blocks().chain(self.snapshots.tail_blocks()).collect();
        crate::invariants::check_pools(
            &self.blocks,
            &self.slots,
            self.slab.iter().flatten().map(|r| (r.block_table.as_slice(), r.state_slot)),
            self.deferred
                .iter()
                .map(|d| (d.blocks.as_slice(), d.state_slot))
                .chain(std::iter::once((cache_blocks.as_slice(), None))),
        )?;
        self.cache.check(&self.blocks)?;
        self.snapshots.check()?;
        let num_live = self.slab.iter().flatten().count();
        if num_live != self.shares.num_live() as usize {
            return Err(format!("{num_live} live requests but {} in the tenants' accounts", self.shares.num_live()));
        }
        let orders: Vec<QueueOrder> = self.waiting.iter().map(|&h| self.order_of(h)).collect();
        if orders.windows(2).any(|w| w[0] > w[1]) {
            return Err("the waiting queue is out of its order".into());
        }
        if num_live != self.waiting.len() + self.running.len() || num_live != self.ids.len() {
            return Err(format!(
                "{num_live} live requests but {} waiting + {} running ({} ids)",
                self.waiting.len(),
                self.running.len(),
                self.ids.len()
            ));
        }
        Ok(())
    }
}
