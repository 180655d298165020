//! Shinkai's scheduler and block manager. This file only exports.

pub mod block_manager;
pub mod config;
pub mod errors;
mod invariants;
mod plan_builder;
pub mod prefix_cache;
pub mod queue_order;
pub mod request;
pub mod scheduler;
pub mod snapshots;
pub mod step;
pub mod varlen;

mod python;
