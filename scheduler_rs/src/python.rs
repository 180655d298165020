//! The Python binding: every PyO3 type lives here, as a wrapper over a core type with `From`
//! conversions. The core modules know nothing of Python.

use std::ffi::{c_int, c_void};
use std::ptr;

use pyo3::exceptions::{PyBufferError, PyKeyError, PyRuntimeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

use crate::block_manager::BlockManager as CoreBlockManager;
use crate::config::{
    EngineType as CoreEngineType, Limits, PreemptionMode as CorePreemptionMode, SchedulerConfig as CoreConfig,
    Scheduling as CoreScheduling,
};
use crate::errors::SchedulerError;
use crate::request::{FinishReason as CoreFinishReason, Request, Status, StopRules};
use crate::scheduler::{Collective, Scheduler as CoreScheduler, SchedulerStats as CoreStats, VoteOp};
use crate::step::{self, RequestUpdate as CoreUpdate, StepKind, StepPlan as CorePlan, StepResult as CoreResult};
use crate::varlen::{MtpVarlen as CoreVarlen, VarlenChoice};

impl From<SchedulerError> for PyErr {
    fn from(err: SchedulerError) -> PyErr {
        let message = err.to_string();
        match err {
            SchedulerError::UnknownRequest(_) => PyKeyError::new_err(message),
            SchedulerError::InvalidState(_) => PyRuntimeError::new_err(message),
            _ => PyValueError::new_err(message),
        }
    }
}

// ---- enums --------------------------------------------------------------------------------

/// Why a request ended; `.value` is the string the protos and the HTTP API use.
#[pyclass(eq, eq_int, frozen, hash, from_py_object, module = "scheduler_rs._core")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    #[pyo3(name = "STOP")]
    Stop,
    #[pyo3(name = "LENGTH")]
    Length,
    #[pyo3(name = "ABORT")]
    Abort,
    #[pyo3(name = "PREEMPTED")]
    Preempted,
    #[pyo3(name = "ERROR")]
    Error,
}

impl From<CoreFinishReason> for FinishReason {
    fn from(r: CoreFinishReason) -> Self {
        match r {
            CoreFinishReason::Stop => FinishReason::Stop,
            CoreFinishReason::Length => FinishReason::Length,
            CoreFinishReason::Abort => FinishReason::Abort,
            CoreFinishReason::Preempted => FinishReason::Preempted,
            CoreFinishReason::Error => FinishReason::Error,
        }
    }
}

impl From<FinishReason> for CoreFinishReason {
    fn from(r: FinishReason) -> Self {
        match r {
            FinishReason::Stop => CoreFinishReason::Stop,
            FinishReason::Length => CoreFinishReason::Length,
            FinishReason::Abort => CoreFinishReason::Abort,
            FinishReason::Preempted => CoreFinishReason::Preempted,
            FinishReason::Error => CoreFinishReason::Error,
        }
    }
}

#[pymethods]
impl FinishReason {
    #[getter]
    fn value(&self) -> &'static str {
        CoreFinishReason::from(*self).as_str()
    }

    fn __str__(&self) -> &'static str {
        self.value()
    }
}

#[pyclass(eq, eq_int, frozen, hash, from_py_object, module = "scheduler_rs._core")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineType {
    #[pyo3(name = "NORMAL")]
    Normal,
    #[pyo3(name = "PROMPT")]
    Prompt,
    #[pyo3(name = "DECODE")]
    Decode,
}

impl From<EngineType> for CoreEngineType {
    fn from(t: EngineType) -> Self {
        match t {
            EngineType::Normal => CoreEngineType::Normal,
            EngineType::Prompt => CoreEngineType::Prompt,
            EngineType::Decode => CoreEngineType::Decode,
        }
    }
}

impl From<CoreEngineType> for EngineType {
    fn from(t: CoreEngineType) -> Self {
        match t {
            CoreEngineType::Normal => EngineType::Normal,
            CoreEngineType::Prompt => EngineType::Prompt,
            CoreEngineType::Decode => EngineType::Decode,
        }
    }
}

#[pyclass(eq, eq_int, frozen, hash, from_py_object, module = "scheduler_rs._core")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum PreemptionMode {
    #[pyo3(name = "STOP")]
    Stop,
    #[pyo3(name = "RECOMPUTE")]
    Recompute,
}

impl From<PreemptionMode> for CorePreemptionMode {
    fn from(m: PreemptionMode) -> Self {
        match m {
            PreemptionMode::Stop => CorePreemptionMode::Stop,
            PreemptionMode::Recompute => CorePreemptionMode::Recompute,
        }
    }
}

