"""Shinkai's Python services: gateway, tokenizer, engine, worker, EPLB planner, and the CLI."""
