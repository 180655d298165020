"""`shinkai serve --dp N`: N data-parallel ranks behind this one process's HTTP and gRPC.

The ranks are what `shinkai up --dp N` runs (services/engine/parallel/served_rank.py): each its own engine
endpoint process (`python -m services.entrypoints.engine --dp N --dp-rank R`), children of this process, meeting at a
loopback rendezvous. This process is the gateway without NATS: the tokenizer in-process, the router spreading
requests over the ranks by its own counts, the health of every rank polled (`EngineHealth`), so a lost rank
takes the server to NOT_SERVING and its streams end with "error", as under `shinkai up`.

Invariants: the ranks start together (each waits for the others at the rendezvous) and stop together
(SIGTERM to all, then each drains while the others keep stepping with it); a rank outlives neither this
process (the kernel sends it SIGTERM when its parent dies) nor ``stop()``.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import service_auth
from services.engine.model_source import load_model
from services.gateway.auth import KEY_ENV
from services.gateway.remote import RemoteEngine
from services.ports import free_port

log = logging.getLogger("shinkai.gateway.rank_group")

_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent thread exits


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class RankGroup:
    def __init__(
        self, model: str, num_ranks: int, num_redundant_experts: int, host: str, engine_argv: Sequence[str]
    ) -> None:
        """Starts ``num_ranks`` rank processes of ``model`` on ``host``; ``engine_argv``: the engine flags
        every rank gets (sizing, device, batch invariance, drain timeout)."""
        self.model = model
        self.host = host
        rendezvous = f"tcp://{host}:{free_port(host)}"
        self.ports = [free_port(host) for _ in range(num_ranks)]  # each rank's shinkai.v1 gRPC port
        # The ranks take calls from this process only: a service credential of their own, in their environment,
        # which holds no API key (this process checks those).
        self.service_token = service_auth.current_token() or service_auth.new_token()
        env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
        env[service_auth.TOKEN_ENV] = self.service_token
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.entrypoints.engine",
                    "--model",
                    model,
                    "--replica",
                    f"engine-{r}",
                    "--rank",
                    str(r),
                    "--dp",
                    str(num_ranks),
                    "--num-redundant-experts",
                    str(num_redundant_experts),
                    "--dp-rank",
                    str(r),
                    "--dp-rendezvous",
                    rendezvous,
                    "--host",
                    host,
                    "--grpc-port",
                    str(port),
                    *engine_argv,
                ],
                stdin=subprocess.DEVNULL,
                stdout=sys.stderr,
                env=env,
                preexec_fn=_die_with_parent,
            )
            for r, port in enumerate(self.ports)
        ]

    def engines(self) -> list[RemoteEngine]:
        return [
            RemoteEngine(f"engine-{r}", f"{self.host}:{port}", self.service_token) for r, port in enumerate(self.ports)
        ]

    def source(self):
        """The model's config and tokenizer (no weights: the ranks hold them)."""
        return load_model(self.model, weights=False)

    async def wait_serving(self, timeout_s: float) -> None:
        """Returns once every rank answers SERVING; raises RuntimeError (after stopping the group) when one
        exits or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        for r, (proc, port) in enumerate(zip(self.processes, self.ports)):
            async with grpc.aio.insecure_channel(f"{self.host}:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while True:
                    try:
                        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            break
                    except grpc.aio.AioRpcError:
                        pass
                    if proc.poll() is not None or time.monotonic() > deadline:
                        why = (
                            f"exited with {proc.returncode}"
                            if proc.poll() is not None
                            else f"not serving within {timeout_s} s"
                        )
                        self.stop(0.0)
                        raise RuntimeError(f"data-parallel rank {r} {why} (its log is above)")
                    await asyncio.sleep(0.1)

    def stop(self, timeout_s: float) -> list[int | None]:
        """SIGTERM to every rank at once, up to ``timeout_s`` for them to drain, then SIGKILL; the exit codes."""
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank pid %d did not stop within %.0f s: killed", proc.pid, timeout_s)
                proc.kill()
                proc.wait()
        return [proc.returncode for proc in self.processes]