impl From<CorePreemptionMode> for PreemptionMode {
    fn from(m: CorePreemptionMode) -> Self {
        match m {
            CorePreemptionMode::Stop => PreemptionMode::Stop,
            CorePreemptionMode::Recompute => PreemptionMode::Recompute,
        }
    }
}

#[pyclass(eq, eq_int, frozen, hash, from_py_object, module = "scheduler_rs._core")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scheduling {
    #[pyo3(name = "SEPARATE")]
    Separate,
    #[pyo3(name = "MIXED")]
    Mixed,
}

impl From<Scheduling> for CoreScheduling {
    fn from(m: Scheduling) -> Self {
        match m {
            Scheduling::Separate => CoreScheduling::Separate,
            Scheduling::Mixed => CoreScheduling::Mixed,
        }
    }
}

impl From<CoreScheduling> for Scheduling {
    fn from(m: CoreScheduling) -> Self {
        match m {
            CoreScheduling::Separate => Scheduling::Separate,
            CoreScheduling::Mixed => Scheduling::Mixed,
        }
    }
}

// ---- flat arrays --------------------------------------------------------------------------

/// A read-only int32 vector exposing the buffer protocol (`numpy.frombuffer`, `torch.frombuffer`,
/// `memoryview`) without a copy.
#[pyclass(frozen, module = "scheduler_rs._core")]
pub struct Int32Array {
    data: Vec<i32>,
    /// The buffer's shape points here; it must live as long as the object.
    shape: [isize; 1],
}

impl From<Vec<i32>> for Int32Array {
    fn from(data: Vec<i32>) -> Self {
        let shape = [data.len() as isize];
        Int32Array { data, shape }
    }
}

#[pymethods]
impl Int32Array {
    fn __len__(&self) -> usize {
        self.data.len()
    }

    fn __getitem__(&self, index: isize) -> PyResult<i32> {
        let n = self.data.len() as isize;
        let i = if index < 0 { index + n } else { index };
        if i < 0 || i >= n {
            return Err(pyo3::exceptions::PyIndexError::new_err("Int32Array index out of range"));
        }
        Ok(self.data[i as usize])
    }

    fn tolist(&self) -> Vec<i32> {
        self.data.clone()
    }

