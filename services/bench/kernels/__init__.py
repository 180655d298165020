"""`shinkai bench kernels`: each Triton kernel (and the library GEMMs beside it) against its roofline and the torch
op."""
