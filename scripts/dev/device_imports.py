"""Runs a Python entry point here with only what the device machine has importable: its image's packages
(the ``Packages:`` list of the device notes' KINDS.md) and the wheels scripts/dev/device-prep.sh carries (its
``BASE``; with ``--stack``, ``STACK`` too). An import that the repository or a carried wheel makes of any other
installed distribution fails with ModuleNotFoundError naming it, as it would on the device, before device time is
spent. grpcio and protobuf count as absent without ``--stack``: the image's are older than the generated code
needs. Imports made by the image's own packages are theirs to satisfy and pass.

    python scripts/dev/device_imports.py -m pytest --collect-only -q -m gpu tests/services/engine/prefix
    python scripts/dev/device_imports.py -m services.bench.structured.run --rounds 1 --steps 2 --batches 1
    python scripts/dev/device_imports.py --stack scripts/diagnostics/fairness.py --seconds 2

Under pytest, plugins are not autoloaded (the venv's own, such as schemathesis's, are not on the device);
pytest-timeout, which the tests' markers need and the image has, is loaded by name.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = Path("/work/.library/device/KINDS.md")
TOO_OLD = {"grpcio", "protobuf"}  # on the image, but older than the generated code needs: carried by --stack


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def image_packages(path: Path) -> set[str]:
    """The device image's distributions: the comma-separated list after ``Packages:`` in KINDS.md."""
    text = path.read_text()
    start = text.index("Packages:") + len("Packages:")
    return {_norm(n) for n in text[start : text.index("\n", start)].rstrip(".").split(",") if n.strip()}


def carried(section: str) -> set[str]:
    """The names in device-prep.sh's bash array ``section`` (BASE or STACK)."""
    text = (ROOT / "scripts" / "dev" / "device-prep.sh").read_text()
    body = re.search(rf"^{section}=\(([^)]*)\)", text, re.M)
    if body is None:
        raise SystemExit(f"no {section}=(...) in scripts/dev/device-prep.sh")
    return {_norm(n) for n in body.group(1).split()}


def _machinery(frame) -> bool:
    """The import system's own frames (frozen bootstrap, importlib.import_module), between an importer and here."""
    return frame.f_code.co_filename.startswith("<frozen") or frame.f_globals.get("__name__", "").startswith("importlib")


class DeviceFinder:
    """A meta-path finder that refuses, for importers in the repository or in a carried wheel, the top-level
    modules of installed distributions the device lacks."""

    def __init__(self, allowed: set[str], wheels: set[str]) -> None:
        self.allowed = allowed
        self.wheels = wheels
        self.owners = {top: {_norm(d) for d in ds} for top, ds in md.packages_distributions().items()}

    def _importer_checked(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None and _machinery(frame):
            frame = frame.f_back
        if frame is None:
            return True
        path = Path(frame.f_code.co_filename)
        if ROOT in path.parents and ".venv" not in path.parts:
            return True
        top = frame.f_globals.get("__name__", "").split(".")[0]
        return bool(self.owners.get(top, set()) & self.wheels)

    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        owners = self.owners.get(top)
        if "." in name or owners is None or owners & self.allowed or not self._importer_checked():
            return None
        raise ModuleNotFoundError(f"No module named {name!r}: {', '.join(sorted(owners))} not on the device", name=name)


def main() -> None:
    args = sys.argv[1:]
    stack = bool(args) and args[0] == "--stack"
    args = args[1:] if stack else args
    if not args:
        raise SystemExit(__doc__)
    wheels = carried("BASE") | (carried("STACK") if stack else set())
    image = image_packages(KINDS) - (set() if stack else TOO_OLD)
    sys.meta_path.insert(0, DeviceFinder(image | wheels, wheels))
    if args[0] == "-m":
        if args[1] == "pytest":
            os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
            args = [*args[:2], "-p", "pytest_timeout", *args[2:]]
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
