"""Regenerates the committed Python code of every ``.proto`` under services/proto.

``python -m services.proto.generate`` writes ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` beside each
``.proto``; ``generate(out_dir)`` writes them under another root so a test can compare byte for byte.
Protos are compiled with the repository root as the include path, so generated imports read
``from services.proto.shinkai.v1 import shinkai_pb2``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = Path(__file__).resolve().parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """Every .proto, relative to the repository root, in a stable order."""
    return sorted(p.relative_to(ROOT) for p in PROTO_DIR.rglob("*.proto"))


def generated_files(proto: Path) -> list[Path]:
    stem = proto.with_suffix("")
    return [stem.parent / f"{stem.name}{suffix}" for suffix in SUFFIXES]


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Compiles every proto into ``out_dir``; returns the written paths relative to it."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    protos = [str(p) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    return [g for p in proto_files() for g in generated_files(p)]


if __name__ == "__main__":
    import os

    os.chdir(ROOT)  # protoc resolves the relative proto paths against the include path
    for path in generate():
        print(path)
    sys.exit(0)
