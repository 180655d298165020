"""A step's rows as tensors: `StepBatch` (any step, what the cached forward and the attention backends index with) and
its fixed-shape form `StaticBatch` (what a decode graph reads)."""
