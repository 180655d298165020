"""Engram tables in host shared memory (services/worker/state/engram_host.py).

- In the batch-invariant mode, tables on the host give ``==`` logits and expert counts to tables held in
  the worker, on the eager ModelRunner and on the static decode step (what a CUDA graph captures),
  through the same scheduler plans; and ``==`` tokens and logprobs through LLM.generate.
- Two processes map one segment: the second sees the first's bytes and writes, its mapping's pages are
  shared (no private copy: the host's memory holds the table once), and /dev/shm holds one file.
- The last user's close removes the file; an earlier user's close leaves it for the others.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.worker.runners.decode_step_graphs import DecodeStepGraphs
from services.worker.runners.model_runner import ModelRunner
from services.worker.runners.static_decode_step import StaticDecodeStep
from services.worker.state.engram_host import SHM_DIR, EngramSegment, segment_name
from tests.scheduler_rs.fake_worker import run_step
from tests.services.worker.runners.test_static_decode_step import setup

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("shinkai-engram-")}


def _runners(model, config, device):
    """(tables in the worker, tables on the host), batch-invariant: DecodeStepGraphs on the reference ops without
    graphs on the CPU; on CUDA the FP8 kernel backend replaying captured graphs."""
    cuda = device == "cuda"
    config = dataclasses.replace(config, batch_invariant=True, kernel_backend="fp8" if cuda else None)
    kw = dict(use_graphs=cuda, attention="triton" if cuda else "reference")
    held = DecodeStepGraphs(ModelRunner(copy.deepcopy(model), config), config, **kw)
    on_host = dataclasses.replace(config, engram_on_host=True)
    host = DecodeStepGraphs(ModelRunner(copy.deepcopy(model), on_host), on_host, **kw)
    return held, host


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
        ),
    ],
)
def test_host_tables_equal_worker_tables_eager_and_static(device):
    sched, eager, _, token_at, config = setup("oracle", device)
    assert eager.model.cfg.engram_layer_ids, "the case must have Engram layers"
    held, host = _runners(eager.model, config, device)
    segment = host.runner.engram_host.segment
    assert os.path.basename(segment.path) in _segments()  # one segment, named per model
    num_static = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        want, got = held.execute(plan, all_rows=True), host.execute(plan, all_rows=True)
        num_static += StaticDecodeStep.fits(plan)
        assert torch.equal(got.logits, want.logits), f"logits differ at {plan}"
        assert torch.equal(got.expert_counts, want.expert_counts)
        assert torch.equal(host.runner.cache.engram_history(), held.runner.cache.engram_history())
        sched.update(plan, run_step(plan, token_at))
    assert num_static >= 20 and host.num_eager > 0  # both paths ran: prefill eager, decode static
    assert host.num_replays == (num_static if device == "cuda" else 0)
    host.runner.engram_host.close()
    assert not os.path.exists(segment.path)  # its last user closed: no /dev/shm leak


def test_a_second_runner_on_the_same_model_stages_the_same_rows():
    """The pool-sizing probe's runner moves the tables first, then the engine's runner moves them again on the
    same model: the second stages the rows the original tables hold."""
    from model.deepseek_v41.engram import Engram
    from services.worker.state.engram_host import EngramHost

    model = copy.deepcopy(setup("oracle", "cpu")[1].model)
    engrams = [m for block in model.layers for m in block.modules() if isinstance(m, Engram)]
    num_rows = min(e.embed.weight.shape[0] for e in engrams)
    rows = torch.randint(0, num_rows, (2, 3, len(engrams), 4), generator=torch.Generator().manual_seed(0))
    want = [e.embed(rows[..., i, :]) for i, e in enumerate(engrams)]
    first = EngramHost.of_model(model)
    second = EngramHost.of_model(model)
    local = second.stage(rows)
    for i, e in enumerate(engrams):
        assert torch.equal(e.embed(local[..., i, :]), want[i])
    second.close()
    first.close()


def test_llm_generate_equal_tokens_with_engram_on_host():
    kw = dict(model="tiny", block_size=16, max_num_batched_tokens=32, max_num_seqs=4, batch_invariant=True)
    held, host = LLM(**kw), LLM(engram_on_host=True, **kw)
    assert host.source.model.cfg.engram_layer_ids
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 17, 40)]
    params = SamplingParams(max_tokens=6, temperature=0)
    want, got = held.generate(prompts, params), host.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    host_tables = host.engine.worker.runner.engram_host
    assert host_tables is not None and os.path.basename(host_tables.segment.path) in _segments()
    host.close()
    host_tables.close()  # (the finalizer at exit would too)
    assert not os.path.exists(host_tables.segment.path)


_CHILD = textwrap.dedent("""
    import sys, torch
    from services.worker.state.engram_host import EngramSegment
    name, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    seg = EngramSegment(name, [{"weight": torch.empty(rows, cols, device="meta")}])
    table = seg.tensors[0]["weight"]
    print(seg.created, float(table.double().sum()), flush=True)  # reads every page
    private = rss = 0
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(seg.path):
            for field in lines[i + 1:]:
                if field.split()[0] in ("Rss:",):
                    rss += int(field.split()[1])
                if field.split()[0] in ("Private_Clean:", "Private_Dirty:"):
                    private += int(field.split()[1])
                if field.split()[0] == "VmFlags:":
                    break
    print(rss, private, flush=True)
    sys.stdin.readline()
    print(float(table[0, 0]), flush=True)  # the parent's write, seen through the shared pages
    sys.stdin.readline()
    seg.close()
""")


def test_two_processes_map_one_copy_and_the_last_close_removes_it():
    rows, cols = 1024, 1024  # 4 MiB of fp32
    table = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    name = segment_name([{"weight": table}])
    seg = EngramSegment(name, [{"weight": table}])
    assert seg.created and torch.equal(seg.tensors[0]["weight"], table)
    root = str(pathlib.Path(__file__).resolve().parents[4])
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, name, str(rows), str(cols)],
        cwd=root,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        created, total = child.stdout.readline().split()
        assert created == "False" and float(total) == float(table.double().sum())
        rss_kib, private_kib = map(int, child.stdout.readline().split())
        assert rss_kib >= table.nbytes // 1024 and private_kib == 0  # every page read, none a private copy
        assert os.stat(seg.path).st_blocks * 512 <= table.nbytes + 2 * 4096  # one copy on the host
        seg.tensors[0]["weight"][0, 0] = 12345.0
        child.stdin.write("\n")
        child.stdin.flush()
        assert float(child.stdout.readline()) == 12345.0
        seg.close()  # the child still holds it
        assert os.path.exists(seg.path)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
    assert not os.path.exists(seg.path)  # the last user removed it


def test_a_segment_of_another_layout_is_refused():
    table = torch.randn(64, 32)
    name = segment_name([{"weight": table}])
    seg = EngramSegment(name, [{"weight": table}])
    try:
        with pytest.raises(ValueError, match="another model"):
            EngramSegment(name, [{"weight": torch.empty(64, 16, device="meta")}])
    finally:
        seg.close()
    assert not os.path.exists(seg.path)
