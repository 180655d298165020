"""The engine's worker in another process: the worker.v1 client and the heartbeat that watches it."""
