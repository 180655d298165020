"""The local placement of `shinkai up`: one host, a port per service and use, never one given twice."""


def test_local_ports_are_never_given_twice(monkeypatch):
    """The OS may return the same free port on consecutive calls (it is closed in between): the placement must
    not give it to two services."""
    from services.entrypoints import placement

    offered = iter([5001, 5001, 5001, 5002, 5001, 5003])
    monkeypatch.setattr(placement, "free_port", lambda host: next(offered))
    at = placement.LocalPlacement("127.0.0.1")
    ports = [
        at.port("engine-0", "grpc"),
        at.port("worker-0", "grpc"),
        at.port("engine-0", "grpc"),
        at.port("gateway", "grpc"),
    ]
    assert ports == [5001, 5002, 5001, 5003]