    fn __repr__(&self) -> String {
        format!("Int32Array({:?})", self.data)
    }

    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("view is null"));
        }
        if (flags & ffi::PyBUF_WRITABLE) == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err("Int32Array is read-only"));
        }
        let this = slf.get();
        // SAFETY: `view` is non-null and owned by the caller; `obj` keeps `this` (and so `data` and
        // `shape`, which a frozen object never moves or changes) alive until the view is released.
        unsafe {
            (*view).buf = this.data.as_ptr() as *mut c_void;
            (*view).len = (this.data.len() * 4) as isize;
            (*view).readonly = 1;
            (*view).itemsize = 4;
            (*view).format = if (flags & ffi::PyBUF_FORMAT) == ffi::PyBUF_FORMAT {
                c"i".as_ptr() as *mut _
            } else {
                ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape = if (flags & ffi::PyBUF_ND) == ffi::PyBUF_ND {
                this.shape.as_ptr() as *mut isize
            } else {
                ptr::null_mut()
            };
            (*view).strides = if (flags & ffi::PyBUF_STRIDES) == ffi::PyBUF_STRIDES {
                &mut (*view).itemsize
            } else {
                ptr::null_mut()
            };
            (*view).suboffsets = ptr::null_mut();
            (*view).internal = ptr::null_mut();
            (*view).obj = slf.into_any().into_ptr();
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

fn array(py: Python<'_>, data: &[i32]) -> PyResult<Py<Int32Array>> {
    Py::new(py, Int32Array::from(data.to_vec()))
}

// ---- config -------------------------------------------------------------------------------

/// Scheduler configuration; see the stub for every field. Defaults are DeepInfer's, with the vote
/// intervals set by `num_ranks`.
#[pyclass(frozen, skip_from_py_object, module = "scheduler_rs._core")]
#[derive(Clone)]
pub struct SchedulerConfig {
    inner: CoreConfig,
}

#[pymethods]
impl SchedulerConfig {
    #[new]
    // The six sizes are required: their user-facing defaults are `EngineConfig`'s.
    #[pyo3(signature = (*, block_size, num_blocks, num_state_slots, max_num_seqs, max_num_batched_tokens,
        max_model_len, num_ranks=1, engine_type=EngineType::Normal, nextn=0, window_size=128, compress_ratios=vec![2, 1], preemption_mode=PreemptionMode::Stop,
        scheduling=Scheduling::Separate, prefill_attempt_interval=None, prefill_any_attempt_interval=None, prefill_max_cache_usage=0.9,
        cuda_graph_interval=8, vocab_size=None, draft_pad_token_id=0, spec_varlen=false, enable_prefix_caching=false,
        num_state_snapshots=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        block_size: u32,
        num_blocks: u32,
        num_state_slots: u32,
        max_num_seqs: u32,
        max_num_batched_tokens: u32,
        max_model_len: u32,
        num_ranks: u32,
        engine_type: EngineType,
        nextn: u32,
        window_size: u32,
        compress_ratios: Vec<u32>,
        preemption_mode: PreemptionMode,
        scheduling: Scheduling,
        prefill_attempt_interval: Option<u32>,
        prefill_any_attempt_interval: Option<u32>,
        prefill_max_cache_usage: f64,
        cuda_graph_interval: u32,
        vocab_size: Option<u32>,
        draft_pad_token_id: u32,
        spec_varlen: bool,
        enable_prefix_caching: bool,
        num_state_snapshots: u32,
    ) -> PyResult<Self> {
        let limits = Limits {
            block_size,
            num_blocks,
            num_state_slots,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
        };
        let mut c = CoreConfig::new(num_ranks, limits);
        c.engine_type = engine_type.into();
        c.nextn = nextn;
        c.window_size = window_size;
        c.compress_ratios = compress_ratios;
        c.preemption_mode = preemption_mode.into();
        c.scheduling = scheduling.into();
        c.prefill_attempt_interval = prefill_attempt_interval.unwrap_or(c.prefill_attempt_interval);
        c.prefill_any_attempt_interval = prefill_any_attempt_interval.unwrap_or(c.prefill_any_attempt_interval);
        c.prefill_max_cache_usage = prefill_max_cache_usage;
        c.cuda_graph_interval = cuda_graph_interval;
        c.vocab_size = vocab_size;
        c.draft_pad_token_id = draft_pad_token_id;
        c.spec_varlen = spec_varlen;
        c.enable_prefix_caching = enable_prefix_caching;
        c.num_state_snapshots = num_state_snapshots;
        c.validate().map_err(SchedulerError::InvalidConfig)?;
        Ok(SchedulerConfig { inner: c })
    }

    #[getter]
    fn engine_type(&self) -> EngineType {
        self.inner.engine_type.into()
    }
    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.block_size
    }
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.num_blocks
    }
    #[getter]
    fn num_state_slots(&self) -> u32 {
        self.inner.num_state_slots
    }
    #[getter]
    fn max_num_seqs(&self) -> u32 {
        self.inner.max_num_seqs
    }
    #[getter]
    fn max_num_batched_tokens(&self) -> u32 {
        self.inner.max_num_batched_tokens
    }
    #[getter]
    fn max_model_len(&self) -> u32 {
        self.inner.max_model_len
    }
    #[getter]
    fn nextn(&self) -> u32 {
        self.inner.nextn
    }
    #[getter]
    fn window_size(&self) -> u32 {
        self.inner.window_size
    }
    #[getter]
    fn compress_ratios(&self) -> Vec<u32> {
        self.inner.compress_ratios.clone()
    }
    #[getter]
    fn preemption_mode(&self) -> PreemptionMode {
        self.inner.preemption_mode.into()
    }
    #[getter]
    fn scheduling(&self) -> Scheduling {
        self.inner.scheduling.into()
    }
    #[getter]
    fn prefill_attempt_interval(&self) -> u32 {
        self.inner.prefill_attempt_interval
    }
    #[getter]
    fn prefill_any_attempt_interval(&self) -> u32 {
        self.inner.prefill_any_attempt_interval
    }
    #[getter]
    fn prefill_max_cache_usage(&self) -> f64 {
        self.inner.prefill_max_cache_usage
    }
    #[getter]
    fn cuda_graph_interval(&self) -> u32 {
        self.inner.cuda_graph_interval
    }
    #[getter]
    fn vocab_size(&self) -> Option<u32> {
        self.inner.vocab_size
    }
    #[getter]
    fn spec_varlen(&self) -> bool {
        self.inner.spec_varlen
    }
    #[getter]
    fn draft_pad_token_id(&self) -> u32 {
        self.inner.draft_pad_token_id
    }
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.enable_prefix_caching
    }
    #[getter]
    fn num_state_snapshots(&self) -> u32 {
        self.inner.num_state_snapshots
    }
    #[getter]
    fn ring_size(&self) -> u32 {
        self.inner.ring_size()
    }
    /// CUDA graph sizes this config captures.
    #[getter]
    fn graph_sizes(&self) -> Vec<u32> {
        step::graph_sizes(self.inner.max_decode_rows(), self.inner.cuda_graph_interval)
    }
}

