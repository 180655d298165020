"""The worker: model runner, caches and sampler for one GPU (or the CPU)."""
