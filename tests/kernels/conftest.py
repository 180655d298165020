"""Fixtures of the kernel tests."""

import pytest


@pytest.fixture
def private_triton_cache(tmp_path, monkeypatch):
    """Triton's cache in this test's own directory, for tests that compile for the GPU on the CPU: the compile
    runs the code generator every time (a warm shared cache would skip it, and hide a failure there) and reads
    nothing another process wrote into ``~/.triton/cache``."""
    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    return cache
