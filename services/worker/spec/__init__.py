"""Speculative decoding on the worker: DSpark's draft proposal and verification, each eager form beside its static
(graph) form."""