// ---- block manager ------------------------------------------------------------------------

/// A free list with reference counts; id 0 is never handed out.
#[pyclass(module = "scheduler_rs._core")]
pub struct BlockManager {
    inner: CoreBlockManager,
}

impl From<CoreBlockManager> for BlockManager {
    fn from(inner: CoreBlockManager) -> Self {
        BlockManager { inner }
    }
}

#[pymethods]
impl BlockManager {
    #[new]
    fn new(num_ids: u32) -> Self {
        CoreBlockManager::new("block", num_ids).into()
    }
    #[getter]
    fn num_total(&self) -> u32 {
        self.inner.num_total()
    }
    #[getter]
    fn num_free(&self) -> u32 {
        self.inner.num_free()
    }
    fn allocate(&mut self) -> Option<u32> {
        self.inner.allocate()
    }
    fn free(&mut self, block_id: u32) -> PyResult<()> {
        self.inner.free(block_id).map_err(|e| PyValueError::new_err(e.to_string()))
    }
    fn incref(&mut self, block_id: u32) -> PyResult<()> {
        self.inner.incref(block_id).map_err(|e| PyValueError::new_err(e.to_string()))
    }
    fn ref_count(&self, block_id: u32) -> u32 {
        self.inner.ref_count(block_id)
    }
    fn free_ids(&self) -> Vec<u32> {
        self.inner.free_ids()
    }
}

// ---- plans, results, outputs --------------------------------------------------------------

/// One step for the worker; arrays are `Int32Array`s (buffer protocol).
#[pyclass(frozen, module = "scheduler_rs._core")]
pub struct StepPlan {
    inner: CorePlan,
}

impl From<CorePlan> for StepPlan {
    fn from(inner: CorePlan) -> Self {
        StepPlan { inner }
    }
}

