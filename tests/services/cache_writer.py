"""A process that compiles Triton kernel variants for sm_90 on the CPU into the compile cache `cache_dirs.setup()`
chooses, as a service process does at start (tests/services/test_cache_dirs.py starts two at once on one cache).

    python -m tests.services.cache_writer --go FILE --blocks 16,32,… --rounds N

It waits until FILE exists (so both processes start compiling together), compiles every variant ``rounds`` times,
and prints one JSON line: the cache directory, and how many compiles missed and hit the cache."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from services import cache_dirs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--go", type=Path, required=True)
    p.add_argument("--blocks", required=True)
    p.add_argument("--rounds", type=int, default=1)
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

    def listener(*, cache_hit: bool, **_: object) -> None:
        counts["hits" if cache_hit else "misses"] += 1

    knobs.compilation.listener = listener
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


if __name__ == "__main__":
    main()
