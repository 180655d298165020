"""Data-parallel ranks on the engine side: the host votes, the rank process and the driver that starts
the ranks and spreads requests over them (docs/parallelism.md)."""
