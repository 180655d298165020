"""Reading a started service's log file: its JSON events among the lines gRPC's C core writes into the same file."""

import json
import time


def ready_event(log_path: str, timeout_s: float = 20.0) -> dict:
    """The service's JSON ready event.

    gRPC's own lines (a GOAWAY from a peer still starting, say) can come before it, and health can turn
    SERVING a moment before the event is printed, so the file is searched, and searched again until
    `timeout_s` has passed.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with open(log_path, errors="replace") as log:
            for line in log:
                if line.startswith('{"event": "ready"'):
                    return json.loads(line)
        if time.monotonic() > deadline:
            raise AssertionError(f"no ready event in {log_path}")
        time.sleep(0.05)
