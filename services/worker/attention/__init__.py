"""One step's attention over the paged caches (`AttentionStep`) and its backends: torch, Triton, and the graph-safe
decode form."""
