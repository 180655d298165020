"""Protocol buffers of every Shinkai service; the generated modules are committed (see generate.py)."""