#[pymethods]
impl StepPlan {
    #[getter]
    fn step_id(&self) -> u64 {
        self.inner.step_id
    }
    /// "prefill", "decode" or "mixed".
    #[getter]
    fn kind(&self) -> &'static str {
        match self.inner.kind {
            StepKind::Prefill => "prefill",
            StepKind::Decode => "decode",
            StepKind::Mixed => "mixed",
        }
    }
    #[getter]
    fn num_decode_requests(&self) -> u32 {
        self.inner.num_decode_requests
    }
    #[getter]
    fn is_prefill(&self) -> bool {
        self.inner.kind == StepKind::Prefill
    }
    #[getter]
    fn is_placeholder(&self) -> bool {
        self.inner.is_placeholder
    }
    #[getter]
    fn num_requests(&self) -> usize {
        self.inner.num_requests()
    }
    #[getter]
    fn num_rows(&self) -> usize {
        self.inner.num_rows()
    }
    #[getter]
    fn request_ids(&self) -> Vec<String> {
        self.inner.request_ids.clone()
    }
    #[getter]
    fn seqlens_q(&self, py: Python<'_>) -> PyResult<Py<Int32Array>> {
        array(py, &self.inner.seqlens_q)
    }
    #[getter]
    fn seqlens_k(&self, py: Python<'_>) -> PyResult<Py<Int32Array>> {
        array(py, &self.inner.seqlens_k)
    }
    #[getter]
    fn query_start(&self, py: Python<'_>) -> PyResult<Py<Int32Array>> {
        array(py, &self.inner.query_start)
    }
    #[getter]
    fn state_slots(&self, py: Python<'_>) -> PyResult<Py<Int32Array>> {
        array(py, &self.inner.state_slots)
    }
    #[getter]
    fn block_tables(&self, py: Python<'_>) -> PyResult<Py<Int32Array>> {
        array(py, &self.inner.block_tables)
    }
    #[getter]
    fn block_table_width(&self) -> u32 {
        self.inner.block_table_width
    }
    #[getter]
    fn inputs_pending(&self, py: Python<'_>) -> PyResult<Py<Int32Array>> {
        array(py, &self.inner.inputs_pending)
    }
    #[getter]
    fn input_ids(&self, py: Python<'_>) -> PyResult<Py<Int32Array>> {
        array(py, &self.inner.input_ids)
    }
    #[getter]
    fn positions(&self, py: Python<'_>) -> PyResult<Py<Int32Array>> {
        array(py, &self.inner.positions)
    }
    #[getter]
    fn ring_slots(&self, py: Python<'_>) -> PyResult<Py<Int32Array>> {
        array(py, &self.inner.ring_slots)
    }
    #[getter]
    fn row_requests(&self, py: Python<'_>) -> PyResult<Py<Int32Array>> {
        array(py, &self.inner.row_requests)
    }
    #[getter]
    fn sample_rows(&self, py: Python<'_>) -> PyResult<Py<Int32Array>> {
        array(py, &self.inner.sample_rows)
    }
    #[getter]
    fn num_sample_rows(&self, py: Python<'_>) -> PyResult<Py<Int32Array>> {
        array(py, &self.inner.num_sample_rows)
    }
    #[getter]
    fn propose_drafts(&self, py: Python<'_>) -> PyResult<Py<Int32Array>> {
        array(py, &self.inner.propose_drafts)
    }
    /// Compress ratios with entry writes, in config order.
    #[getter]
    fn entry_ratios(&self) -> Vec<u32> {
        self.inner.entry_writes.iter().map(|w| w.ratio).collect()
    }
    /// (rows, slots) of the compressed entries of `ratio` this step writes.
    fn entry_writes(&self, py: Python<'_>, ratio: u32) -> PyResult<(Py<Int32Array>, Py<Int32Array>)> {
        let writes = self
            .inner
            .entry_writes
            .iter()
            .find(|w| w.ratio == ratio)
            .ok_or_else(|| PyValueError::new_err(format!("no KV source with compress ratio {ratio}")))?;
        Ok((array(py, &writes.rows)?, array(py, &writes.slots)?))
    }
    #[getter]
    fn graph_size(&self) -> Option<u32> {
        self.inner.graph_size
    }
    #[getter]
    fn num_padding_rows(&self) -> u32 {
        self.inner.num_padding_rows
    }
    #[getter]
    fn block_copies(&self) -> Vec<(u32, u32)> {
        self.inner.block_copies.clone()
    }
    #[getter]
    fn state_copies(&self) -> Vec<(u32, u32)> {
        self.inner.state_copies.clone()
    }
    /// Final outputs decided while scheduling (preemption in `stop` mode).
    #[getter]
    fn outputs(&self) -> Vec<RequestUpdate> {
        self.inner.outputs.iter().cloned().map(RequestUpdate::from).collect()
    }
    fn __repr__(&self) -> String {
        format!(
            "StepPlan(step_id={}, kind={}, num_requests={}, num_rows={}, graph_size={:?})",
            self.inner.step_id,
            self.kind(),
            self.inner.num_requests(),
            self.inner.num_rows(),
            self.inner.graph_size
        )
    }
}

/// What a step produced, per planned request in plan order.
#[pyclass(frozen, module = "scheduler_rs._core")]
pub struct StepResult {
    inner: CoreResult,
}

impl From<CoreResult> for StepResult {
    fn from(inner: CoreResult) -> Self {
        StepResult { inner }
    }
}

#[pymethods]
impl StepResult {
    #[new]
    #[pyo3(signature = (num_tokens, token_ids, num_draft_tokens=None, draft_token_ids=None, errors=None,
        draft_confidences=None))]
    fn new(
        num_tokens: Vec<u32>,
        token_ids: Vec<u32>,
        num_draft_tokens: Option<Vec<u32>>,
        draft_token_ids: Option<Vec<u32>>,
        errors: Option<Vec<u32>>,
        draft_confidences: Option<Vec<f64>>,
    ) -> Self {
        CoreResult {
            num_tokens,
            token_ids,
            num_draft_tokens: num_draft_tokens.unwrap_or_default(),
            draft_token_ids: draft_token_ids.unwrap_or_default(),
            draft_confidences: draft_confidences.unwrap_or_default(),
            errors: errors.unwrap_or_default(),
        }
        .into()
    }
    #[getter]
    fn num_tokens(&self) -> Vec<u32> {
        self.inner.num_tokens.clone()
    }
    #[getter]
    fn token_ids(&self) -> Vec<u32> {
        self.inner.token_ids.clone()
    }
    #[getter]
    fn num_draft_tokens(&self) -> Vec<u32> {
        self.inner.num_draft_tokens.clone()
    }
    #[getter]
    fn draft_token_ids(&self) -> Vec<u32> {
        self.inner.draft_token_ids.clone()
    }
    #[getter]
    fn draft_confidences(&self) -> Vec<f64> {
        self.inner.draft_confidences.clone()
    }
    #[getter]
    fn errors(&self) -> Vec<u32> {
        self.inner.errors.clone()
    }
}

