"""``shinkai generate`` as a process, on the kernel backend with interpreted kernels (``--kernels interpreted``):
``--dp 2`` (two rank processes, gloo, the fixed-capacity expert exchange, the MoE's kernels interpreted) prints
the tokens and logprobs of ``--dp 1`` with ``==`` in the batch-invariant mode, greedy (FP8 experts), and seeded with
DSpark drafts verified on MXFP4 experts, while a live EPLB layout (``--eplb-layout``) moves every layer's experts
between the ranks and takes effect mid-run (after the prefill, with decode steps left). The model is a checkpoint
of tiny's first three layers (a sliding-window, the Engram and a compressed layer) with a one-stage draft tapping
them, written in the released formats; each run loads it as a user's checkpoint. ``--kernels interpreted`` on a
CUDA device and bad ``--eplb-layout`` files are refused with clear errors before any rank starts.

The draft's weights are random, so it proposes tokens the target rarely accepts: the runs check that the
verified rows cross the exchange with one process's bits, not acceptance (tests/services/engine/parallel/
test_kernel_ranks.py rewrites the drafts so that some are accepted).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
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
FLAGS = {
    "greedy": ("--temperature", "0"),
    "seeded-drafts": ("--temperature", "0.8", "--seed", "3", "--num-speculative-tokens", "2", "--expert-format", "fp4"),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """tiny's first three layers with a one-stage DSpark draft tapping them, as a checkpoint directory."""
    cfg = first_layers(preset("tiny"), 3)
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=1, dspark_target_layer_ids=(0, 1, 2))
    return write_sharded_checkpoint(tmp_path_factory.mktemp("tiny-3-dspark"), cfg, seed=0)


# Start-up: rank 0 holds experts 0-3, rank 1 experts 4-7; MOVED trades 1 and 2 for 5 and 7, in new slot orders.
MOVED = {"phy2log": [7, 0, 3, 5, 6, 1, 2, 4], "num_gpus": 2}
SWITCHED = re.compile(r"EPLB layout version 1 in force from step (\d+) of (\d+)")


@pytest.fixture(scope="module")
def layout_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eplb") / "moved.json"
    path.write_text(json.dumps(MOVED))
    return path


@pytest.fixture(scope="module")
def runs(checkpoint, layout_file) -> dict[tuple[str, str], tuple[list[dict], str]]:
    """(flags' name, dp) → the JSON lines and stderr of ``shinkai generate … --dp 1`` and of ``--dp 2`` with the
    live move, greedy and seeded with drafts: four processes started at once (each spends most of its start-up
    importing and loading)."""
    argv = [sys.executable, "-m", "services.entrypoints.cli", "generate", "--model", str(checkpoint)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the runs' processes share this machine's cores
    MOVE = ("--eplb-layout", str(layout_file))
    started = {
        (name, dp): subprocess.Popen(
            [*argv, *COMMON, *flags, *(MOVE if dp == "2" else ()), "--dp", dp],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for name, flags in FLAGS.items()
        for dp in ("1", "2")
    }
    outputs = {}
    for key, run in started.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, (key, err.decode()[-3000:])
        lines = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
        outputs[key] = lines, err.decode()
    return outputs


@pytest.mark.parametrize("name", FLAGS)
def test_generate_dp2_with_interpreted_kernels_equals_dp1(runs, name):
    (one, _), (two, log) = runs[name, "1"], runs[name, "2"]
    (switch,) = SWITCHED.findall(log)
    step, num_steps = map(int, switch)
    assert 0 < step < num_steps, switch  # after the prefill, with decode steps left on the moved experts
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


@pytest.mark.parametrize(
    "layout, flags, message",
    [
        (MOVED, ("--dp", "1"), "--eplb-layout moves experts between ranks: it needs --dp 2 or more"),
        ({**MOVED, "num_gpus": 4}, ("--dp", "2"), "a layout of 8 experts in 8 slots over 4 ranks; this group has 8"),
        ({"phy2log": [0, 1]}, ("--dp", "2"), "a layout needs 'phy2log' and 'num_gpus'"),
        (MOVED, ("--dp", "2", "--eplb-layout-at-step", "-1"), "--eplb-layout-at-step must be ≥ 0"),
    ],
    ids=["one-process", "other-ranks", "not-a-layout", "negative-step"],
)
def test_bad_eplb_layouts_are_refused_before_ranks_start(tmp_path, capsys, layout, flags, message):
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(layout))
    code = main(["generate", "--model", "tiny", "--prompt", "x", "--eplb-layout", str(path), *flags])
    assert code == 2
    assert message in capsys.readouterr().err


def test_max_tokens_defaults_to_16_as_its_help_says(capsys):
    """Without ``--max-tokens`` a prompt gets 16 tokens (the help's default), not the rest of the context."""
    code = main(["generate", "--model", "tiny", "--prompt", "The deep sea is", "--device", "cpu", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["token_ids"]) <= 16
    assert out["finish_reason"] == "stop" or len(out["token_ids"]) == 16
