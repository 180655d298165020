"""Expert parallelism on the worker side: the rank's process groups, its physical expert slots, the token
exchange (dispatch and combine) and the expert-parallel MoE layer (docs/parallelism.md)."""
