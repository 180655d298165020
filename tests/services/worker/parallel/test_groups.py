"""Which rendezvous keeps gloo on loopback: one host's (file://, a loopback address, env:// with a loopback
MASTER_ADDR), never a group whose master is another host."""

import pytest

from services.worker.parallel.groups import is_loopback


@pytest.mark.parametrize(
    ("init_method", "environ", "loopback"),
    [
        ("file:///tmp/rendezvous", {}, True),
        ("tcp://127.0.0.1:29500", {}, True),
        ("tcp://localhost:29500", {}, True),
        ("tcp://engine-0:29500", {}, False),
        ("tcp://10.0.3.7:29500", {}, False),
        ("env://", {"MASTER_ADDR": "127.0.0.1"}, True),
        ("env://", {"MASTER_ADDR": "shinkai-engine-0.shinkai-engine"}, False),
    ],
)
def test_loopback_only_when_every_rank_meets_on_this_host(init_method, environ, loopback):
    assert is_loopback(init_method, environ) is loopback
