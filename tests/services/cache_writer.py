"""A process that compiles into the compile cache `cache_dirs.setup()` chooses, as a service process does at start
(tests/services/test_cache_dirs.py starts two at once on one cache, and one engine after another).

    python -m tests.services.cache_writer --go FILE --blocks 16,32,… --rounds N   # sm_90 variants, on the CPU
    python -m tests.services.cache_writer --engine tiny                           # an engine on CUDA, a few requests

The first waits until FILE exists (so both processes start compiling together) and compiles every variant
``rounds`` times; the second starts an engine the served way (kernel backend, CUDA graphs) and generates. Each
prints one JSON line: the cache directory, how many compiles missed and hit the cache, and the kernels that missed."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from services import cache_dirs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--go", type=Path)
    p.add_argument("--blocks")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--engine", default=None, help="a model to serve on CUDA instead")
    args = p.parse_args()
    dirs = cache_dirs.setup()  # before Triton reads its variable, as every service process does

    import triton
    import triton.language as tl
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def scale_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i) * 2 + 1)

    counts = {"hits": 0, "misses": 0}
    missed: set[str] = set()

    def listener(*, src, cache_hit: bool, **_: object) -> None:
        counts["hits" if cache_hit else "misses"] += 1
        if not cache_hit:
            missed.add(getattr(src, "name", "?"))

    knobs.compilation.listener = listener
    if args.engine is not None:
        _serve_a_few(args.engine)
        print(json.dumps({"triton": str(dirs["triton"]), **counts, "missed": sorted(missed)}), flush=True)
        return
    deadline = time.monotonic() + 60
    while not args.go.exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    for _ in range(args.rounds):
        for block in (int(b) for b in args.blocks.split(",")):
            source = ASTSource(
                fn=scale_kernel,
                signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK": "constexpr"},
                constexprs={(2,): block},
            )
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            assert compiled.asm["cubin"][:4] == b"\x7fELF", "a cubin read back partial"
    print(json.dumps({"triton": str(dirs["triton"]), **counts}), flush=True)


def _serve_a_few(model: str) -> None:
    """An engine as `shinkai up` starts one on a GPU (the device's defaults: kernel backend, CUDA graphs), then
    prompts of a few lengths, greedy."""
    from services.engine import LLM, SamplingParams

    llm = LLM(model=model, device="cuda", max_num_seqs=4, max_model_len=256)
    prompts = [[5 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate((3, 17, 40, 90))]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))


if __name__ == "__main__":
    main()
