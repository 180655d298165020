"""Writes golden outputs of DeepSeek's reference EPLB for tests/services/eplb/test_deepseek.py.

The reference is brought in as source on the developer's machine, never vendored:

    git clone https://github.com/deepseek-ai/EPLB /tmp/EPLB
    git -C /tmp/EPLB checkout d52c72d5b2f2fb4c41afbf8eb21366820239913d
    . scripts/dev/dev-env.sh   # torch comes with the pinned venv
    python scripts/dev/eplb_deepseek_golden.py --reference /tmp/EPLB/eplb.py

The file's sha256 must match REFERENCE_SHA256 (the pinned commit's eplb.py), so the goldens always come
from the same code. Each case stores its inputs (shape, policy, and the load as a seeded case name or as
numbers) and the reference's ``phy2log``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.eplb.compare import cases, load_digest  # noqa: E402
from services.eplb.policy import num_slots_for  # noqa: E402

REFERENCE_REPO = "deepseek-ai/EPLB"
REFERENCE_COMMIT = "d52c72d5b2f2fb4c41afbf8eb21366820239913d"
REFERENCE_SHA256 = "25b37ccd83aef2369c68f2b4bb596608a4f289956d97d9a3504bfd3159459e29"
OUTPUT = ROOT / "tests/services/eplb/data/deepseek_golden.json"

# The reference README's worked example: 2 layers × 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs.
README_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]

# (experts, GPUs, redundant, groups, nodes) of the seeded hierarchical cases.
HIERARCHICAL_SHAPES = ((64, 8, 16, 8, 2), (256, 64, 64, 8, 8))
PER_SHAPE = 40
PER_HIERARCHICAL_SHAPE = 10


def _load_reference(path: pathlib.Path):
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != REFERENCE_SHA256:
        raise SystemExit(f"{path}: sha256 {digest} is not {REFERENCE_REPO}@{REFERENCE_COMMIT[:12]}'s eplb.py")
    spec = importlib.util.spec_from_file_location("deepseek_eplb_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", required=True, type=pathlib.Path, help="eplb.py at the pinned commit")
    parser.add_argument("--output", type=pathlib.Path, default=OUTPUT)
    args = parser.parse_args()
    import torch

    reference = _load_reference(args.reference)

    def run(weight, num_slots, num_groups, num_nodes, num_gpus):
        phy2log, _, _ = reference.rebalance_experts(torch.tensor([weight]), num_slots, num_groups, num_nodes, num_gpus)
        return phy2log[0].tolist()

    out = []
    for layer, weight in enumerate(README_WEIGHT):
        out.append(
            {
                "name": f"readme/{layer}",
                "weight": weight,
                "num_gpus": 8,
                "num_slots": 16,
                "num_groups": 4,
                "num_nodes": 2,
                "phy2log": run(weight, 16, 4, 2, 8),
            }
        )
    seeded = [(c, 1, 1) for c in cases(PER_SHAPE)]
    for e, g, r, groups, nodes in HIERARCHICAL_SHAPES:
        seeded += [(c, groups, nodes) for c in cases(PER_HIERARCHICAL_SHAPE, ((e, g, r),))]
    for case, groups, nodes in seeded:
        summed = case.window().sum(axis=0)
        num_slots = num_slots_for(case.num_experts, case.num_gpus, case.num_redundant)
        out.append(
            {
                "name": case.name,
                "case": [case.num_experts, case.num_gpus, case.num_redundant, case.kind, case.seed],
                "load_sha256": load_digest(summed),
                "num_gpus": case.num_gpus,
                "num_slots": num_slots,
                "num_groups": groups,
                "num_nodes": nodes,
                "phy2log": run(summed.tolist(), num_slots, groups, nodes, case.num_gpus),
            }
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "repo": REFERENCE_REPO,
                "commit": REFERENCE_COMMIT,
                "sha256": REFERENCE_SHA256,
                "torch": torch.__version__,
                "cases": out,
            },
            separators=(",", ":"),
        )
        + "\n"
    )
    print(f"wrote {len(out)} cases to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
