"""A data-parallel group over two hosts, simulated on one machine: two torchrun launchers (``--nnodes 2``, node
ranks 0 and 1, one engine process each, gloo over loopback) meeting at the first's store. Every stream's tokens
and logprobs equal one process's (batch-invariant mode, greedy and seeded, with ==); a host killed mid-run (its
launcher and engine SIGKILLed) ends every stream with an error, and the surviving host's rank and launcher exit
on their own with an error, leaving no process (docs/parallelism.md, "More than one host")."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services import service_auth
from services.engine import LLM, SamplingParams
from services.engine.outputs import FinishReason
from services.entrypoints.stack import ROOT
from services.gateway.remote import RemoteEngine
from services.ports import free_port
from tests.ranks_harness import alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SIZING = dict(max_num_seqs=4, max_model_len=128)
PROMPTS = [[5, 17, 99, 3], [42, 7], [8, 8, 8, 120, 64], [1, 2, 3]]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
]


def start_host(node_rank: int, master_port: int, grpc_base: int, token: str, log: Path) -> subprocess.Popen:
    """One host's launcher: torchrun with one engine process (its own session, so a test can kill the host)."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--node-rank={node_rank}",
        "--nproc-per-node=1",
        "--master-addr=127.0.0.1",
        f"--master-port={master_port}",
        "-m",
        "services.entrypoints.engine",
        "--dp-rendezvous=env://",
        "--device=cpu",
        "--batch-invariant",
        f"--max-num-seqs={SIZING['max_num_seqs']}",
        f"--max-model-len={SIZING['max_model_len']}",
        f"--grpc-port={grpc_base}",
        "--drain-timeout=5",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **{service_auth.TOKEN_ENV: token})
    with open(log, "w") as out:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(hosts: list[tuple[subprocess.Popen, Path]], timeout_s: float = 180.0) -> list[dict]:
    """Each host's engine's ready line."""
    deadline = time.monotonic() + timeout_s
    ready: dict[int, dict] = {}
    while len(ready) < len(hosts):
        for i, (proc, log) in enumerate(hosts):
            for line in log.read_text().splitlines():
                if line.startswith('{"event": "ready"'):
                    ready[i] = json.loads(line)
            if proc.poll() is not None and i not in ready:
                pytest.fail(f"host {i} exited with {proc.returncode}: {log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"hosts not ready within {timeout_s} s: {[log.read_text()[-2000:] for _, log in hosts]}")
        time.sleep(0.2)
    return [ready[i] for i in range(len(hosts))]


def kill_host(proc: subprocess.Popen, engine_pid: int) -> None:
    """A host lost: its launcher's session and its engine (torchrun starts each worker in a session of its own)."""
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), lambda: os.kill(engine_pid, signal.SIGKILL)):
        try:
            kill()
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-hosts")
    token = service_auth.new_token()
    master = free_port("127.0.0.1")
    hosts = [
        (start_host(n, master, free_port("127.0.0.1"), token, tmp / f"host{n}.log"), tmp / f"host{n}.log")
        for n in range(2)
    ]
    ready: list[dict] = []
    try:
        ready = wait_ready(hosts)
        yield hosts, ready, token
    finally:
        for i, (proc, _) in enumerate(hosts):
            kill_host(proc, ready[i]["pid"] if ready else proc.pid)
            proc.wait(10)


async def stream(engine: RemoteEngine, request_id: str, prompt: list[int], params: SamplingParams):
    """(tokens, logprobs, finish reason) of one request."""
    tokens: list[int] = []
    logprobs: list[float] = []
    reason = None
    async for delta in await engine.submit(request_id, request_id, prompt, params):
        tokens += delta.token_ids
        logprobs += delta.logprobs
        reason = delta.finish_reason or reason
    return tokens, logprobs, reason


def test_two_hosts_serve_one_hosts_tokens(two_hosts):
    _, ready, token = two_hosts
    assert [r["dp_rank"] for r in ready] == [0, 1]  # node rank 0 holds rank 0

    async def run():
        engines = [RemoteEngine(r["replica"], r["grpc"], token) for r in ready]
        try:  # all at once, two on each host's rank
            return await asyncio.gather(
                *(stream(engines[i % 2], f"r{i}", p, s) for i, (p, s) in enumerate(zip(PROMPTS, PARAMS)))
            )
        finally:
            for e in engines:
                await e.close()

    got = asyncio.run(run())
    expected = LLM("tiny", batch_invariant=True, **SIZING).generate(PROMPTS, PARAMS)
    for (tokens, logprobs, reason), out in zip(got, expected):
        assert tokens == out.token_ids
        assert logprobs == out.logprobs
        assert reason == FinishReason.LENGTH


def test_a_lost_host_ends_every_stream_and_leaves_no_process(two_hosts):
    hosts, ready, token = two_hosts
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def run():
        engines = [RemoteEngine(r["replica"], r["grpc"], token) for r in ready]
        streams = [await e.submit(f"long{i}", f"long{i}", PROMPTS[i], long) for i, e in enumerate(engines)]
        reasons = [None, None]
        seen = [0, 0]

        async def read(i):
            async for delta in streams[i]:
                seen[i] += len(delta.token_ids)
                reasons[i] = delta.finish_reason or reasons[i]
                if i == 1 and seen[i] >= 2 and alive(ready[1]["pid"]):
                    kill_host(hosts[1][0], ready[1]["pid"])  # mid-run: both streams have tokens to come

        try:
            await asyncio.wait_for(asyncio.gather(read(0), read(1)), 120)
        finally:
            for e in engines:
                await e.close()
        return reasons, seen

    reasons, seen = asyncio.run(run())
    assert reasons == [FinishReason.ERROR, FinishReason.ERROR]
    assert all(0 < n < 100 for n in seen)
    survivor = hosts[0][0]
    survivor.wait(60)  # its rank leaves once its group is lost, then torchrun stops the host
    assert survivor.returncode != 0
    pids = [proc.pid for proc, _ in hosts] + [r["pid"] for r in ready]
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if alive(pid)] == []
