"""``shinkai generate`` as a process, on the kernel backend with interpreted kernels (``--kernels interpreted``):
``--dp 2`` (two rank processes, gloo, the fixed-capacity expert exchange, the MoE's kernels interpreted) prints
the tokens and logprobs of ``--dp 1`` with ``==`` in the batch-invariant mode, greedy, and seeded with DSpark
drafts verified on MXFP4 experts. The model is a checkpoint of tiny's first three layers (a sliding-window, the
Engram and a compressed layer) with a one-stage draft tapping them, written in the released formats; each run
loads it as a user's checkpoint. ``--kernels interpreted`` is refused with a clear error on a CUDA device.

The draft's weights are random, so it proposes tokens the target rarely accepts: the runs check that the
verified rows cross the exchange with one process's bits, not acceptance (tests/services/engine/parallel/
test_kernel_ranks.py rewrites the drafts so that some are accepted).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model.deepseek_v41.init import first_layers, write_sharded_checkpoint
from model.deepseek_v41.presets import preset
from services.entrypoints.cli import main

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ("The deep sea is", "Hello")  # one a rank with --dp 2 (requests spread by load)
COMMON = ("--kernels", "interpreted", "--batch-invariant", "--max-num-seqs", "2", "--max-tokens", "3", "--json")
GREEDY = ("--temperature", "0")
SEEDED_DRAFTS = ("--temperature", "0.8", "--seed", "3", "--num-speculative-tokens", "2", "--expert-format", "fp4")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """tiny's first three layers with a one-stage DSpark draft tapping them, as a checkpoint directory."""
    cfg = first_layers(preset("tiny"), 3)
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=1, dspark_target_layer_ids=(0, 1, 2))
    return write_sharded_checkpoint(tmp_path_factory.mktemp("tiny-3-dspark"), cfg, seed=0)


def generate_both(checkpoint: Path, flags: tuple[str, ...]) -> tuple[list[dict], list[dict]]:
    """``shinkai generate … --dp 1`` and ``--dp 2``, run at once as two processes: each one's JSON lines."""
    argv = [sys.executable, "-m", "services.entrypoints.cli", "generate", "--model", str(checkpoint)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    argv += [*COMMON, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two ranks and one process share this machine's cores
    runs = [
        subprocess.Popen([*argv, "--dp", dp], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for dp in ("1", "2")
    ]
    outputs = []
    for run in runs:
        out, err = run.communicate(timeout=240)
        assert run.returncode == 0, err.decode()[-3000:]
        outputs.append([json.loads(line) for line in out.decode().splitlines() if line.startswith("{")])
    return outputs[0], outputs[1]


@pytest.mark.parametrize("flags", [GREEDY, SEEDED_DRAFTS], ids=["greedy", "seeded-drafts"])
def test_generate_dp2_with_interpreted_kernels_equals_dp1(checkpoint, flags):
    one, two = generate_both(checkpoint, flags)
    assert [o["prompt"] for o in one] == [o["prompt"] for o in two] == list(PROMPTS)
    for a, b in zip(one, two, strict=True):
        assert len(a["token_ids"]) == 3 and a["finish_reason"] == "length"
        assert b["token_ids"] == a["token_ids"], a["prompt"]
        assert b["logprobs"] == a["logprobs"], a["prompt"]  # exact floats (``--json``)
    assert one[0]["token_ids"] != one[1]["token_ids"]  # two requests, not one answer twice


def test_interpreted_kernels_are_refused_on_cuda(capsys):
    code = main(["generate", "--model", "tiny", "--prompt", "x", "--kernels", "interpreted", "--device", "cuda"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--kernels interpreted runs Triton's interpreter on the CPU, but --device is 'cuda'" in err