#[pyclass(frozen, get_all, module = "scheduler_rs._core")]
pub struct RequestUpdate {
    request_id: String,
    token_ids: Vec<u32>,
    finish_reason: Option<FinishReason>,
    stop_token_id: Option<u32>,
    num_prompt_tokens: u32,
    num_output_tokens: u32,
    num_cached_tokens: u32,
}

impl From<CoreUpdate> for RequestUpdate {
    fn from(o: CoreUpdate) -> Self {
        RequestUpdate {
            request_id: o.request_id,
            token_ids: o.token_ids,
            finish_reason: o.finish_reason.map(Into::into),
            stop_token_id: o.stop_token_id,
            num_prompt_tokens: o.num_prompt_tokens,
            num_output_tokens: o.num_output_tokens,
            num_cached_tokens: o.num_cached_tokens,
        }
    }
}

#[pymethods]
impl RequestUpdate {
    #[getter]
    fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }
    fn __repr__(&self) -> String {
        format!(
            "RequestUpdate(request_id={:?}, token_ids={:?}, finish_reason={:?})",
            self.request_id,
            self.token_ids,
            self.finish_reason.map(|r| CoreFinishReason::from(r).as_str())
        )
    }
}

#[pyclass(frozen, get_all, module = "scheduler_rs._core")]
pub struct SchedulerStats {
    num_free_blocks: u32,
    num_total_blocks: u32,
    num_free_state_slots: u32,
    num_total_state_slots: u32,
    num_waiting: u32,
    num_running: u32,
    decode_step: u64,
    num_steps_in_flight: u64,
    num_deferred_blocks: u32,
    num_cached_blocks: u32,
    num_state_snapshots: u32,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    num_prefill_tokens: u64,
}

impl From<CoreStats> for SchedulerStats {
    fn from(s: CoreStats) -> Self {
        SchedulerStats {
            num_free_blocks: s.num_free_blocks,
            num_total_blocks: s.num_total_blocks,
            num_free_state_slots: s.num_free_state_slots,
            num_total_state_slots: s.num_total_state_slots,
            num_waiting: s.num_waiting,
            num_running: s.num_running,
            decode_step: s.decode_step,
            num_steps_in_flight: s.num_steps_in_flight,
            num_deferred_blocks: s.num_deferred_blocks,
            num_cached_blocks: s.num_cached_blocks,
            num_state_snapshots: s.num_state_snapshots,
            prefix_cache_queries: s.prefix_cache_queries,
            prefix_cache_hits: s.prefix_cache_hits,
            num_prefill_tokens: s.num_prefill_tokens,
        }
    }
}

/// A snapshot of one live request.
#[pyclass(frozen, get_all, module = "scheduler_rs._core")]
pub struct RequestState {
    request_id: String,
    token_ids: Vec<u32>,
    num_prompt_tokens: u32,
    num_computed_tokens: u32,
    num_inflight_tokens: u32,
    draft_token_ids: Vec<u32>,
    block_table: Vec<u32>,
    state_slot: Option<u32>,
    /// "waiting" or "running".
    status: &'static str,
    schedulable: bool,
    num_preemptions: u32,
    priority: i32,
    tenant: String,
    num_cached_tokens: u32,
}

impl From<&Request> for RequestState {
    fn from(r: &Request) -> Self {
        RequestState {
            request_id: r.request_id.clone(),
            token_ids: r.tokens.clone(),
            num_prompt_tokens: r.num_prompt_tokens,
            num_computed_tokens: r.num_computed_tokens,
            num_inflight_tokens: r.num_inflight_tokens,
            draft_token_ids: r.draft_tokens.clone(),
            block_table: r.block_table.clone(),
            state_slot: r.state_slot,
            status: match r.status {
                Status::Waiting => "waiting",
                Status::Running => "running",
                Status::Finished(_) => "finished",
            },
            schedulable: r.schedulable,
            num_preemptions: r.num_preemptions,
            priority: r.priority,
            tenant: r.tenant.clone(),
            num_cached_tokens: r.num_cached_tokens,
        }
    }
}

// ---- scheduler ----------------------------------------------------------------------------

