"""The Python half of the serving suites of scripts/gpu/run.sh (serve, serve-checkpoint, serve-up).

    python scripts/gpu/serve_check.py http --url URL --model NAME --out FILE
        greedy completions through the openai client, plain and streamed (they must agree), saved with
        their prompts;
    python scripts/gpu/serve_check.py offline --model M [--load-format dummy] --greedy FILE --out FILE
        the same prompts through ``LLM.generate`` in this process (greedy equality with the HTTP run),
        then ``LLM.generate`` throughput on the load generator's prompts, then the decode step that
        ``shinkai bench step`` times (``services/bench/step/timing.time_decode``) on the same model;
    python scripts/gpu/serve_check.py served --model M [--load-format dummy] --out FILE
        one build for all of it: the engine serves HTTP from this process (``shinkai serve``'s Server)
        while the http half and the load generator (concurrency 1, 16, 64) run as processes against it,
        then the same engine does the offline half.

Each prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def _prompts(num_id_prompts: int, prompt_tokens: int) -> list:
    from services.client.loadgen import prompt_ids

    return [*TEXT_PROMPTS, *(prompt_ids(i, prompt_tokens) for i in range(num_id_prompts))]


def http(args: argparse.Namespace) -> dict:
    import openai

    client = openai.OpenAI(base_url=args.url, api_key="unused", max_retries=0, timeout=600)
    rows = []
    for prompt in _prompts(2, args.prompt_tokens):
        kwargs = dict(
            model=args.model,
            prompt=prompt,
            max_tokens=args.max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        plain = client.completions.create(**kwargs)
        streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
        rows.append(
            {
                "prompt": prompt,
                "text": plain.choices[0].text,
                "streamed_equal": streamed == plain.choices[0].text,
                "completion_tokens": plain.usage.completion_tokens,
                "finish_reason": plain.choices[0].finish_reason,
            }
        )
    return {
        "url": args.url,
        "model": args.model,
        "max_tokens": args.max_tokens,
        "rows": rows,
        "streamed_equal": all(r["streamed_equal"] for r in rows),
        "all_complete": all(r["completion_tokens"] == args.max_tokens for r in rows),
    }


def offline(args: argparse.Namespace) -> dict:
    llm, out = build(args)
    return measure(llm, out, args)


def build(args: argparse.Namespace):
    """The engine ``LLM(model=...)`` builds on this device (CUDA: FP8 kernels, graphs, async, pools from
    --gpu-memory-utilization), and the first figures."""
    from services.engine import LLM

    out: dict = {"model": args.model, "load_format": args.load_format}
    max_model_len = args.prompt_tokens + args.max_tokens + 64
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        max_num_seqs=args.num_requests,
        max_model_len=max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        batch_invariant=args.batch_invariant,
    )
    out["ready_s"] = round(time.perf_counter() - t0, 1)
    out["pools"] = None if llm.pool_plan is None else llm.pool_plan.describe(max_model_len)
    print(json.dumps(out), flush=True)
    return llm, out


def measure(llm, out: dict, args: argparse.Namespace) -> dict:
    """Greedy equality with the HTTP half's file, offline throughput, then bench step's decode timing."""
    import gc

    import torch

    from services.client.loadgen import prompt_ids
    from services.engine import SamplingParams

    runner = llm.engine.worker.runner
    out["runner"] = type(runner).__name__
    if args.greedy:
        served = json.loads(Path(args.greedy).read_text())
        greedy = SamplingParams(max_tokens=served["max_tokens"], temperature=0.0, ignore_eos=True)
        # One prompt at a time, as the HTTP half sent them: the same batch shapes, graph sizes and chunks.
        got = [llm.generate([r["prompt"]], greedy)[0] for r in served["rows"]]
        equal = [g.text == r["text"] for g, r in zip(got, served["rows"])]
        out["greedy_equal"] = all(equal)
        out["greedy"] = [
            {"http": r["text"], "offline": g.text} for g, r in zip(got, served["rows"]) if g.text != r["text"]
        ]
    if args.greedy_only:
        return out
    prompts = [prompt_ids(i, args.prompt_tokens) for i in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # CPU: a smoke run
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (prefill compiles)
    sync()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    sync()
    seconds = time.perf_counter() - t0
    out["offline"] = {
        "num_requests": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "seconds": round(seconds, 2),
        "output_tokens_per_s": round(sum(len(o.token_ids) for o in outputs) / seconds, 1),
    }
    print(json.dumps(out), flush=True)
    source = llm.source
    del llm, runner, outputs
    gc.collect()
    torch.cuda.empty_cache()
    out["decode"] = decode_steps(source, args)
    return out


def served(args: argparse.Namespace) -> dict:
    """One build for every figure: the engine serves HTTP in this process (``shinkai serve``'s Server, the
    gateway and engine code of the stack), the HTTP half and the load generator run as separate processes
    against it; then the same engine runs ``LLM.generate`` (greedy, offline) and bench step's decode."""
    import asyncio
    import subprocess

    from services.gateway.server import ServeConfig, Server

    llm, out = build(args)
    here = str(Path(__file__).resolve())
    http_out = str(Path(args.out).with_name("http-" + Path(args.out).name))

    async def serve() -> list[dict]:
        server = Server(ServeConfig(model=args.model, http_port=args.port, grpc_port=0), llm=llm)
        await server.start()
        url = server.urls()["http"] + "/v1"
        loads = []
        try:
            steps = [
                [
                    sys.executable,
                    here,
                    "http",
                    "--url",
                    url,
                    "--model",
                    args.model,
                    "--out",
                    http_out,
                    "--prompt-tokens",
                    str(args.prompt_tokens),
                ]
            ]
            for c in args.concurrency:
                steps.append(
                    [
                        sys.executable,
                        "-m",
                        "services.client.loadgen",
                        "--url",
                        url,
                        "--model",
                        args.model,
                        "--num-requests",
                        str(max(3, min(2 * c, 64))),
                        "--concurrency",
                        str(c),
                        "--max-tokens",
                        str(args.max_tokens),
                        "--prompt-tokens",
                        str(args.prompt_tokens),
                    ]
                )
            for argv in steps:
                proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE)
                stdout, _ = await proc.communicate()
                last = stdout.decode().strip().splitlines()[-1] if stdout.strip() else "{}"
                print(last[-2000:], flush=True)
                if argv[1] == "-m":
                    loads.append(json.loads(last))
        finally:
            await server.stop()
        return loads

    out["served"] = asyncio.run(serve())
    args.greedy = http_out
    return measure(llm, out, args)


