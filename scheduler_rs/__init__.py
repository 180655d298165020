"""Shinkai's scheduler and block manager, written in Rust (``scheduler_rs._core``)."""
