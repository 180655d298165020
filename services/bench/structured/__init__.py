"""`shinkai bench structured`: structured output's costs (decode steps constrained against unconstrained, grammar
compiles, mask fills)."""
