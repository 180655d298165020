"""Prefix caching: the block hash chain shared by engines (lookup, events) and gateways (routing)."""
