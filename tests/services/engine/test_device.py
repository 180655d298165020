"""Device selection: `--device` parsing and its defaults (the fast path on CUDA, each part with an off
switch), the flags' round trip through a command line, and the pool sizing arithmetic."""

import argparse

import pytest

from services.engine import device as device_mod
from services.engine.config import EngineConfig
from services.engine.device import add_device_arguments, device_args, device_argv, device_engine_args, resolve_device
from services.engine.pool_sizing import SNAPSHOT_SHARE, PoolPlan, plan_blocks, plan_snapshots


def test_default_is_cpu_without_cuda_and_cuda_is_refused_there(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == "cpu"
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda:0")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cpu:1", "CUDA", ""])
def test_malformed_devices_are_named(bad):
    with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(")):
        resolve_device(bad)


def test_cpu_keeps_the_torch_model(monkeypatch):
    args = device_engine_args({"device": "cpu", "max_num_seqs": 4})
    assert args == {"device": "cpu", "max_num_seqs": 4}
    config = EngineConfig(**args)
    assert config.kernel_backend is None and not config.cuda_graphs and not config.async_scheduling


def test_cuda_defaults_are_the_fast_path_each_with_an_off_switch(monkeypatch):
    monkeypatch.setattr(device_mod, "resolve_device", lambda d: d or "cuda")
    assert device_engine_args({}) == {
        "device": "cuda",
        "kernel_backend": "fp8",
        "async_scheduling": True,
        "expert_format": "fp4",
        "cuda_graphs": True,
        "warmup": True,
    }
    assert device_engine_args({"expert_format": "fp8"})["expert_format"] == "fp8"  # the off switch
    eager = EngineConfig(**device_engine_args({"enforce_eager": True}))
    assert eager.kernel_backend == "fp8" and not eager.cuda_graphs and eager.enforce_eager
    sync = device_engine_args({"device": "cuda:1", "async_scheduling": False})
    assert sync["async_scheduling"] is False and sync["device"] == "cuda:1"
    torch_model = device_engine_args({"kernel_backend": None})
    assert torch_model["kernel_backend"] is None and torch_model["cuda_graphs"] is False
    assert torch_model["warmup"] is False and device_engine_args({"warmup": False})["warmup"] is False  # no compiles
    # Speculative decoding runs eagerly and synchronously: the kernel backend stays, graphs and async do not.
    spec = device_engine_args({"num_speculative_tokens": 3})
    assert (spec["kernel_backend"], spec["async_scheduling"], spec["cuda_graphs"]) == ("fp8", False, False)
    assert EngineConfig(**spec).num_speculative_tokens == 3


def test_flags_round_trip_through_a_command_line():
    parser = argparse.ArgumentParser()
    add_device_arguments(parser)
    assert device_args(parser.parse_args([])) == {}
    given = parser.parse_args(
        [
            "--device",
            "cuda:0",
            "--enforce-eager",
            "--no-async-scheduling",
            "--gpu-memory-utilization",
            "0.8",
            "--load-format",
            "dummy",
        ]
    )
    values = device_args(given)
    assert values == {
        "device": "cuda:0",
        "enforce_eager": True,
        "async_scheduling": False,
        "gpu_memory_utilization": 0.8,
        "load_format": "dummy",
    }
    assert device_args(parser.parse_args(device_argv(values))) == values


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"load_format": "pt"}, "load_format"),
        ({"enforce_eager": True, "cuda_graphs": True, "kernel_backend": "fp8"}, "contradict"),
    ],
)
def test_bad_engine_fields_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)


def test_pool_plan_gives_the_blocks_that_fit():
    gib = 2**30
    # 100 GiB budget, 80 GiB model + step, 17 slots of 1 MiB, 2 GiB graph reserve: 18 GiB − 17 MiB of blocks.
    blocks = plan_blocks(100 * gib, 80 * gib, 2**20, 2**20, 17)
    assert blocks == 18 * 1024 - 17
    assert plan_blocks(10 * gib, 9 * gib, 2**20, 2**20, 17) < 0  # the caller refuses this
    plan = PoolPlan(blocks, 17, 2**20, 2**20, 70 * gib, 80 * gib, 100 * gib, 128)
    assert plan.max_tokens == (blocks - 1) * 128
    assert f"longest context that fits: {4096} tokens" in plan.describe(4096)


def test_the_default_snapshot_count_is_capped_by_bytes():
    """4 · max_num_seqs snapshots, unless their bytes pass SNAPSHOT_SHARE of what the pools get: at v41-s1
    (2,916,132-byte slots) with 9 GiB for the pools, 64 sequences keep their 256 and 256 sequences get 331, not
    1,024 (which would take 2.8 GiB of blocks)."""
    gib, slot = 2**30, 2_916_132
    assert SNAPSHOT_SHARE == 0.1
    assert plan_snapshots(9 * gib, slot, 4 * 64) == 256
    assert plan_snapshots(9 * gib, slot, 4 * 256) == int(0.1 * 9 * gib) // slot == 331
    assert plan_snapshots(-gib, slot, 64) == 0  # nothing left: the caller refuses the blocks anyway


def test_interpreted_kernels_give_the_cpu_kernel_backend_and_are_refused_elsewhere():
    """``--kernels interpreted``: the CPU, the FP8 kernel backend unless another is given, and the interpreted step
    set as a picklable module-level context (it crosses the spawn to rank processes), batch-invariant as asked."""
    import pickle

    from services.engine.device import kernel_args
    from services.worker.kernel_model.interpreted_kernels import step_kernels

    assert kernel_args(None, {"device": "cuda"}) == {}
    args = kernel_args("interpreted", {"batch_invariant": True})
    assert (args["device"], args["kernel_backend"]) == ("cpu", "fp8")
    kernels = pickle.loads(pickle.dumps(args["kernels"]))
    assert (kernels.func, kernels.keywords) == (step_kernels, {"batch_invariant": True})
    assert kernel_args("interpreted", {"device": "cpu", "kernel_backend": "fp32"})["kernel_backend"] == "fp32"
    with pytest.raises(ValueError, match="runs Triton's interpreter on the CPU, but --device is 'cuda:1'"):
        kernel_args("interpreted", {"device": "cuda:1"})
    with pytest.raises(ValueError, match="cannot go with kernel_backend None"):
        kernel_args("interpreted", {"kernel_backend": None})
    with pytest.raises(ValueError, match="--kernels takes 'interpreted'"):
        kernel_args("compiled", {})
