"""Fixtures shared across the test tree."""

import pytest

from tests.nats_server import running_nats_server


@pytest.fixture
def nats_url(tmp_path):
    """A fresh nats-server on a random loopback port for one test, stopped by PID afterwards."""
    with running_nats_server(tmp_path) as url:
        yield url
