"""The planner service against a real nats-server: counts in, a plan out on time, health, metrics, SIGTERM."""

import asyncio
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import subjects
from services.eplb.layout import startup_layout
from services.eplb.messages import LoadReport, decode_plan
from tests.services.eplb.test_planner import FLAT, HOT, physical_counts

ROOT = pathlib.Path(__file__).resolve().parents[3]
PLAN_DEADLINE_S = 10.0  # from the report completing the re-plan step to the plan on NATS


@pytest.fixture
def planner_proc(nats_url):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.entrypoints.eplb",
            "--nats-url",
            nats_url,
            "--metrics-port",
            "0",
            "--num-experts",
            "8",
            "--num-gpus",
            "2",
            "--num-redundant",
            "2",
            "--num-layers",
            "2",
            "--num-ranks",
            "2",
            "--interval",
            "8",
            "--window",
            "8",
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = proc.stdout.readline()  # the service prints one line once subscribed
        match = re.search(r"health port (\d+), metrics port (\d+)", ready)
        assert match, f"no ready line: {ready!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        yield proc, int(match.group(1)), int(match.group(2))
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def health_status(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service="shinkai.eplb.Planner")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


async def publish_and_await_plan(nats_url: str) -> tuple[list, float]:
    import nats

    nc = await nats.connect(nats_url)
    plans: asyncio.Queue = asyncio.Queue()

    async def on_plan(msg) -> None:
        plans.put_nowait(decode_plan(msg.data))

    await nc.subscribe(subjects.EXPERT_PLAN, cb=on_plan)
    await nc.flush()
    start = startup_layout(8, 2, 2)
    counts = np.stack([physical_counts(start, HOT), physical_counts(start, FLAT)])
    await nc.publish(
        subjects.of_replica(subjects.EXPERT_LOAD, "engine-0"), b"SKEL\x09 not a report"
    )  # dropped, counted as bad
    for step in range(2):  # interval 8: the first re-plan is due after 2 complete steps
        for rank in (0, 1):
            await nc.publish(
                subjects.of_replica(subjects.EXPERT_LOAD, f"engine-{rank}"), LoadReport(rank, step, 0, counts).encode()
            )
    await nc.flush()
    sent = time.monotonic()
    first = await asyncio.wait_for(plans.get(), PLAN_DEADLINE_S)
    latency = time.monotonic() - sent
    await asyncio.sleep(0.3)  # a flat layer must not produce a second plan
    received = [first] + [plans.get_nowait() for _ in range(plans.qsize())]
    await nc.close()
    return received, latency


def test_counts_on_nats_lead_to_a_plan_on_time(nats_url, planner_proc):
    proc, health_port, metrics_port = planner_proc
    assert health_status(health_port) == health_pb2.HealthCheckResponse.SERVING

    received, latency = asyncio.run(publish_and_await_plan(nats_url))
    assert latency < PLAN_DEADLINE_S
    (message,) = received
    assert (message.version, message.layer, message.step) == (1, 0, 2)
    assert message.moe_lb_after < message.moe_lb_before - 0.01
    assert message.layout.num_slots == 10 and message.moves > 0

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    assert "shinkai_eplb_plans_published_total 1.0" in metrics
    assert "shinkai_eplb_plans_rejected_total 1.0" in metrics  # the flat layer
    assert "shinkai_eplb_bad_messages_total 1.0" in metrics
    assert re.search(r'shinkai_eplb_moe_lb\{layer="0"\} 1\.0\d*', metrics)

    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    assert "drained: 1 plans published" in proc.stdout.read()


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_without_nats_it_gives_up_clearly_or_stops_on_sigterm():
    args = [
        sys.executable,
        "-m",
        "services.entrypoints.eplb",
        "--nats-url",
        f"nats://127.0.0.1:{free_port()}",
        "--num-experts",
        "8",
        "--num-gpus",
        "2",
        "--num-redundant",
        "2",
        "--num-layers",
        "1",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        args + ["--connect-timeout", "1.5"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "could not start with NATS" in done.stderr

    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # A failed connection attempt is logged once the SIGTERM handler is in place.
        while "nats:" not in (line := proc.stderr.readline()):
            assert line, "the planner exited before trying NATS"
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert "stopped before it was ready" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
