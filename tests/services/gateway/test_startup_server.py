"""services/gateway/startup_server.py: while an engine starts, grpc.health says NOT_SERVING with the phase (what
`shinkai up` prints) and HTTP /health says 503 with it; stopped, the ports are free for the real server."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request

from services.entrypoints.probe import health_state
from services.gateway.startup_server import StartupServer, StartupServerThread
from services.worker.startup import StartupProgress


def _get(url: str, data: bytes | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_probes_see_not_serving_with_the_phase_and_the_ports_are_free_afterwards():
    progress = StartupProgress()

    async def run() -> tuple:
        server = StartupServer(progress, "127.0.0.1", 0, 0)
        await server.start()
        try:
            with progress.phase("capturing", total=11) as step:
                step.advance("64 rows")
                grpc_seen = await asyncio.to_thread(health_state, "127.0.0.1", f"grpc:{server.grpc_port}")
                health = await asyncio.to_thread(_get, f"http://127.0.0.1:{server.http_port}/health")
                generate = await asyncio.to_thread(_get, f"http://127.0.0.1:{server.http_port}/v1/completions", b"{}")
        finally:
            await server.stop()
        return server, grpc_seen, health, generate

    server, (serving, state), (status, body), (gen_status, gen_body) = asyncio.run(run())
    assert not serving
    assert (state.phase, state.done, state.total, state.detail) == ("capturing", 1, 11, "64 rows")
    assert status == 503 and body["status"] == "starting"
    assert (body["phase"], body["done"], body["total"]) == ("capturing", 1, 11)
    assert gen_status == 503 and gen_body["error"]["code"] == "starting"
    assert "capturing" in gen_body["error"]["message"]
    for port in (server.grpc_port, server.http_port):  # free again: the real server binds them next
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def test_the_thread_form_serves_a_process_without_an_event_loop():
    progress = StartupProgress()
    server = StartupServerThread(progress, "127.0.0.1", 0)
    port = server.start()
    try:
        with progress.phase("loading"):
            serving, state = health_state("127.0.0.1", f"grpc:{port}")
    finally:
        server.stop()
    assert not serving and state.phase == "loading"
    assert health_state("127.0.0.1", f"grpc:{port}") == (False, None)  # nothing listens any more
