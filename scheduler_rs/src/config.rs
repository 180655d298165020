//! Scheduler configuration: DeepInfer's policy numbers as defaults; the pool sizes and batch limits
//! (`Limits`) have none here. Their user-facing defaults are `EngineConfig`'s
//! (`services/engine/config.py`), and the engine passes every one.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineType {
    /// Prefill or decode per step, chosen by a vote of the data-parallel group.
    Normal,
    /// Prefill only (disaggregated prompt role); no vote.
    Prompt,
    /// Decode only (disaggregated decode role); no vote. Requests arrive through the P/D handoff.
    Decode,
}

/// How a NORMAL engine fills a step (PROMPT and DECODE engines run one phase, so always `Separate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheduling {
    /// DeepInfer's steps: prompt chunks or decode rows, never both; the data-parallel vote picks which.
    Separate,
    /// Every running request's decode rows (with their drafts) first, then prompt chunks from the
    /// waiting queue in its order, each cut to the tokens left of `max_num_batched_tokens`.
    Mixed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionMode {
    /// End the victim with finish reason `preempted` (DeepInfer's default).
    Stop,
    /// Free the victim's blocks and prefill it again later from its tokens.
    Recompute,
}

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub engine_type: EngineType,
    /// Tokens per paged block.
    pub block_size: u32,
    /// Paged pool size, including the null block 0.
    pub num_blocks: u32,
    /// State-slot pool size, including the null slot 0.
    pub num_state_slots: u32,
    /// Requests running or in prefill at once.
    pub max_num_seqs: u32,
    /// Rows per step: prompt tokens of a prefill step; decode rows plus prompt tokens of a mixed one.
    pub max_num_batched_tokens: u32,
    /// Prompt plus output tokens of one request.
    pub max_model_len: u32,
    /// Draft tokens a decode step may verify per request (all of them in fixed-length verification).
    pub nextn: u32,
    /// Variable-length verification: each decode step checks, per request, the prefix of its drafts
    /// that `MtpVarlen` chooses from the drafts' confidences and the step-cost curve
    /// (`Scheduler::set_step_cost`); off: every request checks `nextn` rows of drafts (pad rows before any).
    pub spec_varlen: bool,
    /// Sliding-window length; the ring adds `max(6, nextn + 1)` positions for rollback.
    pub window_size: u32,
    /// Compress ratios of the paged KV sources (V4.1 Flash: 2 and 1); each must divide the block.
    pub compress_ratios: Vec<u32>,
    pub preemption_mode: PreemptionMode,
    /// Separate or mixed steps (NORMAL engines only).
    pub scheduling: Scheduling,
    /// Decode steps between ALL vote points (DeepInfer: 70 with several ranks; 1 for one rank).
    pub prefill_attempt_interval: u32,
    /// Decode steps between ANY vote points (DeepInfer: 100 with several ranks; 1 for one rank).
    pub prefill_any_attempt_interval: u32,
    /// A rank wants prefill only while its block usage is at most this.
    pub prefill_max_cache_usage: f64,
    /// CUDA graph sizes are powers of two up to this, then multiples of it.
    pub cuda_graph_interval: u32,
    /// Token ids must be below this, when set.
    pub vocab_size: Option<u32>,
    /// Input token of a draft row before the draft model has proposed anything.
    pub draft_pad_token_id: u32,
    /// Prefix caching: full blocks stay cached by content hash after their requests end, and state
    /// snapshots let a request resume after a cached prefix (`prefix_cache`, `snapshots`).
    pub enable_prefix_caching: bool,
    /// State snapshots (prefix caching): extra state slots the worker holds after the request slots,
    /// worker ids `num_state_slots ..num_state_slots + num_state_snapshots`.
    pub num_state_snapshots: u32,
}

/// Rollback room in the window ring: DeepInfer clamps the backtracking allowance to at least 6.
pub const MIN_RING_SPARE: u32 = 6;

/// The pool sizes and batch limits, always given by the caller (no defaults in the scheduler).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub block_size: u32,
    pub num_blocks: u32,
    pub num_state_slots: u32,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    pub max_model_len: u32,
}

/// The sizes the Rust unit tests are written against.
#[cfg(test)]
pub const TEST_LIMITS: Limits = Limits {
    block_size: 128,
    num_blocks: 4096,
    num_state_slots: 257,
    max_num_seqs: 256,
    max_num_batched_tokens: 32_768,
    max_model_len: 1 << 20,
};