/// Calls the Python vote `vote(value: bool, op: "all" | "any") -> bool`, keeping its first error.
struct PyCollective<'py> {
    py: Python<'py>,
    vote: Option<&'py Py<PyAny>>,
    error: Option<PyErr>,
}

impl Collective for PyCollective<'_> {
    fn vote(&mut self, value: bool, op: VoteOp) -> bool {
        let (Some(vote), None) = (self.vote, &self.error) else { return value };
        let op = match op {
            VoteOp::All => "all",
            VoteOp::Any => "any",
        };
        match vote.bind(self.py).call1((value, op)).and_then(|r| r.extract::<bool>()) {
            Ok(v) => v,
            Err(e) => {
                self.error = Some(e);
                false
            }
        }
    }
}

#[pyclass(module = "scheduler_rs._core")]
pub struct Scheduler {
    inner: CoreScheduler,
    vote: Option<Py<PyAny>>,
}

#[pymethods]
impl Scheduler {
    #[new]
    #[pyo3(signature = (config, vote=None))]
    fn new(config: &SchedulerConfig, vote: Option<Py<PyAny>>) -> PyResult<Self> {
        Ok(Scheduler { inner: CoreScheduler::new(config.inner.clone())?, vote })
    }

    #[getter]
    fn config(&self) -> SchedulerConfig {
        SchedulerConfig { inner: self.inner.config().clone() }
    }

    #[pyo3(signature = (request_id, prompt_token_ids, *, max_tokens, eos_token_id=None, ignore_eos=false,
        stop_token_ids=Vec::new(), schedulable=true, constrained=false, priority=0, tenant=String::new()))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        request_id: String,
        prompt_token_ids: Vec<u32>,
        max_tokens: u32,
        eos_token_id: Option<u32>,
        ignore_eos: bool,
        stop_token_ids: Vec<u32>,
        schedulable: bool,
        constrained: bool,
        priority: i32,
        tenant: String,
    ) -> PyResult<()> {
        let stop = StopRules { max_tokens, eos_token_id, ignore_eos, stop_token_ids };
        Ok(self.inner.add_request(request_id, prompt_token_ids, stop, schedulable, constrained, priority, tenant)?)
    }

    #[pyo3(signature = (request_id, schedulable=true))]
    fn set_schedulable(&mut self, request_id: &str, schedulable: bool) -> PyResult<()> {
        Ok(self.inner.set_schedulable(request_id, schedulable)?)
    }

    /// The group's work-left vote found no rank with work: the next schedule() votes at an ANY point.
    fn mark_group_idle(&mut self) {
        self.inner.mark_group_idle();
    }

    fn schedule(&mut self, py: Python<'_>) -> PyResult<StepPlan> {
        let mut collective = PyCollective { py, vote: self.vote.as_ref(), error: None };
        let plan = self.inner.schedule(&mut collective);
        match collective.error {
            Some(err) => Err(err),
            None => Ok(plan.into()),
        }
    }

    fn update(&mut self, plan: &StepPlan, result: &StepResult) -> PyResult<Vec<RequestUpdate>> {
        let outputs = self.inner.update(&plan.inner, &result.inner)?;
        Ok(outputs.into_iter().map(RequestUpdate::from).collect())
    }

    fn abort(&mut self, request_id: &str) -> Option<RequestUpdate> {
        self.inner.abort(request_id).map(RequestUpdate::from)
    }

    #[pyo3(signature = (parent_id, child_id, *, max_tokens, eos_token_id=None, ignore_eos=false,
        stop_token_ids=Vec::new()))]
    fn fork(
        &mut self,
        parent_id: &str,
        child_id: String,
        max_tokens: u32,
        eos_token_id: Option<u32>,
        ignore_eos: bool,
        stop_token_ids: Vec<u32>,
    ) -> PyResult<()> {
        let stop = StopRules { max_tokens, eos_token_id, ignore_eos, stop_token_ids };
        Ok(self.inner.fork(parent_id, child_id, stop)?)
    }

    /// Varlen verification's step-cost curve: rows → step milliseconds, plus the sampler's per step.
    /// `measured`: measured (or given), not a guess; only such a curve stops the draft from proposing.
    #[pyo3(signature = (step_cost_ms, sampler_ms=0.0, measured=true))]
    fn set_step_cost(
        &mut self,
        step_cost_ms: std::collections::BTreeMap<u32, f64>,
        sampler_ms: f64,
        measured: bool,
    ) -> PyResult<()> {
        Ok(self.inner.set_step_cost(step_cost_ms.into_iter().collect(), sampler_ms, measured)?)
    }

    fn request(&self, request_id: &str) -> Option<RequestState> {
        self.inner.request(request_id).map(RequestState::from)
    }

    fn stats(&self) -> SchedulerStats {
        self.inner.stats().into()
    }

    fn wants_prefill(&self) -> bool {
        self.inner.wants_prefill()
    }

    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }

    /// Prefix caching: a waiting request's hash chain root and full-block hashes, image spans (start,
    /// positions) and whether it may resume from the cache; before its prefill starts.
    #[pyo3(signature = (request_id, root, block_hashes, image_spans=Vec::new(), lookup=true))]
    fn set_block_hashes(
        &mut self,
        request_id: &str,
        root: u64,
        block_hashes: Vec<u64>,
        image_spans: Vec<(u32, u32)>,
        lookup: bool,
    ) -> PyResult<()> {
        Ok(self.inner.set_block_hashes(request_id, root, block_hashes, image_spans, lookup)?)
    }

    /// The hashes of the blocks a request's output filled since the last call.
    fn add_block_hashes(&mut self, request_id: &str, block_hashes: Vec<u64>) -> PyResult<()> {
        Ok(self.inner.add_block_hashes(request_id, &block_hashes)?)
    }

    /// (stored, removed, cleared): the blocks that entered and left the prefix cache since the last call.
    fn take_kv_events(&mut self) -> (Vec<u64>, Vec<u64>, bool) {
        let e = self.inner.take_kv_events();
        (e.stored, e.removed, e.cleared)
    }

    /// Drops every snapshot and the cache's hold on every cached block.
    fn clear_prefix_cache(&mut self) {
        self.inner.clear_prefix_cache();
    }

    fn block_ref_count(&self, block_id: u32) -> u32 {
        self.inner.block_manager().ref_count(block_id)
    }

    /// Raises AssertionError naming the first broken pool or queue invariant.
    fn check_invariants(&self) -> PyResult<()> {
        self.inner
            .check_invariants()
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }
}

