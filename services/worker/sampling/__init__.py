"""Sampling: the CPU `Sampler`, its fused-kernel form, and its fixed-shape device form."""
