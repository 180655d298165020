"""`free_port` picks below the ephemeral range (where port-0 listeners and outgoing connections take theirs),
and never a port something holds."""

import itertools
import socket

from services import ports


def test_picks_lie_below_the_ephemeral_range_and_are_free():
    high = ports.ephemeral_low()
    for _ in range(50):
        port = ports.free_port("127.0.0.1")
        assert ports.PICK_FLOOR <= port < high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if the pick was held


def test_a_held_port_is_never_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        draws = itertools.chain([taken, taken], (p for p in range(ports.PICK_FLOOR, 65536) if p != taken))

        class Draw:
            def randrange(self, low, high):
                return next(draws)

        monkeypatch.setattr(ports, "ephemeral_low", lambda: 65536)
        monkeypatch.setattr(ports.random, "SystemRandom", Draw)
        assert ports.free_port("127.0.0.1") != taken


def test_a_narrow_range_below_the_ephemeral_one_falls_back_to_any_free_port(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.PICK_FLOOR + ports.MIN_PICK_SPAN - 1)
    port = ports.free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_the_range_is_read_from_the_kernel_or_linux_default(monkeypatch, tmp_path):
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_low() == 32768
    (tmp_path / "range").write_text("40000\t60999\n")
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE_FILE", tmp_path / "range")
    assert ports.ephemeral_low() == 40000