def decode_steps(source, args: argparse.Namespace) -> list[dict]:
    """``shinkai bench step``'s decode timing on ``source`` (the same model, pools of the bench's size)."""
    import torch

    from services.bench.step.build import runner_cache
    from services.bench.step.timing import time_decode
    from services.engine import LLM
    from services.engine.config import EngineConfig
    from services.worker.runners.decode_step_graphs import DecodeStepGraphs
    from services.worker.runners.model_runner import ModelRunner

    rows = []
    context = args.prompt_tokens + args.max_tokens // 2  # the middle of a served request
    for batch in args.batches:
        config_args = dict(block_size=128, max_num_seqs=batch, max_model_len=context + args.decode_steps + 16)
        if torch.cuda.is_available():  # bench step's engine: FP8 kernels, decode graphs
            config_args.update(kernel_backend="fp8", cuda_graphs=True, device="cuda")
        config = EngineConfig(**config_args)
        runner = ModelRunner(source.model, config)
        if config.cuda_graphs:
            runner = DecodeStepGraphs(runner, config, use_graphs=True, attention="triton")
        llm = LLM(source=source, runner=runner, **config_args)
        t = time_decode(
            llm.engine,
            runner_cache(llm),
            batch=batch,
            context=context,
            steps=args.decode_steps,
            vocab_size=source.config.vocab_size,
        )
        rows.append({"batch": batch, "context": context, "ms": round(t.median * 1e3, 2)})
        print(json.dumps(rows[-1]), flush=True)
        del llm, runner
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    h = sub.add_parser("http")
    h.add_argument("--url", required=True)
    h.add_argument("--model", required=True)
    sv = sub.add_parser("served")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    o = sub.add_parser("offline")
    for q in (sv, o):
        q.add_argument("--model", required=True)
        q.add_argument("--load-format", default="auto")
        q.add_argument("--greedy", default=None, help="the http half's output: its prompts are generated again")
        q.add_argument("--num-requests", type=int, default=64)
        q.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
        q.add_argument("--decode-steps", type=int, default=20)
        q.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        q.add_argument("--greedy-only", action="store_true", help="only the greedy comparison")
        q.add_argument(
            "--batch-invariant",
            action="store_true",
            help="the batch-invariant mode (the served half must run it too for == tokens)",
        )
    for q in (h, sv, o):
        q.add_argument("--prompt-tokens", type=int, default=512)
        q.add_argument("--max-tokens", type=int, default=128)
        q.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.what == "http":
        args.max_tokens = min(args.max_tokens, 16)
    result = {"http": http, "served": served, "offline": offline}[args.what](args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
