//! Shinkai's scheduler and block manager. This file only exports.
mod python;
