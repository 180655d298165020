"""The endpoints' start: what a first request would pay once is done before health says SERVING."""

import subprocess
import sys

from services.entrypoints.stack import ROOT

# In a fresh interpreter (this one may have loaded anyio's backend in another test already).
_START = """
import asyncio, sys, types
from services.gateway.api_server import ApiServer

async def main():
    assert "anyio._backends._asyncio" not in sys.modules
    api = ApiServer(types.SimpleNamespace(), "127.0.0.1", 0, 0)  # the frontend is read per request only
    await api.start()
    print(api.serving(), "anyio._backends._asyncio" in sys.modules)
    await api.stop()

asyncio.run(main())
"""


def test_the_http_endpoint_loads_the_stream_backend_before_it_serves():
    """Starlette streams every SSE response in an anyio task group, and anyio imports its asyncio backend on the
    first one: the HTTP endpoint does that before it serves, so the first streamed request does not."""
    done = subprocess.run([sys.executable, "-c", _START], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]
