"""Two hosts simulated on one multi-GPU machine: two torchrun launchers (``--nnodes 2``, node ranks 0 and 1), each
seeing half of the GPUs (CUDA_VISIBLE_DEVICES, as two real hosts would), one engine process per GPU, meeting at the
first's store (``--dp-rendezvous env://``; NCCL exchange, gloo votes). Sends greedy prompts to every rank at once,
then the same prompts to one process (torch backend) and prints each prompt's tokens from both and the largest
logprob difference over their common prefix (the torch backend on a GPU has no batch-invariant mode, so the last
bits may differ). Then kills host 1 mid-stream and checks that every stream ends with an error and that host 0
exits by itself, leaving no process. Needs at least two CUDA devices (docs/parallelism.md, "More than one host"):

    python scripts/gpu/hosts_check.py                 # tiny; every visible GPU, half per host
    python scripts/gpu/hosts_check.py --model v41-s1 --load-format dummy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services import service_auth  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402
from services.gateway.remote import RemoteEngine  # noqa: E402
from services.ports import free_port  # noqa: E402

PROMPTS = [[5, 17, 99, 3], [42, 7], [8, 8, 8, 120, 64], [1, 2, 3], [9, 30, 31], [77, 1], [4, 4, 5, 6], [100, 3]]


def start_host(node: int, gpus: list[int], master: int, base: int, token: str, argv: list[str], log: Path, device: str):
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)),
        **{service_auth.TOKEN_ENV: token},
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--node-rank={node}",
        f"--nproc-per-node={len(gpus)}",
        "--master-addr=127.0.0.1",
        f"--master-port={master}",
        "-m",
        "services.entrypoints.engine",
        "--dp-rendezvous=env://",
        f"--device={device}",
        f"--grpc-port={base}",
        "--drain-timeout=5",
        *argv,
    ]
    with open(log, "w") as out:
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def stream(engine: RemoteEngine, request_id: str, prompt: list[int], params: SamplingParams, on_token=None):
    tokens, logprobs, reason = [], [], None
    async for delta in await engine.submit(request_id, request_id, prompt, params):
        tokens += delta.token_ids
        logprobs += delta.logprobs
        reason = delta.finish_reason or reason
        if on_token is not None:
            on_token(len(tokens))
    return tokens, logprobs, reason


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--load-format", default=None)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=Path("."), help="where the hosts' logs go (host0.log, host1.log)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (gloo; the flow without GPUs)")
    p.add_argument("--ranks-per-host", type=int, default=None, help="default: half of the GPUs (1 on the CPU)")
    args = p.parse_args()
    num_gpus = torch.cuda.device_count()
    if args.device == "cuda" and num_gpus < 2:
        print(f"needs 2 CUDA devices, found {num_gpus}")
        return 1
    per_host = args.ranks_per_host or (num_gpus // 2 if args.device == "cuda" else 1)
    sizing = ["--max-num-seqs=8", "--max-model-len=256"]
    engine_argv = [f"--model={args.model}", *sizing] + (
        [f"--load-format={args.load_format}"] if args.load_format else []
    )
    token = service_auth.new_token()
    master = free_port("127.0.0.1")
    logs = [(args.log_dir / f"host{n}.log").resolve() for n in range(2)]
    gpus = [list(range(n * per_host, (n + 1) * per_host)) for n in range(2)]
    t0 = time.monotonic()
    hosts = [
        start_host(n, gpus[n], master, free_port("127.0.0.1"), token, engine_argv, logs[n], args.device)
        for n in range(2)
    ]
    try:
        return check(args, hosts, logs, per_host, token, t0)
    finally:  # nothing outlives the check, whatever it raised
        stop_all(hosts, logs)


def ready_lines(logs: list[Path]) -> list[dict]:
    return [json.loads(x) for log in logs for x in log.read_text().splitlines() if x.startswith('{"event": "ready"')]


def stop_all(hosts: list[subprocess.Popen], logs: list[Path]) -> None:
    for h in hosts:
        if h.poll() is None:
            os.killpg(h.pid, signal.SIGKILL)
    for r in ready_lines(logs):  # torchrun starts each engine in a session of its own
        if alive(r["pid"]):
            os.kill(r["pid"], signal.SIGKILL)


def check(args, hosts: list[subprocess.Popen], logs: list[Path], per_host: int, token: str, t0: float) -> int:
    ready: list[dict] = []
    while len(ready) < 2 * per_host:
        ready = ready_lines(logs)
        if any(h.poll() is not None for h in hosts) or time.monotonic() - t0 > args.start_timeout:
            print("a host failed to start:\n" + "\n".join(log.read_text()[-3000:] for log in logs))
            return 1
        time.sleep(0.5)
    ready.sort(key=lambda r: r["dp_rank"])
    print(json.dumps({"ready_s": round(time.monotonic() - t0, 1), "ranks": [(r["replica"], r["grpc"]) for r in ready]}))
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = PROMPTS[: max(2, len(ready))]

    async def served():
        engines = [RemoteEngine(r["replica"], r["grpc"], token) for r in ready]
        try:
            return await asyncio.gather(
                *(stream(engines[i % len(engines)], f"r{i}", prompt, greedy) for i, prompt in enumerate(prompts))
            )
        finally:
            for e in engines:
                await e.close()

    got = asyncio.run(served())

    # A lost host: kill host 1 (torchrun's session and its engines) once a stream on it has tokens.
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)  # within --max-model-len
    host1 = [r for r in ready if r["dp_rank"] >= per_host]

    def kill_host1(num_tokens: int) -> None:
        if num_tokens >= 2 and hosts[1].poll() is None:
            os.killpg(hosts[1].pid, signal.SIGKILL)
            for r in host1:
                if alive(r["pid"]):
                    os.kill(r["pid"], signal.SIGKILL)

    async def lost():
        engines = [RemoteEngine(r["replica"], r["grpc"], token) for r in ready]
        try:
            return await asyncio.wait_for(
                asyncio.gather(
                    *(
                        stream(e, f"long{i}", PROMPTS[0], long, kill_host1 if i == len(engines) - 1 else None)
                        for i, e in enumerate(engines)
                    )
                ),
                300,
            )
        finally:
            for e in engines:
                await e.close()

    reasons = [str(reason) for _, _, reason in asyncio.run(lost())]
    try:
        host0_exit = hosts[0].wait(120)
    except subprocess.TimeoutExpired:
        host0_exit = None
    time.sleep(2)
    left = [r["pid"] for r in ready if alive(r["pid"])] + [h.pid for h in hosts if h.poll() is None]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    print(json.dumps({"lost_host": {"reasons": reasons, "host0_exit": host0_exit, "left": left}}))

    one = LLM(
        args.model,
        device=args.device,
        max_num_seqs=8,
        max_model_len=256,
        **({"load_format": args.load_format} if args.load_format else {}),
    )
    expected = one.generate(prompts, greedy)
    same = 0
    for prompt, (tokens, logprobs, _), out in zip(prompts, got, expected):
        common = 0
        while common < min(len(tokens), len(out.token_ids)) and tokens[common] == out.token_ids[common]:
            common += 1
        diff = max((abs(a - b) for a, b in zip(logprobs[:common], out.logprobs[:common])), default=0.0)
        same += tokens == out.token_ids
        print(
            json.dumps({"prompt": prompt, "two_hosts": tokens, "one_process": out.token_ids, "max_logprob_diff": diff})
        )
    ok = all(r == "error" for r in reasons) and host0_exit not in (0, None) and not left
    verdict = "ok" if ok else "FAILED"
    print(f"two hosts ({per_host} ranks each): {same}/{len(prompts)} prompts with one process's greedy tokens")
    print(f"lost host: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
