"""kernels/moe_configs.py: the measured launch-config table of the MoE grouped GEMM: its lookup, when it is not
read, that the launcher takes what it finds, and (GPU) that every config the shipped table holds gives the
default launch's bits at the swept calls."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from kernels import invariance, moe_configs
from kernels.interpret import interpreter, load_interpreted

ENTRY = {"num_warps": 8, "num_stages": 5, "programs_per_sm": 1}


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A table for a device named "Test GPU" with one key, entries at 1 and 64 tokens."""
    monkeypatch.setattr(moe_configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    monkeypatch.delenv(moe_configs.ENV, raising=False)
    moe_configs._table.cache_clear()
    moe_configs._device_name.cache_clear()
    key = moe_configs.shape_key(3, 256, 128, swiglu=True, a_fp8=False, out_dtype=torch.float8_e4m3fn)
    other = {"num_warps": 4, "num_stages": 3, "programs_per_sm": 2}
    moe_configs.config_path("Test GPU").write_text(json.dumps({key: {"1": other, "64": ENTRY}}))
    yield key
    moe_configs._table.cache_clear()
    moe_configs._device_name.cache_clear()


def test_the_path_names_the_device():
    assert moe_configs.config_path("NVIDIA H200").name == "moe_grouped_gemm-nvidia-h200.json"


def test_the_nearest_measured_count_wins_and_a_tie_takes_the_smaller():
    by_tokens = {1: {"num_warps": 1}, 16: {"num_warps": 16}, 64: {"num_warps": 64}}
    assert [moe_configs.nearest(by_tokens, t)["num_warps"] for t in (1, 8, 9, 40, 41, 1000)] == [1, 1, 16, 16, 64, 64]
    assert moe_configs.nearest(by_tokens, 40) == {"num_warps": 16}  # 24 from 16, 24 from 64: the smaller


def test_lookup_reads_the_device_table_only_where_it_may(table, monkeypatch):
    cuda = torch.device("cuda")
    assert moe_configs.lookup(cuda, table, 50) == ENTRY
    assert moe_configs.lookup(cuda, table, 20)["num_warps"] == 4
    assert moe_configs.lookup(cuda, "E1 N128 K128 plain a8 out16", 50) == {}  # a shape without an entry
    assert moe_configs.lookup(torch.device("cpu"), table, 50) == {}  # the interpreter's launches
    with invariance.fixed_configs():
        assert moe_configs.lookup(cuda, table, 50) == {}
    monkeypatch.setenv(moe_configs.ENV, "0")
    assert moe_configs.lookup(cuda, table, 50) == {}


def test_the_launcher_takes_the_table_unless_a_field_is_given(monkeypatch):
    """The looked-up fields reach the launch; with any field passed by the caller the table is not read."""
    from kernels import reference

    gemm = load_interpreted("moe_grouped_gemm")
    monkeypatch.setitem(sys.modules, "kernels.moe_grouped_gemm", gemm)
    launches: list[dict] = []
    keys: list[tuple[str, int]] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append({"grid": grid, **kwargs})

    def lookup(device, key, num_tokens):
        keys.append((key, num_tokens))
        return ENTRY

    monkeypatch.setattr(gemm, "_moe_gemm_kernel", Recorder())
    monkeypatch.setattr(gemm.moe_configs, "lookup", lookup)
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_experts, k, n = 5, 3, 128, 256
    experts = torch.rand(num_tokens, num_experts, generator=gen).argsort(-1)[:, :2]
    meta = reference.route_metadata(experts, torch.rand(num_tokens, 2, generator=gen), num_experts)
    w = torch.zeros(num_experts, 2 * n, k).to(torch.float8_e4m3fn)
    scale = torch.ones(num_experts, 2 * n // 128, k // 128)
    x = torch.randn(num_tokens, k)
    with interpreter():
        gemm.moe_grouped_gemm(x, w, scale, meta, gather=True, swiglu_limit=7.0, out_dtype=torch.float8_e4m3fn)
        gemm.moe_grouped_gemm(
            x, w, scale, meta, gather=True, swiglu_limit=7.0, out_dtype=torch.float8_e4m3fn, num_stages=2
        )
    key = moe_configs.shape_key(num_experts, 2 * n, k, swiglu=True, a_fp8=False, out_dtype=torch.float8_e4m3fn)
    assert keys == [(key, 8)]  # the table is read at T's power of two (5 tokens: 8), so a step's configs are bounded
    assert (launches[0]["num_warps"], launches[0]["num_stages"]) == (8, 5)
    assert launches[0]["grid"] == (min(num_experts * (n // 128), 4 * 1),)  # 4 SMs off the GPU, 1 program each
    assert (launches[1]["num_warps"], launches[1]["num_stages"], launches[1]["grid"]) == (4, 2, (6,))


def test_the_shipped_tables_hold_only_valid_configs():
    for path in moe_configs.CONFIG_DIR.glob("moe_grouped_gemm-*.json"):
        for key, by_tokens in json.loads(path.read_text()).items():
            assert len(key.split()) == 6, key
            for t, config in by_tokens.items():
                assert int(t) >= 1 and set(config) == set(moe_configs.FIELDS), (path.name, key, t)
                assert config["num_warps"] in (4, 8) and 1 <= config["num_stages"] <= 6
                assert 1 <= config["programs_per_sm"] <= 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_every_shipped_config_gives_the_default_bits(monkeypatch):
    """At each swept call (the bench's quick sizes) the config the device's table holds gives the bits of the
    launcher's defaults, as the table's docstring promises."""
    from services.bench.kernels import moe_configs as sweep

    path = moe_configs.config_path(torch.cuda.get_device_name())
    if not path.is_file():
        pytest.skip(f"no table for this device ({path.name})")
    shipped = json.loads(path.read_text())
    monkeypatch.setenv(moe_configs.ENV, "0")  # a call without fields: the launcher's defaults
    gen = torch.Generator(device="cuda").manual_seed(0)
    checked = 0
    for name, t, key, call, _, _ in sweep._problems(sweep.QUICK_MOE_TOKENS, sweep.QUICK_WO_A_TOKENS, gen):
        if key not in shipped:
            continue
        config = moe_configs.nearest({int(n): c for n, c in shipped[key].items()}, t)
        want, got = sweep.outputs(call), sweep.outputs(call, **config)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (name, t, config)
        checked += 1
    assert checked > 0