// ---- varlen and graph sizes ---------------------------------------------------------------

#[pyclass(frozen, get_all, module = "scheduler_rs._core")]
pub struct VarlenPlan {
    num_rows: u32,
    num_drafts: Vec<u32>,
    tokens_per_ms: f64,
}

impl From<VarlenChoice> for VarlenPlan {
    fn from(c: VarlenChoice) -> Self {
        VarlenPlan { num_rows: c.num_rows, num_drafts: c.num_drafts, tokens_per_ms: c.tokens_per_ms }
    }
}

#[pyclass(frozen, module = "scheduler_rs._core")]
pub struct MtpVarlen {
    inner: CoreVarlen,
}

#[pymethods]
impl MtpVarlen {
    #[new]
    #[pyo3(signature = (step_cost_ms, sampler_ms=0.0))]
    fn new(step_cost_ms: std::collections::BTreeMap<u32, f64>, sampler_ms: f64) -> PyResult<Self> {
        let inner = CoreVarlen::new(step_cost_ms.into_iter().collect(), sampler_ms).map_err(PyValueError::new_err)?;
        Ok(MtpVarlen { inner })
    }

    fn choose(&self, confidences: Vec<Vec<f64>>) -> PyResult<VarlenPlan> {
        Ok(self.inner.choose(&confidences).map_err(PyValueError::new_err)?.into())
    }
}

#[pyfunction]
#[pyo3(signature = (max_rows, interval=8))]
fn graph_sizes(max_rows: u32, interval: u32) -> Vec<u32> {
    step::graph_sizes(max_rows, interval)
}

#[pyfunction]
fn select_graph_size(sizes: Vec<u32>, num_rows: u32) -> Option<u32> {
    step::select_graph_size(&sizes, num_rows)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<FinishReason>()?;
    m.add_class::<EngineType>()?;
    m.add_class::<Scheduling>()?;
    m.add_class::<PreemptionMode>()?;
    m.add_class::<Int32Array>()?;
    m.add_class::<SchedulerConfig>()?;
    m.add_class::<BlockManager>()?;
    m.add_class::<StepPlan>()?;
    m.add_class::<StepResult>()?;
    m.add_class::<RequestUpdate>()?;
    m.add_class::<RequestState>()?;
    m.add_class::<SchedulerStats>()?;
    m.add_class::<Scheduler>()?;
    m.add_class::<VarlenPlan>()?;
    m.add_class::<MtpVarlen>()?;
    m.add_function(wrap_pyfunction!(graph_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(select_graph_size, m)?)?;
    Ok(())
}
