"""The model on the Triton kernels: converted modules, FP8 linears, the MoE, the head, and the GPU loaders."""
