//! Scheduler errors. The Python binding maps each kind to an exception type.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchedulerError {
    /// A configuration value out of range (ValueError).
    InvalidConfig(String),
    /// A request that can never run: empty, too long, bad token ids (ValueError).
    InvalidRequest(String),
    /// `add_request` or `fork` with an id already in use (ValueError).
    DuplicateRequest(String),
    /// An id the scheduler does not hold (KeyError).
    UnknownRequest(String),
    /// A call that does not fit the scheduler's state, e.g. steps updated out of order (RuntimeError).
    InvalidState(String),
    /// A `StepResult` that does not match its plan (ValueError).
    InvalidResult(String),
}

impl fmt::Display for SchedulerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SchedulerError::InvalidConfig(m) => write!(f, "invalid scheduler config: {m}"),
            SchedulerError::InvalidRequest(m) => f.write_str(m),
            SchedulerError::DuplicateRequest(id) => write!(f, "request id {id:?} is already in use"),
            SchedulerError::UnknownRequest(id) => write!(f, "unknown request id {id:?}"),
            SchedulerError::InvalidState(m) => f.write_str(m),
            SchedulerError::InvalidResult(m) => write!(f, "step result does not match its plan: {m}"),
        }
    }
}

impl std::error::Error for SchedulerError {}