impl SchedulerConfig {
    /// `limits` with the policy defaults for `num_ranks` data-parallel ranks: one rank attempts prefill
    /// at every step, so a waiting prompt starts at the next step instead of up to 70 decode steps later.
    pub fn new(num_ranks: u32, limits: Limits) -> Self {
        let (all, any) = if num_ranks <= 1 { (1, 1) } else { (70, 100) };
        SchedulerConfig {
            engine_type: EngineType::Normal,
            block_size: limits.block_size,
            num_blocks: limits.num_blocks,
            num_state_slots: limits.num_state_slots,
            max_num_seqs: limits.max_num_seqs,
            max_num_batched_tokens: limits.max_num_batched_tokens,
            max_model_len: limits.max_model_len,
            nextn: 0,
            spec_varlen: false,
            window_size: 128,
            compress_ratios: vec![2, 1],
            preemption_mode: PreemptionMode::Stop,
            scheduling: Scheduling::Separate,
            prefill_attempt_interval: all,
            prefill_any_attempt_interval: any,
            prefill_max_cache_usage: 0.9,
            cuda_graph_interval: 8,
            vocab_size: None,
            draft_pad_token_id: 0,
            enable_prefix_caching: false,
            num_state_snapshots: 0,
        }
    }

    /// Window ring positions: window + max(6, nextn + 1).
    pub fn ring_size(&self) -> u32 {
        self.window_size + MIN_RING_SPARE.max(self.nextn + 1)
    }

    /// Rows of the largest decode step.
    pub fn max_decode_rows(&self) -> u32 {
        self.max_num_seqs * (1 + self.nextn)
    }

    /// Whether steps mix decode rows and prompt chunks: a NORMAL engine under `Scheduling::Mixed`.
    pub fn mixed(&self) -> bool {
        self.engine_type == EngineType::Normal && self.scheduling == Scheduling::Mixed
    }

    /// DECODE engines have no prefill to recompute with, and a grammar's state cannot be replayed.
    pub fn effective_preemption_mode(&self, constrained: bool) -> PreemptionMode {
        if self.engine_type == EngineType::Decode || constrained {
            PreemptionMode::Stop
        } else {
            self.preemption_mode
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("block_size", self.block_size),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
            ("prefill_attempt_interval", self.prefill_attempt_interval),
            ("prefill_any_attempt_interval", self.prefill_any_attempt_interval),
            ("cuda_graph_interval", self.cuda_graph_interval),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(format!("{name} must be positive"));
            }
        }
        if self.num_blocks < 2 || self.num_state_slots < 2 {
            return Err("num_blocks and num_state_slots must be at least 2 (id 0 is reserved)".into());
        }
        for &ratio in &self.compress_ratios {
            if ratio == 0 || !self.block_size.is_multiple_of(ratio) {
                return Err(format!(
                    "compress ratio {ratio} must be positive and divide block_size {}",
                    self.block_size
                ));
            }
        }
        if self.mixed() && self.max_num_batched_tokens < self.max_decode_rows() {
            return Err(format!(
                "mixed scheduling puts every decode row in the step's budget: max_num_batched_tokens {} is \
                 below max_num_seqs {} × (1 + nextn {}) = {}",
                self.max_num_batched_tokens,
                self.max_num_seqs,
                self.nextn,
                self.max_decode_rows()
            ));
        }
        if self.spec_varlen && self.nextn == 0 {
            return Err("spec_varlen needs drafts to verify (nextn > 0)".into());
        }
        if !(0.0..=1.0).contains(&self.prefill_max_cache_usage) {
            return Err("prefill_max_cache_usage must be in [0, 1]".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_of_134_for_nextn_up_to_5() {
        let mut config = SchedulerConfig::new(1, TEST_LIMITS);
        assert_eq!(config.ring_size(), 134);
        config.nextn = 5;
        assert_eq!(config.ring_size(), 134);
        config.nextn = 7;
        assert_eq!(config.ring_size(), 136);
        assert_eq!(2004 % 134, 128);
    }

    #[test]
    fn vote_intervals_depend_on_the_number_of_ranks() {
        assert_eq!(SchedulerConfig::new(1, TEST_LIMITS).prefill_attempt_interval, 1);
        let multi = SchedulerConfig::new(8, TEST_LIMITS);
        assert_eq!((multi.prefill_attempt_interval, multi.prefill_any_attempt_interval), (70, 100));
    }

    #[test]
    fn decode_engines_and_grammars_always_stop() {
        let mut config = SchedulerConfig::new(1, TEST_LIMITS);
        config.preemption_mode = PreemptionMode::Recompute;
        assert_eq!(config.effective_preemption_mode(false), PreemptionMode::Recompute);
        assert_eq!(config.effective_preemption_mode(true), PreemptionMode::Stop);
        config.engine_type = EngineType::Decode;
        assert_eq!(config.effective_preemption_mode(false), PreemptionMode::Stop);
    }

    #[test]
    fn rejects_a_ratio_that_does_not_divide_the_block() {
        let mut config = SchedulerConfig::new(1, TEST_LIMITS);
        config.compress_ratios = vec![3];
        assert!(config.validate().unwrap_err().contains("compress ratio 3"));
    }
}
