"""Every NATS round trip in the services has an explicit deadline: each ``flush`` or ``request`` call on a
NATS connection (``nc`` / ``_nc``) passes ``timeout=``. NATS carries events only, so a missing deadline
would let a NATS outage block a service that should not care."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def nats_round_trips():
    for path in sorted((ROOT / "services").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("flush", "request")
            ):
                receiver = ast.unparse(node.func.value)
                if receiver.split(".")[-1] in ("nc", "_nc"):
                    yield f"{path.relative_to(ROOT)}:{node.lineno} {receiver}.{node.func.attr}", node


def test_every_nats_round_trip_has_a_deadline():
    calls = list(nats_round_trips())
    assert len(calls) >= 4  # the reporter, the router and the planner's two: the scan finds them
    missing = [where for where, node in calls if not any(k.arg == "timeout" for k in node.keywords)]
    assert not missing, f"NATS round trips without a deadline: {missing}"
