"""CUDA-graph capture, shared by every graph cache of the worker."""
