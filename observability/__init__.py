"""Tracing and metrics, with their names defined once. Imported by all; imports none of them."""
